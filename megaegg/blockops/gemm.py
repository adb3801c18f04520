"""gemm: ``out[M, N] = x[M, K] @ w[N, K]^T`` on Hopper tensor cores, one ``bm`` x ``bn`` output tile an
instance (``interpreter/cuda/gemm_tile.cuh``: TMA copies into an mbarrier ring, wgmma through CuTe).

The linear of a batch or a prompt (M a runtime dim): each instance reads a ``bm``-row tile of x and
``bn`` weight rows once from shared memory for ``bm`` x ``bn`` products, where the matvec reads its
weight rows once per 16 x rows (docs/perf-notes.md #68). Tiles (``GEMM_TILES``): 128 x 256 for a
prompt, or 128 x 128 where the wide tiles are too few for the SMs (qwen3-8b's O and down projections at
512 rows: 64 tiles of 128 x 256); 64 x 64 and 64 x 128 for a batch of ~64 rows, memory-bound, where a
128-row tile would be half zeros. Its grid is ``(N tiles, M tiles[, splits])``, the weight tiles outermost as the runtime-M
matvec's, so the instances sharing a weight tile run back to back and it streams from HBM about once.
Its footprints are tiles, so a consumer's tile waits only for the producer tiles it reads.

Operand roles (``params["roles"]``): ``x``, ``w`` and optionally ``w2`` (gated: ``out = silu(x w^T) *
(x w2^T)``, ``bn / 2`` output columns a tile from ``bn / 2`` rows of each weight) and ``r`` (residual:
``out = r + x w^T``). x, w and w2 are read through tensor maps (``tma_inputs``): bf16, rows contiguous,
16-byte aligned row strides (``GemmTerm.fits``). Rounding follows the unfused ops, as the matvec's does;
an RMSNorm before it is its own op (``rms_norm_rows``).

Split over K (``splits`` S > 1, 64-row tiles): for at most ``bm`` x rows (one row tile: a batch) instance
``(j, i, s)`` computes its tile's products over K columns ``[s*K/S, (s+1)*K/S)`` into an f32 partial tile,
and the last of the tile's S splits to arrive (an arrival counter per weight tile, in the launch-zeroed
counter bank) sums the partials in split order and applies the epilogue (rounding, residual, gate) as the
unsplit tile does; past ``bm`` rows ``s`` is always 0 and the tile unsplit. Why: a batch's projections as
64-row tiles are too few to stream their weights on every SM (llama-3.2-1b's O projection: 32 tiles of
64 x 64); split, each SM streams a share of K (as ``matvec_split`` does on the matvec path).
"""

from __future__ import annotations

import math

from ..dims import ceildiv, dmax, dmin
from ..dtypes import bf16
from ..dtypes import f32 as F32
from ..dtypes import i32 as I32
from .base import NONE, BlockKind, CudaOperand, Deferred, Partition, Term, c_call, fields, register, term
from ..ir.footprint import Full, Tile
from .matvec import roles, write_tile

BK = 64  # K columns a k-tile (one 128-byte swizzle row)
# (bm x rows, bn weight rows) a tile (gemm.cuh: GemmTileShape; a gated tile: bn / 2 of each weight).
# bm = 128: two warpgroups of 64 rows; bm = 64: one (gemm_tile.cuh).
GEMM_TILES = ((128, 256), (128, 128), (64, 64), (64, 128))
# The share of the tensor-core rate a tile reaches: a 64-row tile's one warpgroup issues small wgmmas alone
# (no second warpgroup to overlap its waits and epilogue): priced at half, so that a prompt keeps the
# 128-row tiles and a batch of ~64 rows, memory-bound, takes the 64-row ones. A 128 x 128 tile reads its
# A operand from shared memory twice as often a FLOP as a 128 x 256 one and drains its ring twice as
# often: priced below it, so that it wins only where the wide tiles leave SMs idle (fewer tiles than SMs,
# or a last wave mostly empty), not on a tie of whole waves.
MMA_SHARE = {(128, 256): 1.0, (128, 128): 0.75, (64, 64): 0.5, (64, 128): 0.5}
GEMM_SPLITS = {128: (1,), 64: (1, 2, 4, 8)}  # K splits a tile of bm rows may take
MIN_SPLIT_K = 256  # K columns a split reads, at least (4 k-tiles: the ring's depth)


@register
class Gemm(BlockKind):
    name = "gemm"
    cuda_file = "gemm.cuh"
    waits_in_body = True  # the first stages' weight copies are issued before the wait on x
    last_writer = True  # a split tile's instances all declare it; the last to arrive writes it
    deferred = Deferred("GemmJob", "gemm_job", "gemm_run")  # one tile in the kernel for every gemm op

    def build(self, inputs, output, params) -> Partition:
        n_out, bm = out_cols(params), params["bm"]
        tile_mn = (Tile(1, bm), Tile(0, n_out))
        reads = []
        for role in params["roles"]:
            if role in ("w", "w2"):
                reads.append((Tile(0, n_out), Full()))
            elif role == "r":
                reads.append(tile_mn)
            else:  # x
                reads.append((Tile(1, bm), Full()))
        if params.get("splits", 1) > 1:
            reads += [(Full(), Full()), (Full(),)]  # the partial tiles and the arrival counters (internal)
        grid = (ceildiv(output.shape[1], n_out), ceildiv(output.shape[0], bm))
        if params.get("splits", 1) > 1:
            grid = (*grid, split_count(output.shape[0], bm, params["splits"]))
        return Partition(grid=grid, reads=tuple(reads), writes=tile_mn)

    def internal_inputs(self, op):
        n = len(op.params["roles"])
        return (n, n + 1) if op.params.get("splits", 1) > 1 else ()

    def tma_inputs(self, op) -> tuple[int, ...]:
        return tuple(k for k, role in enumerate(op.params["roles"]) if role in ("x", "w", "w2"))

    def deferred_template(self, ops) -> str:
        """gemm_run<TILES>: the tile shapes these ops use (each one more inlined copy of the tile)."""
        shapes = sorted({(op.params["bm"], op.params["bn"]) for op in ops}, reverse=True)
        return "<" + " | ".join(f"GEMM_TILE_{bm}x{bn}" for bm, bn in shapes) + ">"

    def tma_box_rows(self, op, k: int) -> int:
        """x's box is the tile's rows; a weight's is gemm_tile.cuh's w_box: ``bn / 2`` rows of each weight
        of a gated tile, else ``bn`` in boxes of at most 128."""
        p = op.params
        if p["roles"][k] == "x":
            return p["bm"]
        return p["bn"] // 2 if "w2" in p["roles"] else min(p["bn"], 128)

    def cpu(self, op, env, ins, out):
        n_out = out_cols(op.params)
        bm = op.params["bm"]
        m0, r0 = env["_i1"] * bm, env["_i0"] * n_out
        n_rows = ins[roles(op)["w"]].shape[0]
        write_tile(op, ins, out, slice(m0, min(m0 + bm, out.shape[0])), slice(r0, min(r0 + n_out, n_rows)))

    def cuda_call(self, op, ins, out: CudaOperand) -> str:
        k = roles(op)
        x, w = ins[k["x"]], ins[k["w"]]
        epi = "GEMM_GATED" if "w2" in k else "GEMM_RESID" if "r" in k else "GEMM_PLAIN"
        r = ins[k["r"]].view(0, 1) if "r" in k else "Mat<const __nv_bfloat16>{}"
        kdim = op.inputs[k["x"]].shape[1].value
        splits = op.params.get("splits", 1)
        n_in = len(op.params["roles"])
        part, arrive = (f"(float*){ins[n_in].ptr}", f"(unsigned*){ins[n_in + 1].ptr}") if splits > 1 else ("nullptr", "nullptr")
        args = [("job", "gemm_job"), ("tmap_x", x.tmap), ("tmap_w", w.tmap),
                ("tmap_w2", ins[k["w2"]].tmap if "w2" in k else "nullptr"), ("r", r),
                ("out", out.view(0, 1, const=False)), ("M", out.shape[0]), ("N", out.shape[1]), ("K", f"{kdim}"),
                ("m_tile", "c1"), ("n_tile", "c0"), ("part", part), ("arrive", arrive), ("splits", f"{splits}"),
                ("split", "c2" if splits > 1 else "0")]
        return c_call("gemm", [epi, op.params["bm"], op.params["bn"]], args)

    def bytes_moved(self, op, env):
        k = roles(op)
        k_dim = op.inputs[k["x"]].shape[1].value
        n, m = op.output.shape[1].eval(env), op.output.shape[0].eval(env)
        item = op.output.dtype.itemsize
        # HBM bytes: the M tiles of a weight tile run back to back (L2 hits after the first), and so do x's
        # re-reads by the N tiles, mostly
        w_bytes = (2 if "w2" in k else 1) * n * k_dim * item
        total = w_bytes + m * k_dim * item + m * n * item * (2 if "r" in k else 1)
        if split_rows(op.params, m):  # x read by every weight tile (from L2); the partials written, then read
            n_tiles = op.grid[0].eval(env)
            total += m * k_dim * item * (n_tiles - 1) + 2 * 4 * op.params["splits"] * m * n * (2 if "w2" in k else 1)
        return total

    def pipeline_steps(self, op, env) -> float:
        """k-tiles of all instances. A k-tile waits about as long whatever its bytes: a 64 x 64 tile's 16 KB
        k-tiles streamed ~33 GB/s an SM in the model (llama-3.2-1b's down projection at 64 rows: 128 k-tiles
        in ~62 us, perf-notes #84), where the cost model's 1.9 us / 3 in flight gives 25."""
        k_dim = op.inputs[roles(op)["x"]].shape[1].value
        return -(-k_dim // BK) * op.grid[0].eval(env) * op.grid[1].eval(env)

    def hops(self, op, env) -> int:
        """A split tile's combine: one more dependent round trip (the counter, then the partials)."""
        return 1 if split_rows(op.params, op.output.shape[0].eval(env)) else 0

    def flops(self, op, env) -> float:
        """Tensor-core work of the whole op, whole tiles (a ragged tile costs a full one), at the full rate's
        equivalent (``MMA_SHARE``)."""
        k = roles(op)
        k_dim = op.inputs[k["x"]].shape[1].value
        tiles = op.grid[0].eval(env) * op.grid[1].eval(env)
        bm, bn = op.params["bm"], op.params["bn"]
        return 2.0 * bm * bn * k_dim * tiles / MMA_SHARE[bm, bn]


def split_count(m, bm: int, splits: int):
    """The launch count of a split op's third grid axis: ``splits`` for at most ``bm`` x rows, else 1."""
    return splits - (splits - 1) * dmin(1, dmax(0, ceildiv(m, bm) - 1))


def split_rows(params, m: int) -> bool:
    """Whether ``m`` x rows run split over K (partials and a combine)."""
    return params.get("splits", 1) > 1 and 0 < m <= params["bm"]


def out_cols(params) -> int:
    """Output columns of a tile: ``bn``, or half of it for a gated tile."""
    return params["bn"] // 2 if "w2" in params["roles"] else params["bn"]


@term
class GemmTerm(Term):
    """``x @ w^T`` [* silu gate ``w2``] [+ ``r``] as ``bm`` x ``bn`` tensor-core tiles (x rows a runtime dim)."""

    name = "gemm"
    fields = fields("x:ref w:ref w2:ref r:ref bm:int bn:int splits:int")
    tile = "bn"
    min_rows = min(bm for bm, _ in GEMM_TILES)
    rows_from_all_leading = True  # (transformers' [1, n, K] activations are n rows)
    needs = "bf16 operands with 16-byte aligned rows, a weight of [N, K], and a runtime row count"

    def rows_needed(self, args) -> int:
        return args["bm"]  # (a 128-row tile only from 128 rows)

    def siblings(self, args):
        return ("gemm", args["x"])

    def fits(self, graph, args) -> bool:
        x, w = graph.nodes[args["x"]], graph.nodes[args["w"]]
        if (args["bm"], args["bn"]) not in GEMM_TILES or args["splits"] not in GEMM_SPLITS[args["bm"]]:
            return False
        if args["w2"] != NONE and args["r"] != NONE:  # (a tile gates or adds, not both: GemmEpi)
            return False
        ws = [w] + ([graph.nodes[args["w2"]]] if args["w2"] != NONE else [])
        if x.dtype != bf16 or any(v.dtype != bf16 or v.op != "weight" or len(v.shape) != 2 for v in ws):
            return False
        k = x.shape[-1]
        if not k.is_const or k.value % 8 or any(v.shape[1] != k for v in ws):
            return False
        if args["splits"] > 1:  # whole k-tiles a split, a few of them
            ks, rem = divmod(k.value, args["splits"])
            if rem or ks % BK or ks < MIN_SPLIT_K:
                return False
        return not all(d.is_const for d in x.shape[:-1])  # a batch or a prompt

    def lower(self, b, value, args):
        present = tuple(r for r in ("x", "w", "w2", "r") if args[r] != NONE)
        inputs = [b.rows(b.operand(args[r])) if r in ("x", "r") else b.operand(args[r]) for r in present]
        out = b.rows(b.output(value))
        bm, bn, splits = args["bm"], args["bn"], args["splits"]
        params = {"bm": bm, "bn": bn, "roles": present}
        if splits > 1:  # the partial tiles (both halves of a gated one) and a counter per weight tile
            params["splits"] = splits
            n_tiles = math.ceil(out.shape[1].value / out_cols(params))
            inputs.append(b.scratch(f"gemm_part{value}", (n_tiles * splits, bm * bn), F32))
            inputs.append(b.accum(f"gemm_arrive{value}", (n_tiles,), I32))
        b.emit("gemm", b.absorbed(value, {args[r] for r in present}), inputs, out, params)

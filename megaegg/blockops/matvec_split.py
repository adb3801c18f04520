"""matvec_split: a runtime M's ``out[M, N] = x[M, K] @ w[N, K]^T`` [+ ``r``] split over K.

Instance ``(j, i, s)`` takes weight rows ``[j*rows, ...)`` and x rows ``[i*64, ...)``; for 17 to 64
x rows (one row tile: a batch) it computes their products over K columns ``[s*K/S, (s+1)*K/S)``
into an f32 partial tile, and the last of a tile's S splits to arrive (an arrival counter per weight
tile, in the launch-zeroed counter bank) sums the partials in split order, rounds, adds the residual
and stores the tile (interpreter/cuda/matvec_split.cuh). For at most 16 x rows nothing is split:
``s`` picks half of the tile's weight rows, over all of K, so the op runs as a matvec of ``rows / 2``-row tiles would (the
combine's round trip costs more than the fewer x reads save there, docs/perf-notes.md #87, and the
extractor, pricing a 16-row hint, sees the matvec's price and breaks the tie at 64 rows:
rewrite/schedule.py); past 64 an instance is the unsplit matvec (the partials hold one row tile).

Why: a batch's narrow projections (the O projection, the down projection: N = K / 4) as matvec
tiles of 16-24 weight rows read the batch's x once per tile, 1 MB an instance against 256 KB of
weights (docs/perf-notes.md #79); tiles of 32-64 weight rows read x a half to a quarter as often,
and the split over K keeps 128+ instances streaming.
"""

from __future__ import annotations

import math

from ..dims import ceildiv, dmax, dmin
from ..dtypes import f32 as F32
from ..dtypes import i32 as I32
from ..ir.footprint import Full, Tile
from .base import NONE, BlockKind, Partition, Term, c_call, fields, no_view, register, term
from .matvec import MMA_SYNC_COST, WIDE_MROWS, roles, wide_fits, write_tile

MIN_SPLIT_K = 256  # K columns a split reads, at least (a wide tile's ring wants a few stages)
FEW_ROWS = 16  # x rows up to which a tile runs as two halves, unsplit (matvec_split.cuh: MEGA_SPLIT_FEW)


def split_count(m, splits: int):
    """The launch count of the third grid axis: the tile's two halves for at most FEW_ROWS x rows, ``splits``
    for at most one row tile (64), else 1."""
    def past(bound):  # 0 up to ``bound`` rows, 1 past it (and 0 at no rows)
        return dmin(1, dmax(0, ceildiv(m, bound) - 1))

    few, many = past(FEW_ROWS), past(WIDE_MROWS)
    return 2 * (1 - few) + splits * (few - many) + many


def split_rows(m: int) -> bool:
    """Whether ``m`` x rows run split over K (partials and a combine)."""
    return FEW_ROWS < m <= WIDE_MROWS


@register
class MatVecSplit(BlockKind):
    """Inputs ``x, w[, r], part, arrive``: ``part`` (the f32 partial tiles) and ``arrive`` (a counter per
    weight tile) are the op's own, ordered by its arrival counter."""

    name = "matvec_split"
    cuda_file = "matvec_split.cuh"
    waits_in_body = True  # the first weight stages are in flight while it waits
    last_writer = True  # a tile's splits all declare it; the last to arrive writes it

    def internal_inputs(self, op):
        n = len(op.params["roles"])
        return (n, n + 1)

    def build(self, inputs, output, params) -> Partition:
        rows, splits = params["rows"], params["splits"]
        m = output.shape[0]
        tile = (Tile(1, WIDE_MROWS), Tile(0, rows))
        # (x and w whole along K: with one split, an instance reads all of it)
        reads = {"x": (Tile(1, WIDE_MROWS), Full()), "w": (Tile(0, rows), Full()), "r": tile}
        grid = (ceildiv(output.shape[1], rows), ceildiv(m, WIDE_MROWS), split_count(m, splits))
        return Partition(grid=grid, reads=(*(reads[r] for r in params["roles"]), (Full(), Full()), (Full(),)),
                         writes=tile)

    def cpu(self, op, env, ins, out):
        # every split computes its tile (the simulator lets readers in once all of them have run)
        rows = op.params["rows"]
        m0, r0 = env["_i1"] * WIDE_MROWS, env["_i0"] * rows
        n = op.output.shape[1].value
        write_tile(op, ins, out, slice(m0, m0 + WIDE_MROWS), slice(r0, min(r0 + rows, n)))

    def cuda_call(self, op, ins, out) -> str:
        k, p = roles(op), op.params
        x, w = ins[k["x"]], ins[k["w"]]
        part, arrive = ins[len(p["roles"])], ins[len(p["roles"]) + 1]
        kdim, n = op.inputs[k["w"]].shape[1].value, op.inputs[k["w"]].shape[0].value

        def rows_of(o) -> str:  # the operand advanced to this instance's first x row
            return f"({o.ptr} + c1 * {WIDE_MROWS} * {o.strides[0]})"

        r = ins[k["r"]].view(ptr=rows_of(ins[k["r"]])) if "r" in k else no_view(2, x.ctype)
        args = [("smem", "smem"), ("x", x.view(ptr=rows_of(x))), ("w", w.view()), ("r", r),
                ("out", out.view(ptr=rows_of(out), const=False)), ("part", f"(float*){part.ptr}"),
                ("arrive", f"(unsigned*){arrive.ptr}"), ("N", f"{n}LL"), ("n_tile", "c0"), ("split", "c2"),
                ("M", f"({out.shape[0]})"), ("mvalid", f"min_i64({WIDE_MROWS}LL, ({out.shape[0]}) - c1 * {WIDE_MROWS})"), ("wl", "wl")]
        return c_call("matvec_split", [x.ctype, kdim, p["splits"], p["rows"], "true" if "r" in k else "false"], args)

    def bytes_moved(self, op, env):
        k = roles(op)
        n_tiles, m_tiles, third = (g.eval(env) for g in op.grid)
        k_dim = op.inputs[k["w"]].shape[1].value
        n, m = op.output.shape[1].eval(env), op.output.shape[0].eval(env)
        item = op.output.dtype.itemsize
        split = split_rows(m)
        partials = 2 * 4 * third * m * n if split else 0  # written, then read by the last arrival
        x_reads = n_tiles * (1 if split else third)  # (each half tile reads all of x)
        return n * k_dim * item * m_tiles + m * k_dim * item * x_reads + m * n * item * (2 if "r" in k else 1) + partials

    def flops(self, op, env):
        """Tensor-core products (x rows in tiles of 8) at mma.sync's rate, as the matvec's."""
        k = roles(op)
        k_dim = op.inputs[k["w"]].shape[1].value
        m, n = op.output.shape[0].eval(env), op.output.shape[1].eval(env)
        return MMA_SYNC_COST * 2.0 * (-(-m // 8) * 8) * n * k_dim

    def hops(self, op, env):
        """The last arrival's combine: one more dependent round trip (the counter, then the partials)."""
        return 1 if split_rows(op.output.shape[0].eval(env)) else 0


@term
class MatVecSplitTerm(Term):
    """``x @ w^T`` [+ ``r``] for a runtime row count, ``rows`` weight rows an instance, K split ``splits`` ways."""

    name = "matvec_split"
    fields = fields("x:ref w:ref r:ref rows:int splits:int")
    tile = "rows"
    needs = "bf16 / f16 operands, a weight of [N, K] with K a multiple of 64 x splits, and a runtime row count"

    def fits(self, graph, args) -> bool:
        x, w = graph.nodes[args["x"]], graph.nodes[args["w"]]
        if x.dtype.name not in ("bf16", "f16") or w.dtype != x.dtype or w.op != "weight" or len(w.shape) != 2:
            return False
        k = x.shape[-1]
        if not k.is_const or w.shape[1] != k or all(d.is_const for d in x.shape[:-1]):
            return False
        ks, rem = divmod(k.value, args["splits"])
        return not rem and ks % 64 == 0 and ks >= MIN_SPLIT_K and args["rows"] % 16 == 0 and \
            wide_fits(ks, x.dtype, args["rows"], gated=False)

    def lower(self, b, value, args):
        present = tuple(r for r in ("x", "w", "r") if args[r] != NONE)
        inputs = [b.rows(b.operand(args[r])) if r in ("x", "r") else b.operand(args[r]) for r in present]
        out = b.rows(b.output(value))
        rows, splits = args["rows"], args["splits"]
        n_tiles = math.ceil(out.shape[1].value / rows)
        part = b.scratch(f"split_part{value}", (n_tiles * splits, WIDE_MROWS * rows), F32)
        arrive = b.accum(f"split_arrive{value}", (n_tiles,), I32)
        params = {"rows": rows, "splits": splits, "roles": present}
        b.emit("matvec_split", b.absorbed(value, {args[r] for r in present}), [*inputs, part, arrive], out, params)

"""matvec: ``out[M, N] = x[M, K] @ w[N, K]^T``; instance ``(i, j)`` computes rows
``[i*mrows, (i+1)*mrows)`` of x against ``rows`` rows ``[j*rows, ...)`` of ``w``.
``mrows`` is M itself when M is a constant (decode: M = 1). A runtime M (a batch, a prompt)
is tiled by ``mrows`` rows (``runtime_mrows``: 64 on tensor cores for bf16 / f16, a tile of at most 16
valid rows taking the staged body and more the wide one, matvec_wide.cuh; else as many as 32 KB of x
allows, up to 8; the last tile is ragged, masked) with the weight tiles outermost (``m_last``: grid
``(N tiles, M tiles)``), so that the instances reading one weight tile run back to back and it streams
from HBM about once.

Fusion options (operand roles in ``params["roles"]``): ``g`` an RMSNorm prologue on
``x`` (weight ``g[K]``, ``eps``); ``w2`` a gated pair, ``out = silu(x w^T) * (x w2^T)``;
``r`` a residual epilogue, ``out = r + x w^T``; ``xa`` / ``ra`` an f32 sum (a ``glu_down``
accumulator) added to x / r as they are read, ``x <- T(x + T(xa))``: the reader does
``acc_residual``'s work, so that op and its hand-off go (docs/perf-notes.md #34). Rounding
follows the unfused ops: each fused stage rounds to the storage dtype, as the reference
executor does.
"""

from __future__ import annotations

import math

import torch

from ..dims import ceildiv
from .base import NONE, BlockKind, CudaOperand, Partition, Term, c_call, f32, fields, no_view, register, rms_normed, term
from ..ir.footprint import Full, Tile


def roles(op) -> dict[str, int]:
    return {r: k for k, r in enumerate(op.params["roles"])}


def products(op, ins, x_rows: slice, w_rows: slice, dt: torch.dtype, weight: str = "w") -> torch.Tensor:
    """``x[x_rows] @ weight[w_rows]^T`` as stored (rounded to ``dt``), after the optional RMSNorm
    prologue, rounded at the same points as the unfused ops; returned as f32."""
    k = roles(op)
    x = with_sum(op, ins, "x", (x_rows,), dt)
    if "g" in k:
        x = rms_normed(x, ins[k["g"]], op.params["eps"], dt)
    return (x @ f32(ins[k[weight]][w_rows]).T).to(dt).float()


def with_sum(op, ins, role: str, index: tuple, dt: torch.dtype) -> torch.Tensor:
    """Operand ``role`` at ``index`` as f32, plus its f32 sum operand (``role + "a"``) when
    fused, rounded as ``acc_residual`` rounds: ``T(v + T(sum))``."""
    k = roles(op)
    v = f32(ins[k[role]][index])
    if role + "a" in k:
        v = (v + ins[k[role + "a"]][index].to(dt).float()).to(dt).float()
    return v


def gated(op, ins, x_rows: slice, w_rows: slice, dt: torch.dtype) -> torch.Tensor:
    """``silu(x w^T) * (x w2^T)`` over those rows, rounded as the unfused ops; returned as f32."""
    y = products(op, ins, x_rows, w_rows, dt)
    up = products(op, ins, x_rows, w_rows, dt, weight="w2")
    return (torch.nn.functional.silu(y).to(dt).float() * up).to(dt).float()


def write_tile(op, ins, out, x_rows: slice, w_rows: slice) -> None:
    """``out[x_rows, w_rows]``: the tile's products (gated with ``w2``) plus the residual ``r`` when
    given, rounded as the unfused ops (the matvec's and the gemm tile's cpu())."""
    k, dt = roles(op), out.dtype
    y = (gated if "w2" in k else products)(op, ins, x_rows, w_rows, dt).to(dt)
    if "r" in k:
        y = (with_sum(op, ins, "r", (x_rows, w_rows), dt) + y.float()).to(dt)
    out[x_rows, w_rows] = y


@register
class MatVec(BlockKind):
    name = "matvec"
    cuda_file = "matvec.cuh"
    waits_in_body = True  # the first weight loads are in flight while it waits (matvec.cuh)

    def build(self, inputs, output, params) -> Partition:
        rows, mrows = params["rows"], params["mrows"]
        ma, na = grid_axes(params)
        tile_mn = (Tile(ma, mrows), Tile(na, rows))
        reads = []
        for role, o in zip(params["roles"], inputs):
            if role in ("w", "w2"):
                reads.append((Tile(na, rows), Full()))
            elif role in ("r", "ra"):
                reads.append(tile_mn)
            elif role in ("x", "xa"):
                reads.append((Tile(ma, mrows), Full()))
            else:  # g
                reads.append((Full(),))
        grid = [ceildiv(output.shape[0], mrows), ceildiv(inputs[1].shape[0], rows)]
        return Partition(grid=(grid[ma], grid[na]), reads=tuple(reads), writes=tile_mn)

    def cpu(self, op, env, ins, out):
        k = roles(op)
        rows, mrows = op.params["rows"], op.params["mrows"]
        ma, na = grid_axes(op.params)
        m0, r0 = env[f"_i{ma}"] * mrows, env[f"_i{na}"] * rows
        write_tile(op, ins, out, slice(m0, m0 + mrows), slice(r0, min(r0 + rows, ins[k["w"]].shape[0])))

    def cuda_call(self, op, ins, out: CudaOperand) -> str:
        k = roles(op)
        p = op.params
        mrows = p["mrows"]

        cm, cn = (f"c{a}" for a in grid_axes(p))

        def rows_of(o: CudaOperand) -> str:  # the operand advanced to this instance's first x row
            return f"({o.ptr} + {cm} * {mrows} * {o.strides[0]})"

        def operand(role: str) -> tuple[str, str]:  # absent: the empty view
            ctype = "float" if role in ("xa", "ra") else ins[k["x"]].ctype
            if role not in k:
                return role, no_view(1 if role == "g" else 2, ctype)
            o = ins[k[role]]
            return role, o.view(ptr=rows_of(o) if role in ("x", "r", "xa", "ra") else None)

        kdim = op.inputs[k["w"]].shape[1].value
        n = op.inputs[k["w"]].shape[0].value
        flags = ["true" if role in k else "false" for role in ("g", "w2", "r")]
        # SUMS: whether xa / ra may be given (a runtime choice in the body). Always for one x row,
        # so the layers with and without them share one instantiation (matvec.cuh)
        flags.append("true" if mrows == 1 or "xa" in k or "ra" in k else "false")
        args = [("smem", "smem"), operand("x"), operand("g"), ("eps", f"{float(p.get('eps', 0.0))!r}f"), operand("w"),
                operand("w2"), operand("r"), operand("xa"), operand("ra"), ("out", out.view(ptr=rows_of(out), const=False)),
                ("N", f"{n}LL"), ("n_tile", cn), ("mvalid", f"min_i64({mrows}LL, ({out.shape[0]}) - {cm} * {mrows})"),
                ("wl", "wl")]
        return c_call("matvec", [ins[k["x"]].ctype, mrows, kdim, p["rows"], *flags], args)

    def bytes_moved(self, op, env):
        k = roles(op)
        ma, na = grid_axes(op.params)
        m_tiles, n_tiles = op.grid[ma].eval(env), op.grid[na].eval(env)
        k_dim = op.inputs[k["w"]].shape[1].value
        n, m = op.output.shape[1].eval(env), op.output.shape[0].eval(env)
        item = op.output.dtype.itemsize
        w_bytes = (2 if "w2" in k else 1) * n * k_dim * item * m_tiles  # each row tile re-reads the weights
        x_bytes = m * k_dim * item * n_tiles  # every instance reads its x rows
        sums = 4 * (m * k_dim * n_tiles * ("xa" in k) + m * n * ("ra" in k))
        return w_bytes + x_bytes + m * n * item * (2 if "r" in k else 1) + sums

    def flops(self, op, env):
        """A runtime M's tensor-core products (x rows in tiles of 8), priced at twice their count: mma.sync
        runs at about half the rate of the gemm tiles' wgmma that the cost model's ``tensor_flops`` is."""
        p = op.params
        if not p.get("m_last") or p["mrows"] not in (MMA_MROWS, WIDE_MROWS) or op.output.dtype.name not in ("bf16", "f16"):
            return 0.0
        k = roles(op)
        k_dim = op.inputs[k["w"]].shape[1].value
        m, n = op.output.shape[0].eval(env), op.output.shape[1].eval(env)
        return MMA_SYNC_COST * 2.0 * (-(-m // 8) * 8) * n * k_dim * (2 if "w2" in k else 1)


MAX_MATVEC_M = 16  # a constant M up to this is one instance's x rows (decode: 1); past it, tiled as a runtime M
RUNTIME_M_BYTES = 32 * 1024  # x staged per instance, at most, when M is a runtime dim


def grid_axes(params) -> tuple[int, int]:
    """(M axis, N axis) of a matvec's grid: ``m_last`` puts the weight tiles outermost."""
    return (1, 0) if params.get("m_last") else (0, 1)


RUNTIME_MROWS = 8  # (16: the gated body spills 4 KB a thread and NVRTC takes minutes)
# The top of shared memory that the fused kinds (matvec_heads, matvec_argmax) compute their rows into
# (matvec.cuh: MEGA_SMEM_RESERVED; matvec_tile.cuh: matvec_to_tile)
EPILOGUE_TILE_BYTES = 4096


def fits_epilogue_tile(graph, args) -> bool:
    """Whether a fused kind's ``rows`` rows of ``w``'s dtype fit EPILOGUE_TILE_BYTES."""
    return args["rows"] * graph.nodes[args["w"]].dtype.itemsize <= EPILOGUE_TILE_BYTES


MMA_MROWS = 16  # x rows per instance on tensor cores (matvec.cuh: run_mma, bf16 and f16)
MMA_STAGE_BYTES = 80 * 1024  # x staged (RMSNorm prologue) for run_mma, at most
WIDE_MROWS = 64  # x rows of a wide tile (matvec_wide.cuh: both operands through a cp.async ring)
MMA_SYNC_COST = 2.0  # a tensor-core matvec's FLOPs priced as this many of the gemm tile's (MatVec.flops)


def wide_fits(k_dim: int, dtype, rows: int, *, gated: bool) -> bool:
    """Whether a runtime M's tile can be wide (matvec_wide.cuh: wide_fits): tensor cores, K in stages of
    64, and a warp's accumulators (one fragment per 16 weight rows, twice when gated) within 64 floats."""
    return dtype.name in ("bf16", "f16") and k_dim % 64 == 0 and -(-rows // 16) * (2 if gated else 1) <= 16


def staged_rows(k_dim: int, dtype, *, norm: bool) -> int:
    """x rows the staged tensor-core body takes (matvec_wide.cuh: staged_rows): 16, or 8 when 16
    normalised rows do not fit MMA_STAGE_BYTES; 0 when neither does."""
    for m in (MMA_MROWS, 8):
        if not norm or m * (k_dim + 8) * dtype.itemsize <= MMA_STAGE_BYTES:
            return m
    return 0


def runtime_mrows(k_dim: int, dtype, *, norm: bool, rows: int | None = None, gated: bool = False,
                  sums: bool = False) -> int:
    """x rows per instance for a runtime M: a wide tile of 64 where one fits a tile of ``rows`` weight rows
    (None: no wide tile; its body hands 16 valid rows or fewer to the staged one, matvec.cuh: matvec);
    else 16 on tensor cores (bf16 / f16, K a multiple of 32, a normalised x staged within
    MMA_STAGE_BYTES); else a power of two up to RUNTIME_MROWS within RUNTIME_M_BYTES (CUDA cores), as
    always with f32 sums read with x or r (``sums``: no tensor-core body reads them, matvec.cuh: use_mma)."""
    if rows is not None and not sums and wide_fits(k_dim, dtype, rows, gated=gated):
        return WIDE_MROWS
    item = dtype.itemsize
    if not sums and dtype.name in ("bf16", "f16") and k_dim % 32 == 0 and staged_rows(k_dim, dtype, norm=norm):
        return staged_rows(k_dim, dtype, norm=norm)
    m = RUNTIME_MROWS
    while m > 1 and m * k_dim * item > RUNTIME_M_BYTES:
        m //= 2
    return m


@term
class MatVecTerm(Term):
    """``x @ w^T`` [* silu gate ``w2``] [after an RMSNorm(``g``) prologue] [+ ``r``], ``rows`` weight
    rows per instance; ``xa`` / ``ra``: f32 sums added to x / r as they are read."""

    name = "matvec"
    fields = fields("x:ref w:ref w2:ref g:ref eps:float r:ref xa:sum ra:sum rows:int")
    tile = "rows"

    def siblings(self, args):
        return ("matvec", args["x"], args["g"], args["eps"], args["xa"])

    def fits(self, graph, args) -> bool:
        """No RMSNorm prologue on a wide tile (a runtime M, or a constant one past MAX_MATVEC_M) where
        its staged body takes fewer than 16 normalised rows (K > 2552 in bf16): 9-16 rows would run on
        the wide tile, slower there than 16 staged rows after an rms_norm op (qwen3-8b batch 16: 7.89
        against 7.24 ms, docs/perf-notes.md #79); nor in f16, where the wide tile's unnormalised x * g
        could overflow (matvec_wide.cuh)."""
        if args["g"] == NONE:
            return True
        x = graph.nodes[args["x"]]
        lead, k = x.shape[:-1], x.shape[-1]
        if not k.is_const or (all(d.is_const for d in lead) and math.prod(d.value for d in lead) <= MAX_MATVEC_M):
            return True
        if not wide_fits(k.value, x.dtype, args["rows"], gated=args["w2"] != NONE):
            return True
        return x.dtype.name == "bf16" and staged_rows(k.value, x.dtype, norm=True) == MMA_MROWS

    def lower(self, b, value, args):
        lower_matvec(b, value, {r: args[r] for r in ("x", "w", "w2", "g", "r")}, args, transpose_w=False)


@term
class MatMulTerm(Term):
    """``a @ B`` (``B [K, N]``, read as ``w [N, K]`` through a transposing view) as a matvec."""

    name = "matmul_rows"
    fields = fields("node:node rows:int")

    def lower(self, b, value, args):
        a, w = b.graph.nodes[value].inputs
        lower_matvec(b, value, {"x": a, "w": w}, {"eps": 0.0, "xa": NONE, "ra": NONE, "rows": args["rows"]},
                     transpose_w=True)


def lower_matvec(b, value: int, operands: dict, args, *, transpose_w: bool) -> None:
    """One matvec op: ``operands`` role -> node id (NONE if absent); a sum read with x (``xa``) or
    r (``ra``) comes after the other operands."""
    present = tuple(k for k, v in operands.items() if v != NONE)
    inputs = [b.rows(b.operand(operands[k])) if k in ("x", "r") else b.operand(operands[k]) for k in present]
    sums = tuple(k for k in ("xa", "ra") if args[k] != NONE)
    inputs += [b.sum(args[k]) for k in sums]
    if transpose_w:  # out = a @ B: B [K, N] read as w [N, K]
        inputs[1] = b.view(inputs[1], "permute", (1, 0))
    out = b.rows(b.output(value))
    m = out.shape[0]
    params = {"rows": args["rows"], "roles": present + sums, "eps": args["eps"]}
    if m.is_const and m.value <= MAX_MATVEC_M:
        params["mrows"] = m.value
    else:  # a batch or a prompt: tiles of x rows, the weight tiles outermost
        x = inputs[present.index("x")]
        mrows = runtime_mrows(x.shape[1].value, x.dtype, norm="g" in present, rows=args["rows"], gated="w2" in present,
                              sums=bool(sums))
        if transpose_w:  # a transposed w has no 16-byte rows for the tensor-core bodies: the generic body's
            mrows = min(mrows, 4)  # tiles (matvec.cuh takes tensor cores for x rows in tiles of 8)
        params.update(mrows=mrows, m_last=True)
    reads = {v for v in operands.values() if v != NONE} | {args[k] for k in sums}
    b.emit("matvec", b.absorbed(value, reads), inputs, out, params)

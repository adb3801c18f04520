"""Render the megakernel's CUDA source from a WorkQueue and the block-op registry.

The template ``cuda/megakernel.cu`` holds the interpreter loop; this module fills
its slots: runtime dims, the launch-count prefix, and one ``case`` per queue entry
(grid coordinates, weight L2 prefetches, barrier waits (or their list, for a body that
waits itself), the kind's body call, barrier signals).
"""

from __future__ import annotations

from ..blockops import REGISTRY, CudaOperand
from ..blockops.base import dimc
from ..blockops.footprint import Full, Tile
from ..dims import Dim
from ..lowering.queue import QueueEntry, WorkQueue
from ..rewrite.program import Operand
from .nvrtc import CUDA_DIR

THREADS = 256
SMEM_BYTES = 120 * 1024  # dynamic smem per block: >113 KB keeps one block per SM; more starves L1 (measured)
DEFINES = {"MEGA_THREADS": THREADS, "MEGA_SMEM": SMEM_BYTES}


def defines() -> dict[str, int]:
    """Compile-time constants; MEGAEGG_DEFINES="NAME=VALUE,..." overrides them (for experiments)."""
    import os

    extra = dict(kv.split("=") for kv in os.environ.get("MEGAEGG_DEFINES", "").split(",") if kv)
    return {**DEFINES, **{k: int(v) for k, v in extra.items()}}


def c_expr(d: Dim) -> str:
    return d.to_c(dimc)


def operand_c(q: WorkQueue, o: Operand) -> CudaOperand:
    layout = q.layout(o)
    ctype = o.dtype.c_type
    mem = q.memory
    if o.buffer in mem.arena_offset:
        base = f"(({ctype}*)(args.arena + {mem.arena_offset[o.buffer]}))"
    elif o.buffer in mem.accum_word:  # in this launch's counter bank
        base = f"(({ctype}*)(ctr + {mem.accum_word[o.buffer]}))"
    else:
        base = f"(({ctype}*)args.ptr[{mem.pointer_slot[o.buffer]}])"
    ptr = base if layout.offset.is_const and layout.offset.value == 0 else f"({base} + {c_expr(layout.offset)})"
    return CudaOperand(ptr, tuple(c_expr(s) for s in layout.stride), tuple(c_expr(s) for s in layout.shape), ctype)


def weight_prefetches(q: WorkQueue, op) -> list[str]:
    """L2 prefetches of the weight rows this instance reads first, when they are one contiguous range."""
    out = []
    for o, fp in zip(op.inputs, op.reads):
        buf = q.program.buffers[o.buffer]
        if buf.kind != "weight" or buf.transposed or len(o.shape) != 2 or o.views:  # (transposed: read last)
            continue
        rows, cols = (d.value for d in o.shape)
        row_bytes = cols * o.dtype.itemsize
        first, second = fp
        if not isinstance(second, Full) or row_bytes % 16:
            continue
        base = f"(const char*)args.ptr[{q.memory.pointer_slot[o.buffer]}]"
        if isinstance(first, Tile):  # (a Full read, e.g. an embedding table, is too big to prefetch)
            c, t = f"c{first.axis}", first.size
            out.append(f"mega_prefetch_l2({base} + {c} * {t * row_bytes}LL, "
                       f"(min_i64({rows}LL - {c} * {t}, {t}LL)) * {row_bytes}LL);")
    return out


def render_case(q: WorkQueue, k: int, e: QueueEntry) -> str:
    op = e.op
    kind = REGISTRY[op.kind]
    lines = [f"      case {k}: {{  // op{op.id} {op.kind} sources {list(op.sources)}"]
    # grid coordinates, row-major from the local instance index
    lines.append("        long long rem = local;")
    for axis in range(len(op.grid) - 1, 0, -1):
        lines.append(f"        const long long c{axis} = rem % ({c_expr(op.grid[axis])}); rem /= ({c_expr(op.grid[axis])});")
    lines.append("        const long long c0 = rem;")
    lines.append("        " + " ".join(f"const long long D__i{a} = c{a}; (void)D__i{a};" for a in range(max(1, len(op.grid)))))
    ins = [operand_c(q, o) for o in op.inputs]
    out = operand_c(q, op.output)
    prefetch = weight_prefetches(q, op)
    if prefetch:
        lines.append("        if (threadIdx.x == 0) {")
        lines += [f"          {p}" for p in prefetch]
        lines.append("        }")
    waits = [f"&ctr[{q.memory.counter_base[w.barrier_set]} + ({c_expr(w.index)})]" for w in e.waits]
    expected = [f"(unsigned)({c_expr(w.expected)})" for w in e.waits]
    if waits or kind.waits_in_body:  # the wait list (runtime.cuh: mega_wait_all)
        lines.append(f"        MegaWaits wl; wl.n = {len(waits)};")
        lines += [f"        wl.ctr[{i}] = {c}; wl.expected[{i}] = {x};" for i, (c, x) in enumerate(zip(waits, expected))]
    call = f"        {kind.cuda_call(op, ins, out)};"
    traced = "        MEGA_TRACE_WAITS_PASSED();" if waits else "        MEGA_TRACE_WAITED();"
    if kind.waits_in_body:  # the body issues its input-independent loads, then waits
        lines += [call, "        if (mega_abort_block) break;", traced]
    else:
        if waits:
            lines.append("        if (!mega_wait_all(wl)) break;")
        lines += [traced, call]
    if e.signals:
        lines.append("        __syncthreads();")
        lines.append("        if (threadIdx.x == 0) {")
        lines.append("          __threadfence();")
        for s in e.signals:
            lines.append(f"          mega_red_release(&ctr[{q.memory.counter_base[s.id]} + ({c_expr(s.signal)})], 1u);")
        lines.append("        }")
    lines.append("      } break;")
    return "\n".join(lines)


def render(q: WorkQueue) -> str:
    src = (CUDA_DIR / "megakernel.cu").read_text()
    kinds = sorted({REGISTRY[e.op.kind].cuda_file for e in q.entries if REGISTRY[e.op.kind].cuda_file})
    symbols = q.program.symbols
    slots = {
        "INCLUDES": "\n".join(f'#include "{f}"' for f in kinds),
        "ENTRIES": str(len(q.entries)),
        "COUNTERS": str(max(1, q.memory.counters)),
        "NDIMS": str(max(1, len(symbols))),
        "NPTRS": str(max(1, len(q.memory.pointer_slot))),
        "MAXWAITS": str(max([1, *(len(e.waits) for e in q.entries)])),
        "DIMS": " ".join(f"const long long {dimc(s)} = args.dims[{k}];" for k, s in enumerate(symbols)),
        "PREFIX": "\n    ".join(
            f"prefix[{k + 1}] = prefix[{k}] + max_i64(0LL, {c_expr(e.launch)});" for k, e in enumerate(q.entries)
        ),
        "CASES": "\n".join(render_case(q, k, e) for k, e in enumerate(q.entries)),
    }
    for name, text in slots.items():
        src = src.replace(f"/*@{name}@*/", text)
    return src

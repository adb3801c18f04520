"""Render the megakernel's CUDA source from a WorkQueue and the block-op registry.

The template ``cuda/megakernel.cu`` holds the interpreter loop; this module fills
its slots: runtime dims, the launch-count prefix, and one ``case`` per queue entry
(grid coordinates, weight L2 prefetches, barrier waits (or their list, for a body that
waits itself), the kind's body call, barrier signals).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..blockops import REGISTRY, CudaOperand
from ..blockops.base import dimc
from ..ir.footprint import Full, Tile
from ..dims import Dim
from ..lowering.queue import QueueEntry, WorkQueue
from ..ir.program import Operand
from . import tensor_maps
from .kernel_args import c_declaration
from .nvrtc import CUDA_DIR

THREADS = 256
# Dynamic shared memory of a block (>113 KB keeps one block per SM; more starves L1, measured).
SMEM_BYTES = 120 * 1024
DEFINES = {"MEGA_THREADS": THREADS, "MEGA_SMEM": SMEM_BYTES}


def defines() -> dict[str, int]:
    """Compile-time constants; MEGAEGG_DEFINES="NAME=VALUE,..." overrides them (for experiments)."""
    return {**DEFINES, **env_defines()}


def env_defines() -> dict[str, int]:
    """The defines $MEGAEGG_DEFINES sets."""
    import os

    return {k: int(v) for k, v in (kv.split("=") for kv in os.environ.get("MEGAEGG_DEFINES", "").split(",") if kv)}


# A program with row regimes (ir/program.py: Regime) compiles into one kernel image per band of row counts
# from one source: each holds the cases of one band (MEGA_REGIME: its index), so none's register allocation
# pays for the others' bodies. An image with tensor-core tiles (gemm) gets the shared memory they pipeline
# through (4 stages of a 128 x 256 tile instead of 2); the others keep 120 KB, which the decode path wants (L1).
TILE_SMEM = 200 * 1024
# The most shared memory (static + dynamic) a block may opt in to on sm_90 (H100 / H200: 227 KB).
SMEM_OPTIN = 227 * 1024


def band_entries(q: WorkQueue, band: int | None) -> range:
    """The queue entries the image of ``band`` holds (None: every entry): a band's entries follow one another
    (regimes.py: merge), or, if they do not, every entry."""
    if band is None:
        return range(len(q.entries))
    mine = [i for i, e in enumerate(q.entries) if e.op.regime in (None, band)]
    if not mine or mine != list(range(mine[0], mine[-1] + 1)):
        return range(len(q.entries))
    return range(mine[0], mine[-1] + 1)


def static_smem(q: WorkQueue, band: int | None = None) -> int:
    """A bound on the kernel image's static shared memory: megakernel.cu's entry tables (16 bytes an entry of
    its band) and under 2 KB of the runtime's and the deferred jobs' variables (ptxas: ~1.2-1.4 KB)."""
    return 16 * (len(band_entries(q, band)) + 1) + 2048


def band_count(q: WorkQueue) -> int:
    """How many bands of row counts ``q``'s program has (1: no row regime)."""
    regime = q.program.regime
    return 1 if regime is None else regime.bands


def image_defines(q: WorkQueue, defs: dict[str, int]) -> list[dict[str, int]]:
    """The defines of each kernel image of ``q``: one, or one per band of its row regime, in band order,
    each with its band's entries only (their tables are static shared memory: what the image takes beyond
    its carve-out is L1 its bodies lose, perf-notes #88). Dynamic shared memory is capped where a long
    queue's entry tables leave less than it beside them (a traced 36-layer model's prompt step, ~2200
    entries: 35 KB of tables), so the bodies size their rings for what the block gets."""
    images = [None] if q.program.regime is None else range(band_count(q))
    out = []
    for r in images:
        d = dict(defs) if r is None else {**defs, "MEGA_REGIME": r}
        entries = band_entries(q, r)
        if len(entries) < len(q.entries):  # the band's entries only (megakernel.cu: MEGA_ENTRY0)
            d["MEGA_ENTRY0"], d["MEGA_IMAGE_ENTRIES"] = entries.start, len(entries)
        cap = (SMEM_OPTIN - static_smem(q, r)) // 1024 * 1024
        tiles = any(e.op.kind == "gemm" and (r is None or e.op.regime in (None, r)) for e in q.entries)
        if "MEGA_SMEM" not in env_defines():
            d["MEGA_SMEM"] = min(TILE_SMEM if tiles else d["MEGA_SMEM"], cap)
        out.append(d)
    return out


def regime_guard(regimes: set, bands: int) -> tuple[str, str]:
    """``#if`` / ``#endif`` lines around code that only entries of the bands ``regimes`` run (None: every
    band), of a program of ``bands`` bands. An image compiled without MEGA_REGIME (-1) holds every band."""
    if None in regimes or not regimes or set(regimes) >= set(range(bands)):
        return "", ""
    return " || ".join(["#if MEGA_REGIME < 0", *(f"MEGA_REGIME == {r}" for r in sorted(regimes))]), "#endif"


def launch_shape(defs: dict[str, int]) -> tuple[int, int]:
    """(threads, dynamic shared memory bytes) of a block of the kernel compiled with ``defs``."""
    return defs["MEGA_THREADS"], defs["MEGA_SMEM"]


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
    elif mem.peer is not None and o.buffer in mem.peer.offset:  # this rank's copy, this launch's half
        base = f"(({ctype}*)(peer_half + {mem.peer.offset[o.buffer]}))"
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


def grid_coordinates(op) -> list[str]:
    """c0, c1, ...: the instance's grid coordinates, row-major from its local index (from the last
    instance back where the kind's later instances run longest: ``BlockKind.longest_last``)."""
    # 32-bit division: an entry's instance count is far below 2^32, and a 64-bit one is a call (~4 KB of SASS)
    if REGISTRY[op.kind].longest_last and op.grid:
        count = " * ".join(f"(unsigned)({c_expr(g)})" for g in op.grid)
        lines = [f"        unsigned rem = {count} - 1u - (unsigned)local;"]
    else:
        lines = ["        unsigned rem = (unsigned)local;"]
    for axis in range(len(op.grid) - 1, 0, -1):
        ext = f"(unsigned)({c_expr(op.grid[axis])})"
        lines.append(f"        const long long c{axis} = rem % {ext}; rem /= {ext};")
    lines.append("        const long long c0 = rem;")
    lines.append("        " + " ".join(f"const long long D__i{a} = c{a}; (void)D__i{a};" for a in range(max(1, len(op.grid)))))
    return lines


def case_body(q: WorkQueue, e: QueueEntry, tmaps: dict[tuple[int, int], int] | None = None) -> list[str]:
    """The C++ of one queue entry's instance: grid coordinates, prefetches, waits, the body, signals.
    ``tmaps``: the tensor maps' indices by (op id, input) (``tensor_maps.plan``)."""
    op = e.op
    kind = REGISTRY[op.kind]
    lines = grid_coordinates(op)
    # operand pointers first, before any wait: where they come from the entry table, their loads
    # then overlap the wait instead of following it on the dependent chain
    ins, out = [operand_c(q, o) for o in op.inputs], operand_c(q, op.output)
    names = [f"in{k}" for k in range(len(ins))] + ["out"]
    for name, o in zip(names, [*ins, out]):
        lines.append(f"        {o.ctype}* const {name} = {o.ptr};")
    ins = [dataclasses.replace(o, ptr=name) for o, name in zip(ins, names)]
    for k in kind.tma_inputs(op):
        if tmaps is None:
            tmaps = tensor_maps.plan(q)[1]
        ins[k] = dataclasses.replace(ins[k], tmap=tensor_maps.c_ref(tmaps[(op.id, k)]))
    out = dataclasses.replace(out, ptr="out")
    prefetch = weight_prefetches(q, op)
    if prefetch:
        lines.append("        if (threadIdx.x == 0) {")
        lines += [f"          {p}" for p in prefetch]
        lines.append("        }")
    waits, expected, sys = wait_list(q, e)
    if kind.deferred:  # thread 0 fills the job (shared memory); it runs after the switch (render.py: deferred_slots)
        if any(s.peer for s in e.signals):
            raise ValueError(f"{op.label}: a deferred body cannot signal peer counters")
        job = kind.deferred.var
        lines += [f"        {job}_pending = true;", "        if (threadIdx.x == 0) {",
                  f"          MegaWaits& wl = {job}.wl; wl.n = {len(waits)};" + (f" wl.sys = {sys}u;" if q.memory.peer else "")]
        lines += [f"          wl.ctr[{i}] = {c}; wl.expected[{i}] = {x};" for i, (c, x) in enumerate(zip(waits, expected))]
        lines += [f"          {kind.cuda_call(op, ins, out)};", f"          {job}.nsig = {len(e.signals)};"]
        lines += [f"          {job}.sig[{i}] = &ctr[{q.memory.counter_base[s.id]} + ({c_expr(s.signal)})];"
                  for i, s in enumerate(e.signals)]
        return lines + ["        }"]
    if waits or kind.waits_in_body:  # the wait list (runtime.cuh: mega_wait_all)
        lines.append("        MegaWaits wl; wl.n = " + f"{len(waits)};" + (f" wl.sys = {sys}u;" if q.memory.peer else ""))
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
        peer = q.memory.peer
        lines.append("        mega_sync();")
        lines.append("        if (threadIdx.x == 0) {")
        lines.append("          MEGA_TRACE_SIGNAL();")
        # (system scope when other GPUs read what this instance wrote: its stores went over NVLink)
        # (no fence before the red.release: it orders the block's stores through the barrier, perf-notes #60)
        if any(s.peer for s in e.signals):  # (MEGA_PEER_FENCE=0: the red.release.sys alone orders the stores)
            lines += ["#if MEGA_PEER_FENCE", "          __threadfence_system();", "#endif"]
        for s in e.signals:
            if s.peer:  # this rank's counter on every rank
                at = peer_word(peer, s.id, s.signal, "D_rank")
                lines.append(f"          for (int r = 0; r < {peer.ranks}; ++r) mega_red_release_sys((unsigned*)args.peers[r] + {at}, 1u);")
            else:
                lines.append(f"          mega_red_release(&ctr[{q.memory.counter_base[s.id]} + ({c_expr(s.signal)})], 1u);")
        lines.append("        }")
    return lines


def peer_word(peer, set_id: int, index: Dim, source) -> str:
    """C: the peer-region word of counter ``index`` of peer set ``set_id`` counting rank ``source``
    (``PeerPlan.word``)."""
    return f"({peer.counter_base[set_id]} + ({c_expr(index)})) * {peer.ranks} + {source}"


def wait_list(q: WorkQueue, e: QueueEntry) -> tuple[list[str], list[str], int]:
    """The counters an instance of ``e`` spins on (``WorkQueue.spins``), the counts
    it waits for, and the mask of those to read at system scope: a source rank's counter of a peer
    family, which counts across launches, is waited for to ``seq`` (this launch's number, from 1)
    times the count."""
    counters, expected, sys = [], [], 0
    for w, rank in q.spins(e):
        if rank is not None:
            peer = q.memory.peer
            sys |= 1 << len(counters)
            counters.append(f"&pctr[{peer_word(peer, w.barrier_set, w.index, rank)}]")
            expected.append(f"seq * (unsigned)({c_expr(w.expected)})")
        else:
            counters.append(f"&ctr[{q.memory.counter_base[w.barrier_set]} + ({c_expr(w.index)})]")
            expected.append(f"(unsigned)({c_expr(w.expected)})")
    return counters, expected, sys


# Integer literals a case may take from the entry table: not inside a template argument list
# (those must stay compile-time constants), not part of a name or a float literal.
_TEMPLATE_ARGS = re.compile(r"\b\w+<[^<>;()]*>(?=\()")
_INT = re.compile(r"(?<![\w.])\d+(?:LL)?(?![\w.])")


def _holes(text: str) -> tuple[str, list[str]]:
    """``text`` with its table-able integer literals replaced by a hole mark, and those literals."""
    out, literals, pos = [], [], 0
    for m in [*_TEMPLATE_ARGS.finditer(text), None]:
        end = m.start() if m else len(text)
        out.append(_INT.sub(lambda lit: literals.append(lit.group()) or "\x01", text[pos:end]))
        if m:
            out.append(m.group())
            pos = m.end()
    return "".join(out), literals


PREFETCH_PAD = 16  # megakernel.cu: the prefetch of the next entry's constants reads `next` and `next + 15`


@dataclass(frozen=True)
class EntryTable:
    """Per queue entry: which shared case runs it (``variant``), where its own constants start in
    ``consts`` (``offset``: the arena offsets, pointer slots and counter bases that differ between
    entries whose code is otherwise the same, the layers of a model).

    ``prefix``: the first instance of every entry (and the total, last) as ``base + sum_j count[j] *
    launch_j``, ``launch_j`` the j-th distinct runtime launch count (LaunchPrefix), so every block
    computes it in parallel from data instead of running code that grows with the entries."""

    variant: tuple[int, ...]
    offset: tuple[int, ...]
    prefix: "LaunchPrefix"
    consts: tuple[int, ...]

    @property
    def consts_at(self) -> int:
        """Where the constants start in :meth:`words` (megakernel.cu: MEGA_CONSTS_AT)."""
        entries = len(self.variant)
        return 2 * entries + (1 + self.prefix.rows) * (entries + 1)

    def words(self) -> list[int]:
        """The table as the kernel reads it (int64): variants, offsets, the prefix base
        then its counts (ENTRIES + 1 words each), then the constants, then PREFETCH_PAD zeros: the
        kernel prefetches words [0, 16) of the next entry's constants into L1, which for the last
        entries (few or no constants of their own) lie past the constants."""
        counts = [c for row in self.prefix.counts for c in row]
        counts += [0] * (len(self.prefix.base) * (self.prefix.rows - len(self.prefix.counts)))  # (no runtime launch count: one zero row)
        pad = [0] * PREFETCH_PAD
        return [*self.variant, *self.offset, *self.prefix.base, *counts, *self.consts, *pad]


@dataclass(frozen=True)
class LaunchPrefix:
    """prefix[e] = base[e] + sum_j counts[j][e] * max(0, launches[j]) (``launches``: the distinct
    launch counts that are not constants, as C expressions of the runtime dims)."""

    launches: tuple[str, ...]
    base: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> int:
        """Count rows the kernel reads (MEGA_LAUNCHES): at least one, a zero row when every launch
        count is a constant (the kernel's arrays cannot be empty)."""
        return max(1, len(self.launches))

    @staticmethod
    def of(q: WorkQueue) -> "LaunchPrefix":
        exprs = [None if e.launch.is_const else c_expr(e.launch) for e in q.entries]
        launches = list(dict.fromkeys(x for x in exprs if x is not None))
        base, counts = [0], [[0] for _ in launches]
        for e, x in zip(q.entries, exprs):
            base.append(base[-1] + (max(0, e.launch.value) if x is None else 0))
            for j, launch in enumerate(launches):
                counts[j].append(counts[j][-1] + (x == launch))
        return LaunchPrefix(tuple(launches), tuple(base), tuple(tuple(r) for r in counts))


@dataclass(frozen=True)
class Rendered:
    source: str
    table: EntryTable


def shared_cases(q: WorkQueue) -> tuple[list[str], EntryTable]:
    """One ``case`` per distinct entry code of a band, literals that differ between its entries read from the
    table. Bands do not share cases: each image compiles its own band's only, and a case shared with another
    band holds as table loads what differs between them (with four bands, the decode image's kernel function
    spilled 3x as much, perf-notes #88)."""
    groups: dict[tuple, list[int]] = {}
    holes: list[list[str]] = []
    tmaps = tensor_maps.plan(q)[1]
    regime_dims = regime_dim_refs(q)
    for k, e in enumerate(q.entries):
        text = "\n".join(case_body(q, e, tmaps))
        for name, ref in regime_dims.items():
            text = re.sub(rf"\b{dimc(name)}\b", ref, text)
        skeleton, literals = _holes(text)
        groups.setdefault((e.op.regime, skeleton), []).append(k)
        holes.append(literals)
    cases, variant, offset, consts = [], [0] * len(q.entries), [0] * len(q.entries), []
    for g, ((_, skeleton), members) in enumerate(groups.items()):
        columns = list(zip(*(holes[k] for k in members)))
        varying = [j for j, col in enumerate(columns) if len(set(col)) > 1]
        fill = iter([col[0] if j not in varying else f"e{varying.index(j)}" for j, col in enumerate(columns)])
        body = re.sub("\x01", lambda _: next(fill), skeleton)
        if varying:  # all loaded at once, first: one table round trip per instance
            body = "        const long long " + ", ".join(f"e{i} = __ldg(E + {i})" for i in range(len(varying))) + ";\n" + body
        for k in members:
            variant[k], offset[k] = g, len(consts)
            consts += [int(holes[k][j].removesuffix("LL")) for j in varying]
        ops = ", ".join(f"op{q.entries[k].op.id}" for k in members[:6]) + (" ..." if len(members) > 6 else "")
        head = f"      case {g}: {{  // {q.entries[members[0]].op.kind}: {ops} ({len(members)} entries)\n"
        open_, close = regime_guard({q.entries[k].op.regime for k in members}, band_count(q))
        cases.append((open_ + "\n" if open_ else "") + head + body + "\n      } break;" + ("\n" + close if close else ""))
    return cases, EntryTable(tuple(variant), tuple(offset), LaunchPrefix.of(q), tuple(consts))


def regime_dim_refs(q: WorkQueue) -> dict[str, str]:
    """A row regime's derived dims as ``args.dims[k]`` in the cases: the index is a literal, so the
    bands' copies of an op (the same code over another dim) share one case, their indices in the table
    (ir/program.py: Regime)."""
    p = q.program
    if p.regime is None:
        return {}
    return {name: f"args.dims[{p.symbols.index(name)}]" for name in p.regime.derived}


def peer_prologue(q: WorkQueue) -> str:
    """A tensor-parallel kernel's view of its peer region: its counters, this launch's half of the buffers."""
    peer = q.memory.peer
    if peer is None:
        return ""
    return ("unsigned* const pctr = (unsigned*)args.peers[args.rank];  (void)pctr;\n"
            f"  char* const peer_half = args.peers[args.rank] + {peer.data_at}LL + (args.seq & 1) * {peer.half_bytes}LL;  (void)peer_half;\n"
            "  const unsigned seq = (unsigned)args.seq;  (void)seq;")


def deferred_slots(q: WorkQueue) -> dict[str, str]:
    """The jobs of the deferred kinds present (BlockKind.deferred): in shared memory, filled by thread 0
    of the case that ran (which also sets the ``_pending`` flag in every thread), run after the switch."""
    kinds = sorted({e.op.kind for e in q.entries if REGISTRY[e.op.kind].deferred}, key=str)
    jobs = [REGISTRY[k].deferred for k in kinds]
    slots = {"DEFERRED_SHARED": [], "DEFERRED_DECL": [], "DEFERRED_RUN": []}
    for k, j in zip(kinds, jobs):
        open_, close = regime_guard({e.op.regime for e in q.entries if e.op.kind == k}, band_count(q))
        code = {"DEFERRED_SHARED": f"__shared__ {j.struct} {j.var};",
                "DEFERRED_DECL": f"bool {j.var}_pending = false;",
                # (the barrier: thread 0 filled the job)
                "DEFERRED_RUN": deferred_run(q, k)}
        for name, text in code.items():
            slots[name].append(f"\n{open_}\n    {text}\n{close}\n" if open_ else text)
    return {name: " ".join(texts) for name, texts in slots.items()}


def deferred_run(q: WorkQueue, kind: str) -> str:
    """The run call of deferred kind ``kind``, with its template arguments for the ops that each image runs
    (``BlockKind.deferred_template``: a tile shape only the large rows' image uses is not compiled into the
    batch rows' one)."""
    j = REGISTRY[kind].deferred
    call = lambda ops: f"if ({j.var}_pending) {{ mega_sync(); {j.run}{REGISTRY[kind].deferred_template(ops)}({j.var}, smem); }}"
    ops = [e.op for e in q.entries if e.op.kind == kind]
    per_band = {r: call([op for op in ops if op.regime in (None, r)]) for r in range(band_count(q))
                if any(op.regime in (None, r) for op in ops)}
    if q.program.regime is None or len(set(per_band.values())) == 1:
        return call(ops)
    chain = [f"#{'if' if i == 0 else 'elif'} MEGA_REGIME == {r}\n    {text}" for i, (r, text) in enumerate(per_band.items())]
    return "\n" + "\n".join(chain) + f"\n#else\n    {call(ops)}\n#endif\n"


def render(q: WorkQueue) -> Rendered:
    """The kernel's source and entry table."""
    src = (CUDA_DIR / "megakernel.cu").read_text()
    cases, table = shared_cases(q)
    kinds = []  # the bodies' files, each guarded by the bands whose entries call it
    for f in sorted({REGISTRY[e.op.kind].cuda_file for e in q.entries if REGISTRY[e.op.kind].cuda_file}):
        open_, close = regime_guard({e.op.regime for e in q.entries if REGISTRY[e.op.kind].cuda_file == f}, band_count(q))
        kinds.append(f'{open_}\n#include "{f}"\n{close}' if open_ else f'#include "{f}"')
    symbols = q.program.symbols
    slots = {
        "INCLUDES": "\n".join(kinds),
        "ENTRIES": str(len(q.entries)),
        "COUNTERS": str(max(1, q.memory.counters)),
        "ARGS": c_declaration(len(symbols), len(q.memory.pointer_slot)),
        "MAXWAITS": str(max([1, *(len(q.spins(e)) for e in q.entries)])),
        "PEER": peer_prologue(q),
        "PEERS": str(int(q.memory.peer is not None)),
        "DIMS": " ".join(f"const long long {dimc(s)} = args.dims[{k}];" for k, s in enumerate(symbols)),
        "LAUNCHES": str(table.prefix.rows),
        "LAUNCH_VALUES": ", ".join(f"max_i64(0LL, {x})" for x in table.prefix.launches) or "0LL",
        "CASES": "\n".join(cases),
        "MAXSIGNALS": str(max([1, *(len(e.signals) for e in q.entries)])),
        **deferred_slots(q),
    }
    for name, text in slots.items():
        src = src.replace(f"/*@{name}@*/", text)
    return Rendered(src, table)

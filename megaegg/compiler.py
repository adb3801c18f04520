"""``compile(graph)``: graph -> BlockProgram -> work queue -> CUDA source -> one persistent kernel.

>>> import torch, megaegg as me
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32); w = g.weight("w", [32, 64], me.f32)
>>> _ = g.output("y", me.silu(me.linear(x, w)))
>>> k = me.compile(g, weights={"w": torch.randn(32, 64)}, backend="sim")
>>> x0 = torch.randn(1, 64)
>>> bool(torch.allclose(k(x=x0)["y"], me.run_reference(g, {"x": x0}, {"w": k.weights["w"]})["y"], atol=1e-5))
True
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import logging
import math
import os
import time
from typing import Iterable, Mapping, Sequence

import torch

from .artifact import Artifact, artifact_key, load_cached, store_cached
from .dims import as_dim, evaluate_shape, fmt_shape
from .graph import IN_PLACE_OPS, Graph, GraphError, fmt_bytes
from .rewrite import CostModel  # (the stage's passes are imported by build_artifact, on first use)
from .ir.program import Operand, swap_last

DEFAULT_MAX_DIM = 8192
BACKENDS = ("cuda", "sim")
log = logging.getLogger("megaegg")


def compile_options(graph: Graph, max_dims: Mapping[str, int] | None, dims_hint: Mapping[str, int] | None,
                    cost_model: CostModel | None) -> dict:
    """The options that decide an artifact, checked against the graph's runtime dims."""
    if not isinstance(graph, Graph):
        raise GraphError(f"graph must be a megaegg.Graph, got {type(graph).__name__}")
    graph.check()  # (a node list edited by hand: dangling ids, cycles)
    if not graph.outputs:
        raise GraphError("graph has no outputs: call graph.output(name, tensor)")
    symbols = sorted(graph.symbols())
    for arg, given in (("max_dims", max_dims), ("dims_hint", dims_hint)):
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise GraphError(f"{arg} must be a dict of runtime dim -> int, got {type(given).__name__}")
        unknown = sorted(set(given) - set(symbols))
        if unknown:
            raise GraphError(f"{arg}: unknown runtime dim(s) {', '.join(map(repr, unknown))}; "
                             f"the graph's runtime dims are: {', '.join(map(repr, symbols)) or 'none'}")
        for name, v in given.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise GraphError(f"{arg}[{name!r}] must be a non-negative int, got {v!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise GraphError(f"cost_model must be a megaegg.rewrite.cost.CostModel, got {type(cost_model).__name__}")
    return {
        "max_dims": {s: DEFAULT_MAX_DIM for s in symbols} | dict(max_dims or {}),
        "dims_hint": dict(dims_hint or {}),
        "cost_model": cost_model or CostModel(),
    }


def build_artifact(
    graph: Graph, *, max_dims: Mapping[str, int] | None = None, cost_model: CostModel | None = None,
    dims_hint: Mapping[str, int] | None = None, compile_cuda: bool = True,
) -> Artifact:
    """Compile ``graph`` from scratch (no artifact cache): rewrite, queue, CUDA source [, cubin]."""
    from .interpreter import defines, render
    from .lowering import build_queue
    from .rewrite import RewriteStats, rewrite

    opts = compile_options(graph, max_dims, dims_hint, cost_model)
    stats = RewriteStats()
    log.info("rewrite: %d graph nodes ...", len(graph.nodes))
    t0 = time.perf_counter()
    program = rewrite(graph, cost_model=opts["cost_model"], dims_hint=opts["dims_hint"], stats=stats,
                      max_dims=opts["max_dims"])
    t1 = time.perf_counter()
    queue = build_queue(program, opts["max_dims"])
    t2 = time.perf_counter()
    defs = defines()
    rendered = render(queue)
    t3 = time.perf_counter()
    timings = {"rewrite": t1 - t0, **{f"rewrite.{k}": v for k, v in stats.seconds.items()},
               "barriers+queue": t2 - t1, "render": t3 - t2}
    log.info("rewrite: %d block ops in %.2f s", len(queue.entries), t3 - t0)
    constants = {}
    for b in program.buffers:
        if b.kind == "constant":
            node = next(n for n in graph.nodes if n.op == "constant" and n.name == b.name)
            constants[b.id] = node.attrs["value"]
    art = Artifact(queue=queue, source=rendered.source, table=rendered.table.words(), constants=constants,
                   defines=defs, timings=timings)
    if compile_cuda:
        compile_kernel(art)
    return art


def compile_kernel(art: Artifact) -> None:
    """Give ``art`` its cubin(s) (NVRTC, or the cubin cache)."""
    log.info("nvrtc: compiling %d KB of CUDA (cold: ~10-60 s; cached cubins load at once) ...", len(art.source) // 1024)
    t0 = time.perf_counter()
    images, cached = kernel_images(art.source, art.defines, art.queue)
    art.cubins = images
    art.timings["nvrtc"] = time.perf_counter() - t0
    art.timings["nvrtc_cached"] = float(cached)
    log.info("nvrtc: %s", "cubin cache hit" if cached else f"compiled in {art.timings['nvrtc']:.1f} s")


def kernel_images(source: str, defs: Mapping[str, int], queue) -> tuple[list[bytes], bool]:
    """The cubin of ``source``, or with a row regime one per band, in band order (compiled side by side;
    their defines: ``interpreter.image_defines``); and whether all came from the cubin cache."""
    from concurrent.futures import ThreadPoolExecutor

    from .interpreter import compile_cubin, image_defines

    variants = image_defines(queue, dict(defs))
    # egglog's EGraph must be freed on the thread that made it: collect the rewrite's garbage here, or a
    # collection the workers' allocations trigger frees it there ("EGraph is unsendable" tracebacks, seen
    # on Python 3.12 in scripts/dev/hop_probe.py)
    gc.collect()
    with ThreadPoolExecutor(len(variants)) as pool:
        outs = list(pool.map(lambda d: compile_cubin(source, defines=d), variants))
    return [o.cubin for o in outs], all(o.cached for o in outs)


def cached_artifact(graph: Graph, *, max_dims=None, cost_model=None, dims_hint=None, compile_cuda: bool = True) -> Artifact:
    """:func:`build_artifact` through the on-disk artifact cache (``$MEGAEGG_CACHE/artifacts``): a graph
    compiled before with the same options and code version is loaded, not rebuilt."""
    t0 = time.perf_counter()
    opts = compile_options(graph, max_dims, dims_hint, cost_model)
    from .interpreter import defines

    key = artifact_key(graph, {**opts, "defines": defines()})
    art = load_cached(key, graph)  # None: absent, caching off, or a bad entry (warned about once): rebuilt
    if art is None:
        art = build_artifact(graph, compile_cuda=compile_cuda, **opts)
        store_cached(key, art)
        return art
    art.timings = {"cache_load": time.perf_counter() - t0}
    log.info("artifact cache hit: %d block ops loaded in %.2f s", len(art.queue.entries), art.timings["cache_load"])
    if compile_cuda and not art.compiled:  # cached from a simulator run: add the cubin(s)
        compile_kernel(art)
        store_cached(key, art)
    return art


# --- memory: what a kernel holds, and whether it fits ---------------------------------------------
def tensor_bytes(shape, dtype, max_dims: Mapping[str, int]) -> int:
    """Bytes of a tensor of ``shape`` (runtime dims at most ``max_dims``) and ``dtype``, at its largest."""
    from .lowering import upper_bound

    return dtype.itemsize * math.prod(upper_bound(d, max_dims) for d in shape)


def leaf_memory(leaves: Iterable[tuple[str, str, object, tuple]], max_dims: Mapping[str, int]) -> list[tuple[str, str, int]]:
    """(kind, what, bytes) of each leaf (kind, name, dtype, shape): a weight or constant bound once, an input
    or a cache (an input updated in place) that a call passes, at ``max_dims``."""
    return [(kind, f"{kind} {name!r} {dtype}{fmt_shape(shape)}", tensor_bytes(shape, dtype, max_dims))
            for kind, name, dtype, shape in leaves]


def kernel_memory(artifact: Artifact) -> list[tuple[str, str, int]]:
    """Everything a compiled kernel needs in memory, (kind, what, bytes), at its ``max_dims``: each weight and
    constant it binds, each input and cache a call passes, and its work area (the arena of intermediate
    tensors, the barrier counters and accumulators of both parities, the control record and the op table,
    a tensor-parallel peer region). The one place these sizes are computed (``Kernel`` checks them)."""
    from .interpreter.runtime import CONTROL_WORDS

    queue = artifact.queue
    kinds = {"weight": "weight", "constant": "constant", "input": "input", "state": "cache"}
    leaves = [(kinds[b.kind], b.name, b.dtype, swap_last(b.shape) if b.transposed else b.shape)
              for b in queue.program.buffers if b.kind in kinds]
    mem = queue.memory
    work = (mem.arena_bytes + 2 * 4 * max(1, mem.counters) + 8 * CONTROL_WORDS + 8 * len(artifact.table or ())
            + (mem.peer.region_bytes if mem.peer else 0))
    dims = ", ".join(f"{k}={v}" for k, v in queue.max_dims.items() if k in queue.program.symbols)
    what = f"work area (arena and counters{f' at max_dims {dims}' if dims else ''})"
    return leaf_memory(leaves, queue.max_dims) + [("work area", what, work)]


def graph_memory(graph: Graph, max_dims: Mapping[str, int]) -> list[tuple[str, str, int]]:
    """:func:`kernel_memory`'s leaves, from the graph (before it is compiled): the weights and constants the
    outputs read, the inputs (a cache: the first operand of an in-place op)."""
    live = graph.live_nodes()
    caches = {n.inputs[0] for n in graph.nodes if n.op in IN_PLACE_OPS and n.id in live}
    kind = {"weight": "weight", "constant": "constant", "input": "input"}
    return leaf_memory([("cache" if n.id in caches else kind[n.op], n.name, n.dtype, n.shape)
                        for n in graph.nodes if n.op in kind and n.id in live], max_dims)


def host_memory() -> int | None:
    """Bytes of memory on the host (its physical memory, or a smaller cgroup limit); None where unknown."""
    total = None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # (not on every platform)
        pass
    for file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(file) as f:
                limit = int(f.read().strip())  # ("max": no limit, a ValueError)
        except (OSError, ValueError):
            continue
        if limit > 0 and (total is None or limit < total):
            total = limit
    return total


def memory_of(device) -> tuple[str, int | None, int | None]:
    """(how messages name it, total bytes, bytes free now) of the memory ``device``'s tensors live in: a GPU's,
    or the host's for the CPU (and the simulator; its free bytes: None, the OS pages memory in and out)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's cached blocks
        return f"GPU {device}", total, free
    if device.type == "cpu":
        return "the host", host_memory(), None
    return str(device), None, None


def check_fits(needs: Sequence[tuple[str, str, int]], device, *, now: int = 0, hint: str = "") -> None:
    """Refuse what cannot fit ``device``'s memory with a GraphError naming it and its size: any one of
    ``needs`` (kind, what, bytes), or all of them together; ``now``: bytes about to be allocated on
    ``device``, against its free memory. ``hint`` ends a message about the work area or the inputs."""
    where, total, free = memory_of(device)
    if total is not None:
        for kind, what, n in needs:
            if n > total:
                tail = hint if kind in ("work area", "input", "cache") else ""
                raise GraphError(f"{what} needs {fmt_bytes(n)}; {where} has {fmt_bytes(total)}{tail}")
        need = sum(n for _, _, n in needs)
        if need > total:
            by_kind: dict[str, int] = {}
            for kind, _, n in needs:
                by_kind[kind] = by_kind.get(kind, 0) + n
            parts = ", ".join(f"{kind}{'s' if kind not in ('work area',) else ''} {fmt_bytes(n)}"
                              for kind, n in sorted(by_kind.items(), key=lambda kv: -kv[1]))
            raise GraphError(f"the kernel needs {fmt_bytes(need)} in all ({parts}); {where} has {fmt_bytes(total)}{hint}")
    if free is not None and now > free:
        raise GraphError(f"binding the kernel allocates {fmt_bytes(now)} on {where}, which has {fmt_bytes(free)} free{hint}")


# --- aliasing: tensors the kernel writes must not share memory with another it reads or writes ------
def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, last + 1)`` that ``t``'s elements occupy; (0, 0) for an empty tensor."""
    n = t.numel()
    if n == 0:
        return 0, 0
    p, size = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return p, p + n * size
    lo = hi = 0
    for d, st in zip(t.shape, t.stride()):
        if st > 0:
            hi += (d - 1) * st
        else:
            lo += (d - 1) * st
    return p + lo * size, p + (hi + 1) * size


class Spans:
    """The byte ranges of tensors bound once (weights, constants): which one a range overlaps, by bisection."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.spans = sorted(((s, e, what) for what, t in named for s, e in [_span(t)] if e > s), key=lambda x: x[0])
        self.starts = [s for s, _, _ in self.spans]
        self.max_end = list(itertools.accumulate((e for _, e, _ in self.spans), max))

    def find(self, start: int, end: int) -> str | None:
        i = bisect.bisect_left(self.starts, end)  # spans[:i] start before ``end``
        if i == 0 or self.max_end[i - 1] <= start:
            return None
        return next(what for s, e, what in reversed(self.spans[:i]) if e > start)


def check_aliasing(entries: Iterable[tuple[str, torch.Tensor, bool]], bound: Spans | None = None) -> None:
    """``entries``: (what, tensor, written in place) of a call's tensors. Two that share memory (the same
    tensor, views of one, overlapping byte ranges), at least one of them written by the kernel, or a written
    one sharing memory with a ``bound`` weight: a GraphError naming both (read-only ones may alias)."""
    spans = sorted(((s, e, what, w) for what, t, w in entries for s, e in [_span(t)] if e > s), key=lambda x: x[0])
    for i, (s, e, what, w) in enumerate(spans):
        for s2, _, what2, w2 in itertools.islice(spans, i + 1, None):
            if s2 >= e:
                break
            if w or w2:
                raise _alias_error(what, w, what2, w2)
        if w and bound is not None:
            hit = bound.find(s, e)
            if hit is not None:
                raise GraphError(f"{what}, which the kernel updates in place, shares memory with {hit}: the call "
                                 "would overwrite it; pass a separate tensor")


def _alias_error(a: str, a_written: bool, b: str, b_written: bool) -> GraphError:
    if a_written and b_written:
        a, b = sorted((a, b))
        return GraphError(f"{a} and {b} share memory (the same tensor, or overlapping views): the kernel updates "
                          "both in place; pass a separate tensor for each")
    if a_written:
        a, b = b, a
    return GraphError(f"{a} shares memory with {b}, which the kernel updates in place: pass separate tensors "
                      f"(or a copy of {a.split(' ', 1)[-1]})")


class AliasGuard:
    """:func:`check_aliasing` at every call, cheap when the tensors written in place (the caches) are those
    of the last call: then only the read-only inputs are checked against them."""

    def __init__(self, bound_named: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        """``bound_named``: (what, tensor) bound to the kernel (weights, constants), which no written tensor may share."""
        self.bound_named = list(bound_named)
        self.bound = Spans(self.bound_named)
        self.key, self.written = None, None

    def check(self, labels: Sequence[str], written: list[torch.Tensor], others: list[tuple[str, torch.Tensor]],
              extra=()) -> None:
        """``written``: the tensors updated in place, ``labels`` their names; ``others``: (what, tensor) only read;
        ``extra``: what else decides the written tensors' byte ranges (their runtime dims), with their addresses."""
        key = [t.data_ptr() for t in written]
        key.append(extra)
        if key != self.key:
            self.key = None
            check_aliasing([*zip(labels, written, itertools.repeat(True)), *((w, t, False) for w, t in others)],
                           self.bound)
            self.key, self.written = key, Spans(zip(labels, written))
            return
        for what, t in others:
            s, e = _span(t)
            hit = self.written.find(s, e) if e > s else None
            if hit is not None:
                raise _alias_error(what, False, hit, True)


def _check_has_data(what: str, t: torch.Tensor) -> None:
    """A tensor on the meta device (shapes only) or a sparse one: a GraphError naming it, not torch's error."""
    if t.is_meta:
        raise GraphError(f"{what} is on the meta device (no data): load it first (e.g. to_empty() and load_state_dict(), "
                         "or from a checkpoint)")
    if t.layout != torch.strided:
        raise GraphError(f"{what} is a {t.layout} tensor: pass a dense one (.to_dense())")


class Kernel:
    """A compiled graph. ``kernel(**inputs, **dims)`` returns the outputs by name; ``kernel.launcher(**inputs,
    **dims)`` checks a call once and launches it again and again without checks (:class:`Launcher`)."""

    def __init__(self, artifact: Artifact, weights: Mapping[str, torch.Tensor], *, backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        backend = resolve_backend(backend)
        self.artifact, self.backend = artifact, backend
        self.queue = artifact.queue
        self.program = self.queue.program
        self.device = torch.device(device or ("cuda" if backend == "cuda" else "cpu"))
        self.weights = self._bind_weights(weights)
        bound = {**{b: t.to(self.device) for b, t in artifact.constants.items()}, **self.weights_by_buffer}
        self.bound = bound
        buffers = self.program.buffers
        self._state_ids = tuple(b.id for b in buffers if b.kind == "state")  # inputs updated in place
        self._written = frozenset(self._state_ids)
        self._inputs = {b.name: b for b in buffers if b.kind in ("input", "state")}  # what a call passes, by name
        self._labels = {b.id: f"input {name!r}" for name, b in self._inputs.items()}
        self._state_labels = [self._labels[i] for i in self._state_ids]
        # the written inputs' byte ranges follow from their addresses, and from the runtime dims if their shapes hold any
        self._state_symbolic = any(not d.is_const for i in self._state_ids for d in buffers[i].shape)
        self._alias = AliasGuard([(f"{buffers[i].kind} {buffers[i].name!r}", t) for i, t in bound.items()]) \
            if self._written else None
        self._runner = None
        if backend == "cuda":
            from .interpreter import CudaRunner

            if not artifact.compiled:
                raise GraphError("artifact was built without a cubin (compile_cuda=False): build it for backend 'cuda'")
            self._runner = CudaRunner(self.queue, artifact.cubins, bound, self.device, defines=artifact.defines,
                                      table=artifact.table)

    # --- binding and validation ----------------------------------------------------------
    def _bind_weights(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        want = [b for b in self.program.buffers if b.kind == "weight"]
        if not isinstance(weights, Mapping):
            raise GraphError(f"weights must be a dict of name -> torch.Tensor, got {type(weights).__name__}")
        names = sorted({b.name for b in want})
        missing = sorted(set(names) - set(weights))
        if missing:
            raise GraphError(f"missing weight(s): {', '.join(missing)}")
        unknown = sorted(set(weights) - set(names) - set(self.program.unused_leaves))
        if unknown:  # a typo or a stale name would otherwise be ignored silently
            raise GraphError(f"unknown weight(s): {', '.join(map(repr, unknown))}; the compiled graph reads: "
                             f"{', '.join(map(repr, names)) or 'none'}")
        for b in want:
            t = weights[b.name]
            shape = swap_last(b.shape) if b.transposed else b.shape  # the user's shape
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != evaluate_shape(shape, {}) or t.dtype != b.dtype.torch:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise GraphError(f"weight {b.name!r}: expected {b.dtype}{fmt_shape(shape)}, got {got}")
            _check_has_data(f"weight {b.name!r}", t)
        self._check_memory(weights)  # before copying anything
        out, self.weights_by_buffer = {}, {}
        for b in want:
            t = weights[b.name]
            if b.transposed:  # a weight a block op reads transposed: stored with its last two dims swapped
                stored = t.to(self.device).transpose(-1, -2).contiguous()
                out.setdefault(b.name, stored.transpose(-1, -2))  # the user's layout, as a view: no second copy
            else:
                stored = out[b.name] = t.to(self.device).contiguous()
            self.weights_by_buffer[b.id] = stored
        return out

    def memory(self) -> list[tuple[str, str, int]]:
        """(kind, what, bytes) of everything this kernel needs in memory at its max_dims (:func:`kernel_memory`)."""
        return kernel_memory(self.artifact)

    def _check_memory(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Refuse a kernel whose weights, caches, inputs or work area cannot fit the device (the host for
        the simulator), naming the one that does not fit and its size; on a GPU, also what binding it
        allocates now (the work area, the weights not already there) against the free memory."""
        needs = self.memory()
        now = 0
        if self.backend == "cuda":
            now = sum(n for kind, _, n in needs if kind in ("work area", "constant"))
            for b in self.program.buffers:
                if b.kind != "weight":
                    continue
                t = weights[b.name]
                there = t.device.type == "cuda" and self.device.index in (None, t.device.index)
                if b.transposed or not there or not t.is_contiguous():
                    now += tensor_bytes(b.shape, b.dtype, {})
        hint = " (compile with smaller max_dims)" if self.program.symbols else ""
        check_fits(needs, self.device, now=now, hint=hint)

    def _one_rank(self) -> None:
        """A kernel of several ranks runs only with its peers (alone, its waits on them would time out)."""
        if self.program.ranks > 1:
            raise GraphError(f"the graph spans {self.program.ranks} ranks (all_reduce, all_gather): run it with "
                             "megaegg.parallel.ParallelKernel, one rank a GPU")

    def _split_args(self, kwargs: dict) -> tuple[dict[int, torch.Tensor], dict[str, int]]:
        symbols = self.program.user_symbols
        dims = {k: v for k, v in kwargs.items() if k in symbols}
        inputs = self._inputs
        unknown = sorted(set(kwargs) - set(dims) - set(inputs) - set(self.program.unused_leaves))
        if unknown:
            raise GraphError(f"unknown argument(s) {unknown}; inputs: {sorted(inputs)}, runtime dims: {list(symbols)}")
        dims = self._checked_dims(dims)
        tensors = {}
        for name, b in inputs.items():
            if name not in kwargs:
                raise GraphError(f"missing input {name!r}")
            tensors[b.id] = self._checked_input(name, kwargs[name], dims)
        if self._alias is not None:  # (the tensors as the kernel sees them: a copied input aliases nothing)
            self._alias.check(self._state_labels, [tensors[i] for i in self._state_ids],
                              [(self._labels[i], t) for i, t in tensors.items() if i not in self._written],
                              tuple(dims.values()) if self._state_symbolic else ())
        return tensors, dims

    def _checked_dims(self, dims: Mapping[str, int]) -> dict[str, int]:
        """Every runtime dim given, in range, the ops' bounds kept: the dims with the derived ones."""
        for s in self.program.user_symbols:
            v = dims.get(s)
            if v is None:
                raise GraphError(f"missing value for runtime dim {s!r}")
            if isinstance(v, bool) or not isinstance(v, int):
                raise GraphError(f"runtime dim {s!r} must be an int, got {type(v).__name__} {v!r}")
            if not 0 <= v <= self.queue.max_dims[s]:
                raise GraphError(f"runtime dim {s!r} = {v!r} outside [0, {self.queue.max_dims[s]}] (compile with max_dims to raise it)")
        dims = self.program.with_derived(dims)  # (a row regime's dims: ir/program.py Regime)
        for c in self.program.checks:  # the ops' own bounds (an attention within its cache, ...)
            v, lo, hi = c.value.eval(dims), c.lo.eval(dims), c.hi.eval(dims)
            if not lo <= v <= hi:
                raise GraphError(f"{c.what} {v} outside [{lo}, {hi}] ({c.value} with "
                                 f"{', '.join(f'{k}={x}' for k, x in dims.items())})")
        return dims

    def _checked_input(self, name: str, t, dims: Mapping[str, int]) -> torch.Tensor:
        """Input ``name`` as the kernel reads it: its shape and dtype checked, on the device, contiguous (a
        read-only input copied where it is not; an input updated in place must be)."""
        b = self._inputs[name]
        shape = evaluate_shape(b.shape, dims)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != b.dtype.torch:
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise GraphError(f"input {name!r}: expected {b.dtype}{list(shape)}, got {got}")
        _check_has_data(f"input {name!r}", t)
        if t.device.type != self.device.type:
            if b.kind == "state":
                raise GraphError(f"input {name!r} is updated in place and must live on {self.device}, not {t.device}")
            t = t.to(self.device)
        if not t.is_contiguous():
            if b.kind == "state":
                raise GraphError(f"input {name!r} is updated in place and must be contiguous")
            t = t.contiguous()
        return t

    # --- running ----------------------------------------------------------------------
    def __call__(self, *, check: bool = True, **kwargs) -> dict[str, torch.Tensor]:
        """Run once: the outputs by name. ``check=False``: on the cuda backend, return without waiting for
        the launch (the outputs are queued on the current stream); :meth:`check` raises its errors later."""
        self._one_rank()
        tensors, dims = self._split_args(kwargs)
        if self.backend == "sim":
            return self._run_sim(tensors, dims)
        self._runner.launch([dims[s] for s in self.program.symbols], tensors)
        outs = {name: self._read_cuda(o, dims, tensors) for name, o in self.program.outputs.items()}
        if check:
            self._runner.check()
        return outs

    def launcher(self, **kwargs) -> "Launcher":
        """The call ``kernel(**kwargs)`` checked once (inputs, dims, bounds, aliasing): a :class:`Launcher`
        that launches it again and again without any check (or with some read-only inputs and runtime dims
        changed, checking those only), for benchmarks and tight loops."""
        self._one_rank()
        tensors, dims = self._split_args(kwargs)
        return Launcher(self, tensors, dims)

    def result_of(self, output: torch.Tensor) -> "LaunchResult":
        """``output``, one of the outputs of the launch just queued (a call with ``check=False``), as a
        :class:`LaunchResult`: on the cuda backend its copy to host memory and the kernel's error record are
        queued on the stream behind that launch, so launches queued after it do not delay
        :meth:`LaunchResult.get` (a plain read of the output, or :meth:`check`, waits for them too)."""
        if self.backend != "cuda":
            return LaunchResult(output)
        host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True).copy_(output, non_blocking=True)
        recorded = self._runner.control_copy()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # (the stream the launch and the copies went to)
        return LaunchResult(output, host, recorded, done, self._runner)

    def check(self) -> None:
        """Wait for this kernel's launches so far and raise the error they recorded, if any
        (``megaegg.interpreter.MegakernelError``: a barrier wait timed out, an index out of range, NaN
        logits), after which the kernel is usable again. The sim backend raises at once: nothing to do."""
        if self._runner is not None:
            self._runner.check()

    @property
    def launches(self) -> int:
        """How many times this kernel ran (device launches on the cuda backend, ``trace()``'s not counted;
        simulator runs on the sim backend)."""
        return self._runner.stats.launches if self._runner is not None else self._sim_runs

    _sim_runs = 0  # (the sim backend's launches)

    def _read_cuda(self, o: Operand, dims, tensors) -> torch.Tensor:
        lay = self.queue.layout(o)
        mem = self.queue.memory
        if o.buffer in mem.arena_offset:
            buf = self.program.buffers[o.buffer]
            base = self._runner.arena[mem.arena_offset[o.buffer]:].view(buf.dtype.torch)
        else:
            base = (tensors.get(o.buffer) if o.buffer in tensors else self.bound[o.buffer]).reshape(-1)
        # as_strided's offset is absolute in the storage: add the slice's own offset
        return base.as_strided([d.eval(dims) for d in lay.shape], [d.eval(dims) for d in lay.stride],
                               base.storage_offset() + lay.offset.eval(dims)).clone()

    def _run_sim(self, tensors, dims, interleaving=None) -> dict[str, torch.Tensor]:
        from .interpreter import Interleaving, Simulation

        sim = Simulation(self.queue, self._sim_buffers(tensors, dims), dims)
        self._sim_runs += 1
        sim.run(interleaving or self.interleaving or Interleaving())
        return {name: sim.view(o, dims).clone() for name, o in self.program.outputs.items()}

    def _sim_buffers(self, tensors, dims) -> dict[int, torch.Tensor]:
        """Every buffer as a flat tensor: the caller's, the bound ones, fresh ones for the rest."""
        flat = {}
        for b in self.program.buffers:
            if b.id in tensors:
                flat[b.id] = tensors[b.id].view(-1)
            elif b.id in self.bound:
                flat[b.id] = self.bound[b.id].reshape(-1)
            else:
                n = 1
                for d in evaluate_shape(b.shape, dims):
                    n *= d
                alloc = torch.zeros if b.kind == "accum" else torch.empty  # accum: zeroed each launch, as on the GPU
                flat[b.id] = alloc(n, dtype=b.dtype.torch)
        return flat

    def trace(self, **kwargs):
        """Run once with per-instance timestamps (a separately compiled traced kernel); returns a Trace."""
        import numpy as np

        from .interpreter import CudaRunner, Trace, compile_cubin
        from .interpreter.trace import TRACE_WORDS
        from .lowering import upper_bound

        if self.backend != "cuda":
            raise GraphError("trace() needs the cuda backend")
        self._one_rank()
        tensors, dims = self._split_args(kwargs)
        if getattr(self, "_traced", None) is None:
            traced = {**self.artifact.defines, "MEGA_TRACE": 1}
            images, _ = kernel_images(self.artifact.source, traced, self.queue)
            cap = sum(upper_bound(e.launch, self.queue.max_dims) for e in self.queue.entries)
            self._traced = CudaRunner(self.queue, images, self.bound, self.device, defines=traced,
                                      table=self.artifact.table, trace_instances=cap)
        run = self._traced
        dim_list = [dims[s] for s in self.program.symbols]
        run.launch(dim_list, tensors)  # warm-up: module load, caches
        run.launch(dim_list, tensors)
        run.check()
        total = sum(max(0, e.launch.eval(dims)) for e in self.queue.entries)
        raw = run.trace[: TRACE_WORDS * total].cpu().numpy().view(np.uint64).reshape(total, TRACE_WORDS)
        return Trace(self.queue, raw)

    interleaving = None  # how the simulator interleaves the SMs; set a megaegg.interpreter.Interleaving to vary it

    def simulate(self, interleaving, **kwargs) -> dict[str, torch.Tensor]:
        """Run on the CPU simulator under ``interleaving`` (a megaegg.interpreter.Interleaving: SM count,
        random seed, adversarial)."""
        self._one_rank()
        tensors, dims = self._split_args(kwargs)
        return self._run_sim(tensors, dims, interleaving)

    # --- tensor-parallel peers (megaegg.parallel.ParallelKernel wires its ranks' kernels together) ---
    def _peer_region(self) -> torch.Tensor:
        return self._runner.peer_region

    def _set_peers(self, rank: int, regions: list[int]) -> None:
        self._runner.set_peers(rank, regions)

    def _reset_peers(self) -> None:
        self._runner.reset_peers()


class Launcher:
    """One call of a :class:`Kernel`, checked once by ``kernel.launcher(**inputs, **dims)``: ``launcher()``
    launches it again with no check at all (on the cuda backend it queues one launch on torch's current
    stream and returns; on the sim backend it runs the simulator). ``check()`` waits and raises a kernel
    error the launches recorded (:meth:`Kernel.check`); ``outputs()`` reads what the last launch wrote.

    It launches on the tensors it was given every time (an input on another device, or not contiguous,
    is copied once, when the launcher is made): update them in place between launches (``copy_``; the
    kernel itself updates its caches), never free them. ``launcher(**changes)`` launches with some
    read-only inputs and runtime dims changed, checking only those (a decode loop's token and position;
    the inputs updated in place stay the launcher's; where an input's shape holds a runtime dim, a change of
    dims checks the whole call again).

    >>> import torch, megaegg as me
    >>> g = me.Graph(); x = g.input("x", [1, 64], me.f32)
    >>> _ = g.output("y", me.silu(me.linear(x, g.weight("w", [32, 64], me.f32))))
    >>> kernel = me.compile(g, {"w": torch.randn(32, 64)}, backend="sim")
    >>> x0 = torch.randn(1, 64)
    >>> launch = kernel.launcher(x=x0)
    >>> for _ in range(3):
    ...     launch()
    >>> launch.check()
    >>> bool(torch.equal(launch.outputs()["y"], kernel(x=x0)["y"])), kernel.launches
    (True, 4)
    """

    def __init__(self, kernel: Kernel, tensors: dict[int, torch.Tensor], dims: dict[str, int]) -> None:
        self.kernel, self._last = kernel, None
        self._bind(tensors, dims)
        # the call in full (checked again where a change of dims could change an input's shape)
        self._symbolic = kernel._state_symbolic or any(not as_dim(d).is_const for b in kernel._inputs.values()
                                                       for d in b.shape)

    def _bind(self, tensors: dict[int, torch.Tensor], dims: dict[str, int], *, state: bool = True) -> None:
        self._tensors, self.dims = tensors, dims
        if state:  # (what its launches update in place, which a changed input may not overlap)
            k = self.kernel
            self._updated = Spans((k._labels[i], tensors[i]) for i in k._state_ids)
        if self.kernel.backend == "cuda":  # (bound once: a launch is one call into the runtime)
            self._launch = functools.partial(self.kernel._runner.launch, [dims[s] for s in self.kernel.program.symbols],
                                             tensors)
        else:
            self._launch = self._simulate

    def __call__(self, **changes) -> None:
        if changes:
            self._change(changes)
        self._launch()

    def _change(self, changes: dict) -> None:
        """Rebind the read-only inputs and runtime dims in ``changes``, each checked as a call checks it."""
        k = self.kernel
        symbols = k.program.user_symbols
        new_dims = {s: v for s, v in changes.items() if s in symbols}
        changes = {n: v for n, v in changes.items() if n not in k.program.unused_leaves}  # (as a call ignores them)
        for name in changes:
            if name in k._inputs and k._inputs[name].kind == "state":
                raise GraphError(f"input {name!r} is updated in place: a launcher keeps the one it was made with")
        if new_dims and self._symbolic:  # (shapes may follow the dims: the whole call again)
            given = {name: self._tensors[b.id] for name, b in k._inputs.items()}
            tensors, dims = k._split_args({**given, **{s: self.dims[s] for s in symbols}, **changes})
            return self._bind(tensors, dims)
        dims = k._checked_dims({**{s: self.dims[s] for s in symbols}, **new_dims}) if new_dims else self.dims
        tensors = dict(self._tensors)
        for name, t in changes.items():
            if name in new_dims:
                continue
            b = k._inputs.get(name)
            if b is None:
                raise GraphError(f"unknown argument {name!r}; inputs: {sorted(k._inputs)}, runtime dims: {list(symbols)}")
            t = tensors[b.id] = k._checked_input(name, t, dims)
            hit = self._updated.find(*_span(t)) if t.numel() else None
            if hit is not None:
                raise _alias_error(k._labels[b.id], False, hit, True)
        self._bind(tensors, dims, state=False)

    def _simulate(self) -> None:
        self._last = self.kernel._run_sim(self._tensors, self.dims)

    def check(self) -> None:
        """Wait for the launches and raise the error they recorded, if any (:meth:`Kernel.check`)."""
        self.kernel.check()

    def result(self, name: str) -> "LaunchResult":
        """Output ``name`` of the last launch without waiting for it: on the cuda backend its copy to host memory
        and the kernel's error record are queued on the stream, so the next launch can be queued before
        :meth:`LaunchResult.get` waits for this one."""
        k = self.kernel
        if name not in k.program.outputs:
            raise GraphError(f"unknown output {name!r}; outputs: {sorted(k.program.outputs)}")
        if k.backend == "sim":
            return LaunchResult(self.outputs()[name])
        return k.result_of(k._read_cuda(k.program.outputs[name], self.dims, self._tensors))

    def outputs(self) -> dict[str, torch.Tensor]:
        """The outputs by name as the last launch wrote them (copies; on the cuda backend, queued on the
        current stream after it)."""
        k = self.kernel
        if k.backend == "sim":
            if self._last is None:
                raise GraphError("launcher.outputs(): nothing was launched yet")
            return dict(self._last)
        return {name: k._read_cuda(o, self.dims, self._tensors) for name, o in k.program.outputs.items()}


class LaunchResult:
    """An output of a launch (:meth:`Launcher.result`): ``device`` as the kernel wrote it (a later launch can read
    it without a round trip through the host), ``get()`` its host copy once the launch is done, raising the
    launch's error first (a ``MegakernelError``, as :meth:`Kernel.check` raises it)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor | None = None, recorded: torch.Tensor | None = None,
                 done=None, runner=None) -> None:
        self.device, self._host, self._recorded, self._done, self._runner = device, host, recorded, done, runner

    def get(self, check: bool = True) -> torch.Tensor:
        """The host copy, once the launch is done (``check``: raising its error first)."""
        if self._done is None:  # (the simulator: done when launched)
            return self.device
        self._done.synchronize()
        if check:
            self._runner.check(self._recorded)
        return self._host


def resolve_backend(backend: str | None) -> str:
    """``backend`` checked against this machine; None picks "cuda" when a GPU is present, else "sim"."""
    if backend is None:
        return "cuda" if torch.cuda.is_available() else "sim"
    if backend not in BACKENDS:
        raise GraphError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "cuda" and not torch.cuda.is_available():
        raise GraphError("backend 'cuda' needs a CUDA GPU and none is available; use backend 'sim' (the CPU simulator)")
    return backend


def compile(  # noqa: A001 - the public name the API promises
    graph: Graph, weights: Mapping[str, torch.Tensor] | None = None, *, backend: str | None = None,
    max_dims: Mapping[str, int] | None = None, cost_model: CostModel | None = None,
    dims_hint: Mapping[str, int] | None = None, device=None, cache: bool = True,
) -> Kernel:
    """Compile ``graph`` into one persistent kernel bound to ``weights``.

    ``backend``: "cuda" (default when a GPU is present) or "sim" (the CPU simulator
    running the same queue). ``max_dims`` bounds each runtime dim (sizes the arena
    and counters); ``dims_hint`` gives representative values for the cost model.
    ``cache``: reuse (and store) the compiled artifact in ``$MEGAEGG_CACHE`` (default
    ``~/.cache/megaegg``), keyed by the graph, these options and the compiler's code,
    so a graph compiled before, in any process, starts without a rewrite or NVRTC.
    """
    backend = resolve_backend(backend)
    opts = compile_options(graph, max_dims, dims_hint, cost_model)
    target = torch.device(device or ("cuda" if backend == "cuda" else "cpu"))
    check_fits(graph_memory(graph, opts["max_dims"]), target,  # before the rewrite: a leaf that cannot fit
               hint=" (compile with smaller max_dims)" if graph.symbols() else "")
    build = cached_artifact if cache else build_artifact
    art = build(graph, max_dims=max_dims, cost_model=cost_model, dims_hint=dims_hint, compile_cuda=backend == "cuda")
    return Kernel(art, weights if weights is not None else {}, backend=backend, device=device)

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

import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from .dims import evaluate_shape, fmt_shape
from .graph import Graph, GraphError
from .rewrite.cost import CostModel
from .rewrite.program import Operand
from .rewrite.schedule import RewriteStats, rewrite

DEFAULT_MAX_DIM = 8192
BACKENDS = ("cuda", "sim")


@dataclass
class Artifact:
    """Everything needed to run without recompiling: the queue, source, cubin and constants."""

    queue: "WorkQueue"  # noqa: F821 (megaegg.lowering.queue)
    source: str
    cubin: bytes | None
    constants: dict[int, torch.Tensor]
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load(path: str | Path) -> "Artifact":
        with open(path, "rb") as f:
            art = pickle.load(f)
        if not isinstance(art, Artifact):
            raise TypeError(f"{path} does not hold a megaegg artifact")
        return art


def build_artifact(
    graph: Graph, *, max_dims: Mapping[str, int] | None = None, cost_model: CostModel | None = None,
    dims_hint: Mapping[str, int] | None = None, compile_cuda: bool = True,
) -> Artifact:
    from .interpreter.nvrtc import compile_cubin
    from .interpreter.render import defines, render
    from .lowering.queue import build_queue

    if not graph.outputs:
        raise GraphError("graph has no outputs: call graph.output(name, tensor)")
    stats = RewriteStats()
    t0 = time.perf_counter()
    program = rewrite(graph, cost_model=cost_model, dims_hint=dict(dims_hint or {}), stats=stats)
    t1 = time.perf_counter()
    maxes = {s: DEFAULT_MAX_DIM for s in graph.symbols()} | dict(max_dims or {})
    queue = build_queue(program, maxes)
    t2 = time.perf_counter()
    source = render(queue)
    t3 = time.perf_counter()
    timings = {"rewrite": t1 - t0, **{f"rewrite.{k}": v for k, v in stats.seconds.items()},
               "barriers+queue": t2 - t1, "render": t3 - t2}
    cubin = None
    if compile_cuda:
        out = compile_cubin(source, defines=defines())
        cubin = out.cubin
        timings["nvrtc"] = out.seconds
        timings["nvrtc_cached"] = float(out.cached)
    constants = {}
    for b in program.buffers:
        if b.kind == "constant":
            node = next(n for n in graph.nodes if n.op == "constant" and n.name == b.name)
            constants[b.id] = node.attrs["value"]
    return Artifact(queue, source, cubin, constants, timings)


class Kernel:
    """A compiled graph. ``kernel(**inputs, **dims)`` returns the outputs by name."""

    def __init__(self, artifact: Artifact, weights: Mapping[str, torch.Tensor], *, backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        backend = backend or ("cuda" if torch.cuda.is_available() else "sim")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' needs a CUDA GPU; use backend='sim' for the CPU simulator")
        self.artifact, self.backend = artifact, backend
        self.queue = artifact.queue
        self.program = self.queue.program
        self.device = torch.device(device or ("cuda" if backend == "cuda" else "cpu"))
        self.weights = self._bind_weights(weights)
        bound = {**{b: t.to(self.device) for b, t in artifact.constants.items()}, **self.weights_by_buffer}
        self.bound = bound
        self._runner = None
        if backend == "cuda":
            from .interpreter.runtime import CudaRunner

            if artifact.cubin is None:
                raise RuntimeError("artifact was built without a cubin (compile_cuda=False)")
            self._runner = CudaRunner(self.queue, artifact.cubin, bound, self.device)

    # --- binding and validation ----------------------------------------------------------
    def _bind_weights(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        want = [b for b in self.program.buffers if b.kind == "weight"]
        missing = sorted({b.name for b in want} - set(weights))
        if missing:
            raise GraphError(f"missing weight(s): {', '.join(missing)}")
        out, self.weights_by_buffer = {}, {}
        for b in want:
            t = weights[b.name]
            shape = tuple(reversed(b.shape)) if b.transposed else b.shape  # the user's shape
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != evaluate_shape(shape, {}) or t.dtype != b.dtype.torch:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise GraphError(f"weight {b.name!r}: expected {b.dtype}{fmt_shape(shape)}, got {got}")
            if b.transposed:  # glu_down's down weight (rewrite/build.py), stored as its transpose
                stored = t.to(self.device).t().contiguous()
                out.setdefault(b.name, stored.t())  # the user's layout, as a view: no second copy
            else:
                stored = out[b.name] = t.to(self.device).contiguous()
            self.weights_by_buffer[b.id] = stored
        return out

    def _split_args(self, kwargs: dict) -> tuple[dict[int, torch.Tensor], dict[str, int]]:
        symbols = self.program.symbols
        dims = {k: v for k, v in kwargs.items() if k in symbols}
        inputs = {b.name: b for b in self.program.buffers if b.kind in ("input", "state")}
        unknown = sorted(set(kwargs) - set(dims) - set(inputs))
        if unknown:
            raise GraphError(f"unknown argument(s) {unknown}; inputs: {sorted(inputs)}, runtime dims: {list(symbols)}")
        for s in symbols:
            v = dims.get(s)
            if v is None:
                raise GraphError(f"missing value for runtime dim {s!r}")
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.queue.max_dims[s]:
                raise GraphError(f"runtime dim {s!r} = {v!r} outside [0, {self.queue.max_dims[s]}] (compile with max_dims to raise it)")
        tensors = {}
        for name, b in inputs.items():
            if name not in kwargs:
                raise GraphError(f"missing input {name!r}")
            t = kwargs[name]
            shape = evaluate_shape(b.shape, dims)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != b.dtype.torch:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise GraphError(f"input {name!r}: expected {b.dtype}{list(shape)}, got {got}")
            if t.device.type != self.device.type:
                if b.kind == "state":
                    raise GraphError(f"input {name!r} is updated in place and must live on {self.device}, not {t.device}")
                t = t.to(self.device)
            if not t.is_contiguous():
                if b.kind == "state":
                    raise GraphError(f"input {name!r} is updated in place and must be contiguous")
                t = t.contiguous()
            tensors[b.id] = t
        return tensors, dims

    # --- running ----------------------------------------------------------------------
    def __call__(self, *, check: bool = True, **kwargs) -> dict[str, torch.Tensor]:
        tensors, dims = self._split_args(kwargs)
        if self.backend == "sim":
            return self._run_sim(tensors, dims)
        self._runner.launch([dims[s] for s in self.program.symbols], tensors)
        outs = {name: self._read_cuda(o, dims, tensors) for name, o in self.program.outputs.items()}
        if check:
            self._runner.check()
        return outs

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

    def _run_sim(self, tensors, dims, schedule=None) -> dict[str, torch.Tensor]:
        from .interpreter.simulator import Schedule, Simulation

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
        sim = Simulation(self.queue, flat, dims)
        sim.run(schedule or self.schedule or Schedule())
        return {name: sim.view(o, dims).clone() for name, o in self.program.outputs.items()}

    def trace(self, **kwargs):
        """Run once with per-instance timestamps (a separately compiled traced kernel); returns a Trace."""
        import numpy as np

        from .interpreter.nvrtc import compile_cubin
        from .interpreter.render import defines
        from .interpreter.runtime import CudaRunner
        from .interpreter.trace import Trace
        from .lowering.queue import upper_bound

        if self.backend != "cuda":
            raise RuntimeError("trace() needs the cuda backend")
        tensors, dims = self._split_args(kwargs)
        if getattr(self, "_traced", None) is None:
            cubin = compile_cubin(self.artifact.source, defines={**defines(), "MEGA_TRACE": 1}).cubin
            cap = sum(upper_bound(e.launch, self.queue.max_dims) for e in self.queue.entries)
            self._traced = CudaRunner(self.queue, cubin, self.bound, self.device, trace_instances=cap)
        run = self._traced
        dim_list = [dims[s] for s in self.program.symbols]
        run.launch(dim_list, tensors)  # warm-up: module load, caches
        run.launch(dim_list, tensors)
        run.check()
        total = sum(max(0, e.launch.eval(dims)) for e in self.queue.entries)
        raw = run.trace[: 4 * total].cpu().numpy().view(np.uint64).reshape(total, 4)
        return Trace(self.queue, raw)

    schedule = None  # the simulator's schedule; set a megaegg.interpreter.simulator.Schedule to vary it

    def simulate(self, schedule, **kwargs) -> dict[str, torch.Tensor]:
        """Run on the CPU simulator with a given schedule (random seed, SM count, adversarial)."""
        tensors, dims = self._split_args(kwargs)
        return self._run_sim(tensors, dims, schedule)


def compile(  # noqa: A001 - the public name the API promises
    graph: Graph, weights: Mapping[str, torch.Tensor] | None = None, *, backend: str | None = None,
    max_dims: Mapping[str, int] | None = None, cost_model: CostModel | None = None,
    dims_hint: Mapping[str, int] | None = None, device=None,
) -> Kernel:
    """Compile ``graph`` into one persistent kernel bound to ``weights``.

    ``backend``: "cuda" (default when a GPU is present) or "sim" (the CPU simulator
    running the same queue). ``max_dims`` bounds each runtime dim (sizes the arena
    and counters); ``dims_hint`` gives representative values for the cost model.
    """
    backend = backend or ("cuda" if torch.cuda.is_available() else "sim")
    art = build_artifact(graph, max_dims=max_dims, cost_model=cost_model, dims_hint=dims_hint,
                         compile_cuda=backend == "cuda")
    return Kernel(art, weights or {}, backend=backend, device=device)

"""``torch.compile(model, backend="megaegg")``: a Dynamo backend. An installed megaegg declares it as a
``torch_dynamo_backends`` entry point (pyproject.toml), which torch.compile looks up by name; a checkout on
``PYTHONPATH`` registers it with :func:`register`.

Dynamo hands a backend each graph it captured (an FX ``GraphModule``) with example inputs; the module's
parameters arrive among them. The backend exports the graph with ``torch.export`` at those inputs, binds
the parameters as weights and compiles it (``export.py``).

Dynamic shapes: where Dynamo made a size symbolic (``dynamic=True``, or by itself once a second size was
seen), the graph takes that size as a ``SymInt`` input beside the tensors whose axes have it. The backend
exports a module that takes the tensors only and reads each such size off its tensor, with that axis a
runtime dim: one megakernel for every size up to a bound (4x the example's, at least 64, at most the size
itself past 4096); a call past it compiles again (logged). The export and the compile happen at the
first call: exporting while Dynamo compiles the caller's frame broke that frame's guards.

A graph it cannot take runs eagerly instead, with the reason logged: an unsupported op, a size input that
is no input tensor's axis, autograd. A parameter changed in place after compiling (its version counter
moved) makes that call run eagerly too, so no call reads a stale weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..graph import GraphError
from .aten import UnsupportedTorch
from .export import dim_names, export_program

log = logging.getLogger("megaegg.frontend")

MIN_DYNAMIC_BOUND = 64  # a dynamic size's first bound: 4x the example's, at least this
GROWTH = 4  # a call past the bound compiles again at this many times its size ...
MAX_SLACK = 4096  # ... but past this size, at the size itself (the arena is sized by the bound)


def megaegg_backend(gm: torch.fx.GraphModule, example_inputs, **_):
    """The Dynamo backend: a compiled callable, or ``gm.forward`` (eager) with the reason logged."""
    try:
        return _compile(gm, list(example_inputs))
    except (UnsupportedTorch, GraphError) as e:
        log.warning("megaegg backend: running this graph eagerly: %s", e)
        return gm.forward


@dataclass(frozen=True)
class _Size:
    """A SymInt graph input: axis ``axis`` of tensor input ``tensor`` (its index among the tensor inputs)."""

    tensor: int
    axis: int


def _symbolic_axes(gm, example_inputs: list) -> dict:
    """Dynamo's size symbols -> the (tensor index among the tensor inputs, axis) pairs that have them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict = {}
    tensors = [k for k, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)]
    for i, k in enumerate(tensors):
        fake = placeholders[k].meta.get("example_value")
        for axis, d in enumerate(fake.shape if fake is not None else ()):
            if isinstance(d, torch.SymInt) and not d.node.expr.is_number:  # (a specialised size: static)
                if not d.node.expr.is_Symbol:
                    raise UnsupportedTorch(f"input {placeholders[k].name}: axis {axis} has the size {d.node.expr}, "
                                           "not a plain symbolic size")
                out.setdefault(d.node.expr, []).append(_Size(i, axis))
    return out


def _size_sources(gm, example_inputs: list, axes: dict) -> list:
    """Per graph input: its index among the tensor inputs, or the _Size it reads."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out, n_tensors = [], 0
    for k, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            out.append(n_tensors)
            n_tensors += 1
        elif isinstance(x, torch.SymInt) and x.node.expr in axes:
            out.append(axes[x.node.expr][0])
        else:
            raise UnsupportedTorch(f"graph input {placeholders[k].name} ({x}) is neither a tensor nor an input "
                                   "tensor's symbolic size")
    return out


class _TensorsOnly(torch.nn.Module):
    """``gm`` called with tensors only: each size input read off the tensor axis it is."""

    def __init__(self, gm, sources: list):
        super().__init__()
        self.gm, self.sources = gm, sources

    def forward(self, *tensors):
        return self.gm(*(tensors[s] if isinstance(s, int) else tensors[s.tensor].shape[s.axis] for s in self.sources))


def _compile(gm, example_inputs: list):
    from . import compile_exported

    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        raise UnsupportedTorch("autograd is not supported (run under torch.no_grad() or torch.inference_mode())")
    axes = _symbolic_axes(gm, example_inputs)
    sources = _size_sources(gm, example_inputs, axes)
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    params = [k for k, t in enumerate(tensors) if isinstance(t, torch.nn.Parameter)]
    device = tensors[0].device if tensors else torch.device("cpu")
    backend = "cuda" if device.type == "cuda" else "sim"
    # each symbolic size a runtime dim; every tensor axis that has it shares one torch.export.Dim
    dims = {sym: (f"s{i}", places) for i, (sym, places) in enumerate(axes.items())}
    export_dims = {name: torch.export.Dim(name) for name, _ in dims.values()}
    shapes = [{p.axis: export_dims[name] for name, places in dims.values() for p in places if p.tensor == k} or None
              for k in range(len(tensors))]
    module = _TensorsOnly(gm, sources)
    params_now = {k: tensors[k] for k in params}  # (not the other example tensors: activations stay free)
    versions = {k: t._version for k, t in params_now.items()}
    kept = [k for k in range(len(tensors)) if k not in params]
    state: dict = {}  # the export and the kernel, made at the first call: exporting while Dynamo compiles
    # the caller's frame broke that frame's guards (its guard on this module's inputs failed at once)

    def sizes(ts) -> dict[str, int]:
        return {name: int(ts[places[0].tensor].shape[places[0].axis]) for name, places in dims.values()}

    def build(ts, at: dict[str, int]):
        if "ep" not in state:
            # (forward(*tensors): one argument, whose dynamic-shapes spec is the tuple of the tensors' specs)
            state["ep"] = export_program(module, tuple(ts), (tuple(shapes),) if dims else None)
            state["names"] = dim_names(state["ep"], tuple(shapes)) if dims else {}
        ep = state["ep"]
        user = list(ep.graph_signature.user_inputs)
        bound_dims = {name: max(MIN_DYNAMIC_BOUND, min(GROWTH * v, max(v, MAX_SLACK))) for name, v in at.items()}
        state["run"] = compile_exported(ep, state["names"], name="dynamo_graph", backend=backend,
                                        bound={user[k]: t for k, t in params_now.items()}, max_dims=bound_dims,
                                        dims_hint=at or None)
        state["bounds"] = bound_dims

    def call(*args):
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        if any(ts[k] is not t or t._version != versions[k] for k, t in params_now.items()):
            log.warning("megaegg backend: a parameter changed since compiling; running this call eagerly")
            return gm.forward(*args)
        now = sizes(ts)
        try:
            if "run" not in state:
                build(ts, now)
            elif any(v > state["bounds"][name] for name, v in now.items()):
                log.warning("megaegg backend: sizes %s past the compiled bounds %s; compiling again", now, state["bounds"])
                build(ts, {name: max(v, state["bounds"][name]) for name, v in now.items()})
        except Exception as e:  # (an export constraint, an op, memory: eager is right, never a wrong answer)
            log.warning("megaegg backend: running this graph eagerly: %s: %s", type(e).__name__, e)
            state["run"], state["bounds"] = None, {name: float("inf") for name in now}
        if state["run"] is None:
            return gm.forward(*args)
        out = state["run"](*(ts[k] for k in kept))
        return out if isinstance(out, tuple) else (out,)

    return call


def register() -> None:
    """Make ``backend="megaegg"`` known to torch.compile where megaegg is not installed (once)."""
    from torch._dynamo import list_backends, register_backend

    if "megaegg" not in list_backends(exclude_tags=()):
        register_backend(megaegg_backend, name="megaegg")

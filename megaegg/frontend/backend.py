"""``torch.compile(model, backend="megaegg")``: a Dynamo backend. An installed megaegg declares it as a
``torch_dynamo_backends`` entry point (pyproject.toml), which torch.compile looks up by name; a checkout on
``PYTHONPATH`` registers it with :func:`register`.

Dynamo hands a backend each graph it captured (an FX ``GraphModule``) with example inputs; the module's
parameters arrive among them. The backend exports the graph with ``torch.export`` at those inputs
(static shapes), binds the parameters as weights and compiles it (``export.py``). A graph it cannot take
runs eagerly instead, with the reason logged: an unsupported op, a symbolic-size input (Dynamo's
dynamic shapes; ``torch.compile(..., dynamic=False)`` avoids them), autograd. A parameter changed in place
after compiling (its version counter moved) makes that call run eagerly too, so no call reads a stale
weight.
"""

from __future__ import annotations

import logging

import torch

from ..graph import GraphError
from .aten import UnsupportedTorch

log = logging.getLogger("megaegg.frontend")


def megaegg_backend(gm: torch.fx.GraphModule, example_inputs, **_):
    """The Dynamo backend: a compiled callable, or ``gm.forward`` (eager) with the reason logged."""
    try:
        return _compile(gm, list(example_inputs))
    except (UnsupportedTorch, GraphError) as e:
        log.warning("megaegg backend: running this graph eagerly: %s", e)
        return gm.forward


def _compile(gm, example_inputs: list):
    from . import compile_exported

    if not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise UnsupportedTorch("a graph input is not a tensor (a symbolic size: compile with dynamic=False)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in example_inputs):
        raise UnsupportedTorch("autograd is not supported (run under torch.no_grad() or torch.inference_mode())")
    params = [k for k, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)]
    device = example_inputs[0].device if example_inputs else torch.device("cpu")
    backend = "cuda" if device.type == "cuda" else "sim"
    with torch.no_grad():
        ep = torch.export.export(gm, tuple(example_inputs))
    names = list(ep.graph_signature.user_inputs)
    run = compile_exported(ep, {}, name="dynamo_graph", bound={names[k]: example_inputs[k] for k in params},
                           backend=backend)
    versions = {k: example_inputs[k]._version for k in params}
    kept = [k for k in range(len(example_inputs)) if k not in versions]

    def call(*args):
        if any(args[k] is not example_inputs[k] or args[k]._version != v for k, v in versions.items()):
            log.warning("megaegg backend: a parameter changed since compiling; running this call eagerly")
            return gm.forward(*args)
        out = run(*(args[k] for k in kept))
        return out if isinstance(out, tuple) else (out,)

    return call


def register() -> None:
    """Make ``backend="megaegg"`` known to torch.compile where megaegg is not installed (once)."""
    from torch._dynamo import list_backends, register_backend

    if "megaegg" not in list_backends(exclude_tags=()):
        register_backend(megaegg_backend, name="megaegg")

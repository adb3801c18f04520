"""From PyTorch: a function or ``nn.Module`` through ``torch.export`` into one megakernel.

    import torch, megaegg
    n = torch.export.Dim("n", min=1, max=1024)
    run = megaegg.from_torch(model, (ids,), dynamic_shapes=({0: n},), backend="sim")
    out = run(ids)                      # as model(ids) returns it

``export.py`` walks the exported program (weights, inputs, runtime dims, outputs); ``aten.py`` is the table
of ATen ops it translates. docs/frontend.md lists them and says how to add one.
"""

from __future__ import annotations

import re
import types
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_unflatten

from ..graph import GraphError
from .aten import ATEN, UnsupportedTorch
from .export import InputSpec, Translator, dim_names, export_program

__all__ = ["from_torch", "TorchKernel", "UnsupportedTorch", "ATEN"]


class TorchKernel:
    """The compiled program, called as the module was: ``run(*args)`` returns what it returned (a tensor, a
    tuple, a dict: the export's output structure). ``kernel``: the megaegg :class:`~megaegg.Kernel`;
    ``graph``: its Graph."""

    def __init__(self, kernel, graph, inputs: Sequence[InputSpec], outputs: Sequence[str], out_spec):
        self.kernel, self.graph = kernel, graph
        self.inputs, self.outputs, self.out_spec = list(inputs), list(outputs), out_spec

    def __call__(self, *args: torch.Tensor):
        tensors, dims = self._named(args)
        out = self.kernel(**tensors, **dims)
        return tree_unflatten([out[name] for name in self.outputs], self.out_spec)

    def launcher(self, *args: torch.Tensor):
        """The call ``run(*args)`` checked once: a :class:`megaegg.compiler.Launcher` that launches it again
        and again (for benchmarks; the outputs land in the kernel's buffers, unread)."""
        tensors, dims = self._named(args)
        return self.kernel.launcher(**tensors, **dims)

    def _named(self, args) -> tuple[dict, dict]:
        """The kernel's named inputs and runtime dims of the module's positional arguments, checked."""
        if len(args) != len(self.inputs):
            raise TypeError(f"expected {len(self.inputs)} tensor argument(s) ({', '.join(i.name for i in self.inputs)}), "
                            f"got {len(args)}")
        tensors, dims = {}, {}
        for spec, a in zip(self.inputs, args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"argument {spec.name}: expected a tensor, got {type(a).__name__}")
            if a.dtype != spec.dtype:
                raise TypeError(f"argument {spec.name}: dtype {a.dtype}, exported with {spec.dtype}")
            if a.ndim != len(spec.axes):
                raise TypeError(f"argument {spec.name}: {a.ndim} dims, exported with {len(spec.axes)}")
            for axis, name in enumerate(spec.axes):
                if name is None:
                    continue
                if dims.setdefault(name, int(a.shape[axis])) != int(a.shape[axis]):
                    raise TypeError(f"argument {spec.name}: axis {axis} is {a.shape[axis]}, but dim {name!r} "
                                    f"is {dims[name]} in another argument")
            tensors[spec.name] = a.to(torch.int32) if a.dtype == torch.int64 else a
        return tensors, dims


def from_torch(fn_or_module: Any, example_args: Sequence, *, dynamic_shapes: Any = None, backend: str | None = None,
               max_dims: Mapping[str, int] | None = None, dims_hint: Mapping[str, int] | None = None,
               device=None) -> TorchKernel:
    """Export ``fn_or_module`` with ``torch.export`` at ``example_args`` (each dynamic axis a
    ``torch.export.Dim`` in ``dynamic_shapes``, whose name the runtime dim takes), translate its ATen graph
    into a megaegg Graph (parameters, buffers and constants as weights), compile it (``megaegg.compile``:
    ``backend``, ``max_dims`` (default: the Dims' max), ``dims_hint``, ``device``) and return it as a
    callable. An op, dtype or construct it cannot take raises :class:`UnsupportedTorch` naming it and the
    source line it came from."""
    example_args = tuple(example_args)
    if isinstance(fn_or_module, torch.nn.Module):
        module, name, export_shapes = fn_or_module, type(fn_or_module).__name__, dynamic_shapes
    else:  # a function: a module whose forward it is (its parameters, names and source lines are the function's)
        module, name, export_shapes = _FunctionModule(fn_or_module), getattr(fn_or_module, "__name__", "fn").strip("<>"), dynamic_shapes
    ep = export_program(module, example_args, export_shapes)
    return compile_exported(ep, dim_names(ep, dynamic_shapes), name=name, backend=backend, max_dims=max_dims,
                            dims_hint=dims_hint, device=device)


def compile_exported(ep, names: Mapping, *, name: str, bound: Mapping[str, torch.Tensor] | None = None,
                     backend: str | None = None, max_dims: Mapping[str, int] | None = None,
                     dims_hint: Mapping[str, int] | None = None, device=None) -> TorchKernel:
    """An exported program compiled (``names``: its symbols' runtime dim names; ``bound``: user inputs taken
    as weights, the torch.compile backend's parameters)."""
    from ..compiler import compile as compile_graph

    t = Translator(ep, names, name=name, bound=bound)
    try:
        kernel = compile_graph(t.graph, t.weights, backend=backend, max_dims={**t.max_dims(), **dict(max_dims or {})},
                               dims_hint=dims_hint, device=device)
    except GraphError as e:  # an op the megakernel has no block op for: say where in the caller's code it came from
        m = re.search(r"%(\d+)\(", str(e))
        where = t.sources.get(int(m.group(1))) if m else None
        if where is None:
            raise
        raise type(e)(f"{e} (from {where})") from None
    return TorchKernel(kernel, t.graph, t.inputs, t.outputs, ep.call_spec.out_spec)


class _FunctionModule(torch.nn.Module):
    """A plain function as a module (torch.export takes modules): the function is its forward, renamed
    so: torch.export records source lines (``meta["stack_trace"]``) only in frames of functions named
    forward, and the errors name the caller's line."""

    def __init__(self, fn):
        super().__init__()
        code = getattr(fn, "__code__", None)
        if code is not None:
            fn = types.FunctionType(code.replace(co_name="forward"), fn.__globals__, "forward", fn.__defaults__,
                                    fn.__closure__)
        self.forward = fn

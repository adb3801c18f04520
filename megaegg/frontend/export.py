"""An exported PyTorch program as a megaegg Graph, and the callable that runs its kernel.

``torch.export`` gives an ATen graph whose placeholders are the module's parameters, buffers, lifted
constants and user inputs (``graph_signature``), with a fake tensor (``meta["val"]``: shape, dtype) and
the source line (``meta["stack_trace"]``) on every node. Parameters, buffers and constants become
weights (bound at compile time), user inputs graph inputs, and each symbolic size a runtime dim named
after the ``torch.export.Dim`` the caller gave for it; ``aten.py`` translates each op.
"""

from __future__ import annotations

import operator
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..dims import Dim, sym
from ..graph import Graph, GraphError
from ..graph import Tensor as GraphTensor
from .aten import ATEN, UnsupportedTorch, dtype_of


@dataclass(frozen=True)
class InputSpec:
    """A user input: its graph name, dtype, and the runtime dim (if any) of each axis."""

    name: str
    dtype: torch.dtype
    axes: tuple[str | None, ...]


def source_line(node) -> str:
    """The innermost frame of ``node``'s stack trace in the caller's code (not torch's, not this
    package's) as "file:line: code", or the node's name."""
    skip = (str(Path(__file__).parent), str(Path(torch.__file__).parent))
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or "")
    mine = [f for f in frames if not f[0].startswith(skip)]
    if not mine:
        return f"node {node.name}"
    file, line, code = mine[-1]
    return f"{file}:{line}: {code.strip()}"


class Translator:
    """One exported program into a Graph: ``graph``, ``weights`` (name -> tensor), ``inputs`` (user
    inputs in call order), ``outputs`` (graph output names in return order), ``max_dims``."""

    def __init__(self, ep: torch.export.ExportedProgram, dim_names: Mapping[Any, str], name: str,
                 bound: Mapping[str, torch.Tensor] | None = None):
        """``bound``: user inputs (by placeholder name) to take as weights with these values (the
        parameters a torch.compile graph receives as inputs)."""
        self.ep, self.dim_names, self.bound = ep, dict(dim_names), dict(bound or {})
        self.graph = Graph(name)
        self.weights: dict[str, torch.Tensor] = {}
        self.inputs: list[InputSpec] = []
        self.outputs: list[str] = []
        self.env: dict[str, Any] = {}
        self.sources: dict[int, str] = {}  # graph node id -> the ATen op and source line it came from
        self.values: dict[str, torch.Tensor] = {}  # constants (weights, folded ops) by node name, as torch has them
        sig = ep.graph_signature
        self.constants = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                          **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
        if sig.buffers_to_mutate:
            raise UnsupportedTorch(f"the program mutates buffers ({', '.join(sorted(sig.buffers_to_mutate.values()))}): "
                                   "in-place state (a KV cache) is not supported yet")
        live = _live(ep.graph)  # (what no output needs is never translated: transformers' mask preparation)
        for node in live:  # (before any op's own error: the state is what the caller must change)
            schema = getattr(node.target, "_schema", None)
            if node.op == "call_function" and schema is not None and schema.is_mutable:
                raise UnsupportedTorch(f"{node.target} mutates its input ({source_line(node)}): in-place state "
                                       "(a KV cache, a buffer) is not supported yet")
        for node in ep.graph.nodes:
            if node.op != "call_function" or node in live:
                self._visit(node)

    def dim(self, size) -> Dim | int:
        """A size of a fake tensor as a megaegg dim: an int, or an expression of named runtime dims."""
        if isinstance(size, int):
            return size
        return self._expr(size.node.expr)

    def _expr(self, e):
        import sympy

        if isinstance(e, sympy.Integer):
            return int(e)
        if isinstance(e, sympy.Symbol):
            if e not in self.dim_names:
                raise UnsupportedTorch(f"symbolic size {e} has no torch.export.Dim of the caller's (give every "
                                       "dynamic axis one in dynamic_shapes)")
            return sym(self.dim_names[e])
        if isinstance(e, (sympy.Add, sympy.Mul)):
            parts = [self._expr(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = out + p if isinstance(e, sympy.Add) else out * p
            return out
        raise UnsupportedTorch(f"symbolic size {e} is not a sum or product of runtime dims")

    def shape(self, node) -> list:
        return [self.dim(s) for s in node.meta["val"].shape]

    def _visit(self, node) -> None:
        if node.op == "placeholder":
            self._placeholder(node)
        elif node.op == "call_function":
            self._call(node)
        elif node.op == "output":
            for k, v in enumerate(node.args[0]):
                if not isinstance(v, torch.fx.Node) or not isinstance(self.env.get(v.name), GraphTensor):
                    raise UnsupportedTorch(f"output {k} is not a tensor the graph computes ({v!r})")
                name = f"out{k}"
                self.graph.output(name, self.env[v.name])
                self.outputs.append(name)
        else:
            raise UnsupportedTorch(f"{node.op} node {node.name} is not supported ({source_line(node)})")

    def _placeholder(self, node) -> None:
        val = node.meta["val"]
        if node.name in self.constants or node.name in self.bound:
            target = self.constants.get(node.name, node.name)
            value = self.bound[node.name] if node.name in self.bound else self._constant(target)
            self._weight(node.name, value.detach(), f"weight {target}")
            return
        if not isinstance(val, torch.Tensor):
            raise UnsupportedTorch(f"input {node.name}: only tensor inputs are supported, got {type(val).__name__}")
        shape = self.shape(node)
        axes = tuple(str(d.args[0]) if isinstance(d, Dim) and d.op == "sym" else None for d in shape)
        if any(isinstance(d, Dim) and d.op != "sym" for d in shape):
            raise UnsupportedTorch(f"input {node.name}: each dynamic axis must be its own torch.export.Dim")
        self.inputs.append(InputSpec(node.name, val.dtype, axes))
        self.env[node.name] = self.graph.input(node.name, shape, dtype_of(val.dtype, f"input {node.name}"))

    def _weight(self, name: str, value: torch.Tensor, what: str) -> None:
        dt = dtype_of(value.dtype, what)
        self.values[name] = value  # (as torch has it: what a folded op computes from)
        self.weights[name] = value if value.dtype != torch.int64 else value.to(torch.int32)
        self.env[name] = self.graph.weight(name, list(value.shape), dt)

    def _fold(self, node) -> bool:
        """An op of constants only (Gemma's ``1 + weight.float()``): computed here, once, as a new weight
        (its value needs no kernel); False where it reads an input, its result's size is a runtime one, or
        it is larger than its largest operand (a broadcast: the op stays, no big weight is made)."""
        ins = node.all_input_nodes
        val = node.meta.get("val")
        if not ins or any(n.name not in self.values for n in ins) or not isinstance(val, torch.Tensor) or \
                any(isinstance(d, torch.SymInt) for d in val.shape) or not str(node.target).startswith("aten."):
            return False
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return False
        if val.numel() > max(self.values[n.name].numel() for n in ins):  # (no broadcast materialised as a weight)
            return False
        const = lambda a: self.values[a.name] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        args = torch.fx.node.map_aggregate(node.args, const)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, const)
        with torch.no_grad():
            out = node.target(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return False
        self._weight(node.name, out, f"{node.target} of constants ({source_line(node)})")
        return True

    def _constant(self, target: str) -> torch.Tensor:
        ep = self.ep
        if target in ep.state_dict:
            return ep.state_dict[target]
        if target in getattr(ep, "constants", {}):
            return ep.constants[target]
        raise UnsupportedTorch(f"constant {target} has no value in the exported program")

    def _call(self, node) -> None:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            # a size computed from sizes (aten.sym_size, arithmetic on them): no op, its value is the export's
            # own expression of it in runtime dims (the ops that take sizes read their result's shape anyway)
            self.env[node.name] = self.dim(val)
            return
        if self._fold(node):
            return
        if node.target is operator.getitem:  # one piece of a multi-output op (a split)
            self.env[node.name] = self._arg(node.args[0])[node.args[1]]
            return
        first = len(self.graph.nodes)
        key = str(node.target)
        entry = ATEN.get(key)
        if entry is None:
            raise UnsupportedTorch(f"{key} is not supported ({source_line(node)}); the supported ATen ops are in "
                                   "megaegg/frontend/aten.py (docs/frontend.md)")
        args = [self._arg(a) for a in node.args]
        kwargs = {k: self._arg(v) for k, v in node.kwargs.items()}
        try:
            out = entry(self, node, args, kwargs)
        except (UnsupportedTorch, GraphError) as e:
            raise UnsupportedTorch(f"{key}: {e} ({source_line(node)})") from None
        self.env[node.name] = out
        for i in range(first, len(self.graph.nodes)):  # the graph nodes this ATen op made: its source line
            self.sources[i] = f"{key} at {source_line(node)}"

    def _arg(self, a):
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, torch.SymInt):
            return self.dim(a)
        return a

    def max_dims(self) -> dict[str, int]:
        """Each runtime dim's upper bound from the export's range constraints (where finite)."""
        out = {}
        for s, name in self.dim_names.items():
            r = self.ep.range_constraints.get(s)
            upper = getattr(r, "upper", None) if r is not None else None
            if upper is None or getattr(upper, "is_finite", True) is False:  # (unbounded: sympy's oo, torch's int_oo)
                continue
            try:
                out[name] = int(upper)
            except (TypeError, ValueError, OverflowError, AttributeError):
                continue
        return out


def _live(graph) -> set:
    """The nodes the output depends on."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    live, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


def export_program(module, args: tuple, dynamic_shapes=None):
    """``torch.export.export(module, args, dynamic_shapes=...)`` under no_grad, with torch's report of the
    solved dim constraints made robust (``_plain_constraint_report``)."""
    with torch.no_grad(), _plain_constraint_report():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)


@contextmanager
def _plain_constraint_report():
    """torch.export formats its solved dim constraints (``DimConstraints.prettify_results``) after every
    export, but reads the text only to word a violated constraint's error. Some torch releases (2.11) raise
    ValueError there on a result it cannot split into "lhs op rhs" (a CUDA export of a transformers model
    hit it), failing an export that has no violation: such a report is given as the results, unformatted."""
    from torch.fx.experimental.symbolic_shapes import DimConstraints

    pretty = DimConstraints.prettify_results

    def report(self, *args, **kwargs):
        try:
            return pretty(self, *args, **kwargs)
        except ValueError:
            results = sorted(map(str, self._static_results | self._dynamic_results))
            return "\nSolved dim constraints:\n" + "\n".join(f"  {r}" for r in results)

    DimConstraints.prettify_results = report
    try:
        yield
    finally:
        DimConstraints.prettify_results = pretty


def dim_names(ep, dynamic_shapes) -> dict:
    """sympy symbol -> the name of the caller's ``torch.export.Dim`` for it (``dynamic_shapes``: one spec a
    user input, in order, or by input name)."""
    if dynamic_shapes is None:
        return {}
    specs = list(dynamic_shapes.values()) if isinstance(dynamic_shapes, Mapping) else list(dynamic_shapes)
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    out = {}
    for node, spec in zip(users, specs):
        if not spec:
            continue
        items = spec.items() if isinstance(spec, Mapping) else enumerate(spec)
        for axis, d in items:
            if d is None:
                continue
            size = node.meta["val"].shape[axis]
            if isinstance(size, torch.SymInt):
                out[size.node.expr] = getattr(d, "__name__", str(d))
    return out

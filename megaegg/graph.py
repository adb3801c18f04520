"""The tensor graph users build: nodes in SSA order, symbolic shapes, named leaves.

>>> import megaegg as me
>>> g = me.Graph()
>>> x = g.input("x", [1, 64], me.f32)
>>> w = g.weight("w", [32, 64], me.f32)
>>> y = g.output("y", me.silu(me.linear(x, w)))
>>> y.shape
(Dim(1), Dim(32))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .dims import Dim, DimLike, as_dim, fmt_shape
from .dtypes import DType, as_dtype, bf16

LEAF_OPS = ("input", "weight", "constant")
# ops that write into their first input (a KV cache) in place: their value is that input, updated
IN_PLACE_OPS = ("kv_append", "kv_store")
# ops across the ranks of a tensor-parallel group (attr ``ranks``)
COLLECTIVES = ("all_reduce", "all_gather")


class GraphError(ValueError):
    """A graph that cannot be built or run as asked: the message names the op and tensors."""


class ShapeError(GraphError):
    """Operand shapes or dtypes do not fit the op."""


def check_static_dims(what: str, shape: Sequence[DimLike], skip: Iterable[int] = ()) -> None:
    """Static dims must be >= 1: a 0 or negative one would only fail deep inside compile or at run time.
    ``skip``: indices exempt from the check (reshape's -1)."""
    skip = set(skip)
    for i, d in enumerate(shape):
        d = as_dim(d)
        if i not in skip and d.is_const and d.value < 1:
            raise ShapeError(f"{what}: dim {i} of shape {fmt_shape(shape)} is {d.value}; static dims must be >= 1")


def leaf_shape(what: str, shape) -> tuple[Dim, ...]:
    """A leaf's shape as dims; not a sequence of ints and dims (``g.input("x", 4)``): a ShapeError naming ``what``."""
    try:
        return tuple(as_dim(d) for d in shape)
    except TypeError:  # (an int is not iterable; a float or str dim is not a dim)
        raise ShapeError(f"{what}: shape must be a list of ints and dims (me.sym), got {shape!r}") from None


@dataclass(frozen=True, eq=False)
class Node:
    """One op of the graph. ``inputs`` are ids of earlier nodes (SSA order)."""

    id: int
    op: str
    inputs: tuple[int, ...]
    shape: tuple[Dim, ...]
    dtype: DType
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str | None = None

    @property
    def label(self) -> str:
        """How errors and printouts name this tensor."""
        return repr(self.name) if self.name else f"%{self.id}({self.op})"

    def __str__(self) -> str:
        args = ", ".join(f"%{i}" for i in self.inputs)
        extra = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in self.attrs.items() if k != "value")
        parts = ", ".join(p for p in (args, extra) if p)
        nm = f" {self.name!r}" if self.name else ""
        return f"%{self.id} = {self.op}{nm}({parts}) : {self.dtype}{fmt_shape(self.shape)}"


def _fmt_attr(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt_attr(x) for x in v) + ")"
    return str(v)


class Tensor:
    """A handle to a node's value while building a graph; supports ``+``, ``*``, ``@``."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: "Graph", id: int) -> None:
        self.graph = graph
        self.id = id

    @property
    def node(self) -> Node:
        return self.graph.nodes[self.id]

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.node.shape

    @property
    def dtype(self) -> DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.node.label}: {self.dtype}{fmt_shape(self.shape)})"

    def __add__(self, other: "Tensor") -> "Tensor":
        from .ops import add

        return add(self, other)

    def __mul__(self, other: "Tensor") -> "Tensor":
        from .ops import mul

        return mul(self, other)

    def __matmul__(self, other: "Tensor") -> "Tensor":
        from .ops import matmul

        return matmul(self, other)

    def reshape(self, *shape) -> "Tensor":
        from .ops import reshape

        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape)

    def transpose(self, d0: int, d1: int) -> "Tensor":
        from .ops import transpose

        return transpose(self, d0, d1)


class Graph:
    """A forward pass as a list of ops over symbolic shapes.

    Leaves are ``input`` (given per call, e.g. token ids or a KV cache), ``weight``
    (bound once at compile time) and ``constant`` (a tensor fixed at build time).
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.outputs: dict[str, int] = {}
        self._leaf_names: dict[str, int] = {}

    # --- leaves ----------------------------------------------------------------
    def input(self, name: str, shape: Sequence[DimLike], dtype=bf16) -> Tensor:
        """A per-call input. A KV cache is an input that ``kv_append`` updates in place."""
        return self._leaf("input", name, shape, dtype)

    def weight(self, name: str, shape: Sequence[DimLike], dtype=bf16) -> Tensor:
        """A parameter bound once when the graph is compiled."""
        shape = leaf_shape(f"weight {name!r}", shape)
        for d in shape:
            if not d.is_const:
                raise ShapeError(f"weight {name!r}: shape {fmt_shape(shape)} must be concrete, not symbolic")
        return self._leaf("weight", name, shape, dtype)

    def constant(self, name: str, value) -> Tensor:
        """A tensor known when the graph is built (e.g. RoPE inverse frequencies)."""
        import torch

        value = torch.as_tensor(value).detach().cpu().contiguous()
        from .dtypes import from_torch

        return self._leaf("constant", name, tuple(value.shape), from_torch(value.dtype), value=value)

    def _leaf(self, op: str, name: str, shape, dtype, **attrs) -> Tensor:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{op}: name must be a non-empty string, got {name!r}")
        if name in self._leaf_names:
            raise GraphError(f"{op} {name!r}: a leaf with this name already exists")
        shape = leaf_shape(f"{op} {name!r}", shape)
        check_static_dims(f"{op} {name!r}", shape)
        t = self.add_node(op, (), shape, as_dtype(dtype), attrs, name=name)
        self._leaf_names[name] = t.id
        return t

    # --- outputs ----------------------------------------------------------------
    def output(self, name: str, tensor: Tensor) -> Tensor:
        self.check_owned("output", tensor)
        if name in self.outputs:
            raise GraphError(f"output {name!r} is already defined")
        self.outputs[name] = tensor.id
        return tensor

    # --- building ---------------------------------------------------------------
    def add_node(self, op: str, inputs: Iterable[int], shape, dtype: DType, attrs=None, name=None) -> Tensor:
        node = Node(len(self.nodes), op, tuple(inputs), tuple(as_dim(d) for d in shape), dtype, dict(attrs or {}), name)
        self.nodes.append(node)
        return Tensor(self, node.id)

    def check_owned(self, op: str, *tensors: Tensor) -> None:
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__}")
            if t.graph is not self:
                raise GraphError(f"{op}: tensor {t.node.label} belongs to another graph")

    # --- queries ----------------------------------------------------------------
    def leaves(self, op: str) -> dict[str, Node]:
        return {n.name: n for n in self.nodes if n.op == op}

    @property
    def inputs(self) -> dict[str, Node]:
        return self.leaves("input")

    @property
    def weights(self) -> dict[str, Node]:
        return self.leaves("weight")

    def symbols(self) -> set[str]:
        """Names of the runtime dims used anywhere in the graph."""
        out: set[str] = set()
        for n in self.nodes:
            for d in n.shape:
                out |= d.symbols()
            for v in n.attrs.values():
                if isinstance(v, Dim):
                    out |= v.symbols()
                elif isinstance(v, tuple):
                    for x in v:
                        if isinstance(x, Dim):
                            out |= x.symbols()
        return out

    def live_nodes(self) -> set[int]:
        """Ids of the nodes the outputs depend on."""
        live, stack = set(), list(self.outputs.values())
        while stack:
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack.extend(self.nodes[i].inputs)
        return live

    def __str__(self) -> str:
        lines = [f"graph {self.name}:"]
        lines += [f"  {n}" for n in self.nodes]
        lines += [f"  output {k!r} = %{v}" for k, v in self.outputs.items()]
        return "\n".join(lines)

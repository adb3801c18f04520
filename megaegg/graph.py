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
from typing import Any, Callable, Iterable, Mapping, Sequence

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


# the most bytes a tensor may declare (its static dims' product): 2**62 keeps every byte offset an int64
MAX_TENSOR_BYTES = 2**62


def check_size(what: str, shape: Sequence[Dim], dtype: DType) -> None:
    """A tensor whose static dims alone make more than MAX_TENSOR_BYTES: a ShapeError naming it and its size."""
    n = dtype.itemsize
    for d in shape:
        if d.is_const and d.value > 0:
            n *= d.value
    if n > MAX_TENSOR_BYTES:
        raise ShapeError(f"{what}: {dtype}{fmt_shape(shape)} is {fmt_bytes(n)}; a tensor holds at most 2**62 bytes")


def fmt_bytes(n: int) -> str:
    """A size for people, in decimal units (as the CLI's GB): ``fmt_bytes(17_592_186_044_416) == '17.6 TB'``."""
    for unit, scale in (("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# Tensor's operators (+, *, @, .reshape, .transpose) by name: filled by megaegg/ops.py's @operator functions.
OPERATORS: dict[str, Callable[..., "Tensor"]] = {}

# The ops a graph may hold: the leaves and every op ``run_reference`` (and the compiler) knows
# (tests/test_graph.py checks this list against reference.py's evaluators).
OPS = frozenset({
    *LEAF_OPS, *COLLECTIVES, "add", "sub", "div", "neg", "argmax", "attention", "cast", "concat", "embedding", "expand", "kv_append",
    "kv_store", "linear", "matmul", "moe_mlp", "mul", "permute", "ragged_attention", "reshape", "rms_norm", "rope",
    "sample", "silu", "slice", "softmax", "sigmoid", "gelu", "tanh", "exp", "cos", "sin",
    "pow", "mean", "rsqrt", "add_scalar",  # (only inside a recognised pattern: ops.py)
})


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

    # The operators are megaegg.ops' functions, which register themselves in OPERATORS (ops.py builds
    # graph nodes, so it imports this module, not the other way round).
    def __add__(self, other: "Tensor") -> "Tensor":
        return OPERATORS["add"](self, other)

    def __mul__(self, other: "Tensor") -> "Tensor":
        return OPERATORS["mul"](self, other)

    def __sub__(self, other: "Tensor") -> "Tensor":
        return OPERATORS["sub"](self, other)

    def __truediv__(self, other: "Tensor") -> "Tensor":
        return OPERATORS["div"](self, other)

    def __neg__(self) -> "Tensor":
        return OPERATORS["neg"](self)

    def __matmul__(self, other: "Tensor") -> "Tensor":
        return OPERATORS["matmul"](self, other)

    def reshape(self, *shape) -> "Tensor":
        return OPERATORS["reshape"](self, shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape)

    def transpose(self, d0: int, d1: int) -> "Tensor":
        return OPERATORS["transpose"](self, d0, d1)


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
        t = self._append(op, (), shape, dtype, attrs, name, f"{op} {name!r}")
        self._leaf_names[name] = t.id
        return t

    # --- outputs ----------------------------------------------------------------
    def output(self, name: str, tensor: Tensor) -> Tensor:
        if not isinstance(name, str) or not name:
            raise GraphError(f"output: name must be a non-empty string, got {name!r}")
        self.check_owned("output", tensor)
        if name in self.outputs:
            raise GraphError(f"output {name!r} is already defined")
        self.outputs[name] = tensor.id
        return tensor

    # --- building ---------------------------------------------------------------
    def add_node(self, op: str, inputs: Iterable[int], shape, dtype: DType, attrs=None, name=None) -> Tensor:
        """The low-level node API (``megaegg.ops`` builds every op through it): appends node
        ``%len(nodes)`` reading the earlier nodes ``inputs``. A bad argument (an unknown op, an input
        id that is not an earlier node: dangling, negative, a forward reference or a cycle, a shape,
        dtype, attrs or name of the wrong type) is a GraphError naming the node and what is wrong."""
        nid = len(self.nodes)
        if not isinstance(op, str) or not op:
            raise GraphError(f"add_node %{nid}: op must be a non-empty string, got {op!r}")
        what = f"add_node %{nid} ({op})"
        if op in LEAF_OPS:
            raise GraphError(f"{what}: leaves are declared with graph.{op}(name, ...), not add_node")
        if op not in OPS:
            raise GraphError(f"{what}: unknown op {op!r}; known ops: {', '.join(sorted(OPS))}")
        try:
            ids = tuple(inputs)
        except TypeError:
            raise GraphError(f"{what}: inputs must be a sequence of node ids, got {inputs!r}") from None
        for i in ids:
            if isinstance(i, Tensor):
                raise GraphError(f"{what}: inputs are node ids (tensor.id), got the Tensor {i!r}")
            if isinstance(i, bool) or not isinstance(i, int):
                raise GraphError(f"{what}: input {i!r} is not a node id (an int)")
            if not 0 <= i < nid:
                where = "the node itself (a cycle)" if i == nid else \
                    "a later node (a forward reference: nodes read only earlier nodes)" if i > nid else "negative"
                raise GraphError(f"{what}: input id {i} is {where}; "
                                 f"{f'nodes so far: %0..%{nid - 1}' if nid else 'the graph has no nodes yet'}")
        return self._append(op, ids, shape, dtype, attrs, name, what)

    def _append(self, op: str, ids: tuple[int, ...], shape, dtype, attrs, name, what: str) -> Tensor:
        if attrs is not None and not isinstance(attrs, Mapping):
            raise GraphError(f"{what}: attrs must be a dict, got {type(attrs).__name__}")
        if name is not None and not isinstance(name, str):
            raise GraphError(f"{what}: name must be a string or None, got {name!r}")
        try:
            dims = tuple(as_dim(d) for d in shape)
        except TypeError:
            raise ShapeError(f"{what}: shape must be a list of ints and dims (me.sym), got {shape!r}") from None
        try:
            dtype = as_dtype(dtype)
        except TypeError as e:
            raise GraphError(f"{what}: {e}") from None
        check_size(what if name is None else f"{op} {name!r}", dims, dtype)
        node = Node(len(self.nodes), op, ids, dims, dtype, dict(attrs or {}), name)
        self.nodes.append(node)
        return Tensor(self, node.id)

    def check(self) -> None:
        """The node list is a graph: ids in order, every input an earlier node, outputs existing nodes
        (``nodes`` is a plain list: an edited one would otherwise fail deep inside compile)."""
        for i, n in enumerate(self.nodes):
            if not isinstance(n, Node) or n.id != i:
                raise GraphError(f"graph {self.name!r}: nodes[{i}] is {n!r}, not node %{i} (edit graphs through add_node)")
            bad = [j for j in n.inputs if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < i]
            if bad:
                raise GraphError(f"graph {self.name!r}: node {n.label} reads {bad[0]!r}, which is not an earlier node "
                                 "(dangling, or a cycle)")
        for name, i in self.outputs.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.nodes):
                raise GraphError(f"graph {self.name!r}: output {name!r} is {i!r}, not a node of the graph")

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

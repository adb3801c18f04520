"""Chosen alternatives -> BlockProgram: buffers, operands (buffer + views), block ops.

Each chosen alternative's term (``megaegg/blockops``) lowers itself through a
:class:`ProgramBuilder`, which owns buffers and operands; the kinds' ``build`` gives grids
and footprints. Operands whose view chain has no strided layout are materialised by an
inserted copy.
"""

from __future__ import annotations

from ..blockops import REGISTRY, TERMS, materialize
from ..dims import Dim, as_dim, dmax, fmt_shape
from ..dtypes import f32
from ..graph import COLLECTIVES, IN_PLACE_OPS, LEAF_OPS, Graph, GraphError, Node
from .encode import VIEW_OPS, base_node
from .extract import Choice, order
from ..ir.layout import layout_of, view_shape
from ..ir.program import BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, View, swap_last


def _graph_view(n: Node) -> View:
    a = n.attrs
    if n.op == "reshape":
        return View("reshape", tuple(a["shape"]))
    if n.op == "permute":
        return View("permute", tuple(a["dims"]))
    if n.op == "slice":
        return View("slice", (a["dim"], a["start"], a["stop"]))
    return View("expand", tuple(a["shape"]))


class ProgramBuilder:
    """Accumulates buffers and block ops while the chosen terms lower themselves in order.

    The terms' ``lower`` use its operand helpers (``operand``, ``rows``, ``view``, ``output``,
    ``sum``, ``keep_sum``, ``cache_row``, ``transposed_weight``, ``scratch``) and ``emit``.
    """

    def __init__(self, graph: Graph, env_hint: dict[str, int]) -> None:
        self.graph = graph
        self.env_hint = env_hint
        self.buffers: list[Buffer] = []
        self.buffer_of: dict[int, int] = {}
        self.sum_of: dict[int, int] = {}  # Sum node -> its accum buffer
        self.kept_sums: dict[int, Operand] = {}  # Sum node -> the operand its producer keeps it in (keep_sum)
        self.transposed_of: dict[int, int] = {}  # weight node -> its transposed copy's buffer
        self.ops: list[BlockOp] = []
        # inputs that an in-place op (kv_append, kv_store) updates
        self.state = {base_node(graph, n.inputs[0]) for n in graph.nodes if n.op in IN_PLACE_OPS}

    # --- buffers and operands ----------------------------------------------------------
    def new_buffer(self, name: str, kind: str, shape, dtype, *, transposed: bool = False) -> int:
        self.buffers.append(Buffer(len(self.buffers), name, kind, tuple(as_dim(d) for d in shape), dtype, transposed))
        return len(self.buffers) - 1

    def whole(self, name: str, kind: str, shape, dtype) -> Operand:
        """A new buffer of ``kind``, seen whole."""
        shape = tuple(as_dim(d) for d in shape)
        return Operand(self.new_buffer(name, kind, shape, dtype), shape, dtype)

    def scratch(self, name: str, shape, dtype) -> Operand:
        """A new intermediate buffer (partials of a split op)."""
        return self.whole(name, "scratch", shape, dtype)

    def accum(self, name: str, shape, dtype) -> Operand:
        """A new ``accum`` buffer: in the counter bank, zero at every launch (sums, arrival counters)."""
        return self.whole(name, "accum", shape, dtype)

    def peer(self, name: str, shape, dtype) -> Operand:
        """A new ``peer`` buffer: every rank of the tensor-parallel group holds one and writes its row into all."""
        return self.whole(name, "peer", shape, dtype)

    def buffer(self, i: int) -> int:
        """Buffer holding base node ``i`` (created on first use)."""
        if i not in self.buffer_of:
            n = self.graph.nodes[i]
            if n.op in IN_PLACE_OPS:  # writes its cache in place
                self.buffer_of[i] = self.buffer(base_node(self.graph, n.inputs[0]))
            else:
                kind = n.op if n.op in LEAF_OPS else "scratch"
                if kind == "input" and i in self.state:
                    kind = "state"
                self.buffer_of[i] = self.new_buffer(n.name or f"t{i}", kind, n.shape, n.dtype)
        return self.buffer_of[i]

    def sum(self, node: int) -> Operand:
        """The f32 sum whose rounding is node ``node``'s value, as ``[rows, N]`` (an ``accum``
        buffer: zero at every launch, added into by its producer's instances)."""
        if node in self.kept_sums:
            return self.kept_sums[node]
        n = self.graph.nodes[node]
        shape = (numel(n.shape[:-1]), n.shape[-1])
        if node not in self.sum_of:
            self.sum_of[node] = self.new_buffer(f"mlp_acc{node}", "accum", shape, f32)
        return Operand(self.sum_of[node], shape, f32)

    def keep_sum(self, node: int, o: Operand) -> None:
        """Node ``node``'s f32 sum is ``o``, ``[rows, N]`` in a buffer its producer zeroes itself (``moe_route``:
        the rows of a runtime row count), not an ``accum`` buffer of the counter bank, which every launch zeroes
        whole at its largest size."""
        self.kept_sums[node] = o

    def transposed_weight(self, i: int) -> Operand:
        """Weight node ``i`` ``[..., N, F]`` as a ``[..., F, N]`` buffer, transposed once when weights are bound."""
        n = self.graph.nodes[i]
        if i not in self.transposed_of:
            self.transposed_of[i] = self.new_buffer(n.name, "weight", swap_last(n.shape), n.dtype, transposed=True)
        buf = self.buffers[self.transposed_of[i]]
        return Operand(buf.id, buf.shape, buf.dtype)

    def operand(self, ref: int) -> Operand:
        """Node ``ref``'s value: its storage seen through the graph's views."""
        chain = []
        i = ref
        while self.graph.nodes[i].op in VIEW_OPS:
            chain.append(_graph_view(self.graph.nodes[i]))
            i = self.graph.nodes[i].inputs[0]
        base = self.graph.nodes[i]
        o = Operand(self.buffer(i), base.shape, base.dtype)
        for v in reversed(chain):
            o = self.view(o, v.kind, v.args)
        return o

    def output(self, node: int) -> Operand:
        n = self.graph.nodes[node]
        return Operand(self.buffer(n.id), n.shape, n.dtype)

    def cache_row(self, append: int) -> Operand:
        """The KV cache row that ``kv_append`` node ``append`` writes, seen as ``[Hkv, D]``."""
        a = self.graph.nodes[append]
        row = self.view(self.operand(append), "slice", (1, a.attrs["pos"], a.attrs["pos"] + 1))
        return self.view(row, "reshape", (a.shape[0], a.shape[2]))

    @staticmethod
    def view(o: Operand, kind: str, args: tuple) -> Operand:
        v = View(kind, tuple(args))
        return Operand(o.buffer, view_shape(o.shape, v), o.dtype, o.views + (v,))

    def merged(self, operands: list[Operand], most: int) -> list[Operand] | None:
        """``operands`` (of one shape) seen with adjacent dims merged until at most ``most`` remain,
        a pair where every operand's layout steps over it as one dim; None if no such pair is left."""
        while len(operands[0].shape) > most:
            shape = operands[0].shape
            for i in range(len(shape) - 1):
                new = shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :]
                views = [self.view(o, "reshape", new) for o in operands]
                if all(layout_of(self.buffers[v.buffer].shape, v.views) is not None for v in views):
                    operands = views
                    break
            else:
                return None
        return operands

    def rows(self, o: Operand) -> Operand:
        """View ``[..., D]`` as ``[rows, D]``."""
        if len(o.shape) == 2:
            return o
        return self.view(o, "reshape", (numel(o.shape[:-1]), o.shape[-1]))

    def flat(self, o: Operand) -> Operand:
        """View as 1-D."""
        return o if len(o.shape) == 1 else self.view(o, "reshape", (numel(o.shape),))

    def adjacent(self, o: Operand) -> Operand:
        """``o`` as 1-D elements one after another (a body that takes a bare pointer, RoPE's frequencies): itself
        when its view already is, else a contiguous copy."""
        o = self.flat(o)
        lay = layout_of(self.buffers[o.buffer].shape, o.views)
        if lay is not None and lay.stride[0].is_const and lay.stride[0].value == 1:
            return o
        dst = self.scratch(f"copy{len(self.buffers)}", o.shape, o.dtype)
        materialize(self, self.strided(o, []), dst, [])
        return dst

    def broadcast(self, o: Operand, shape: tuple[Dim, ...]) -> Operand:
        if len(o.shape) < len(shape):
            o = self.view(o, "reshape", (as_dim(1),) * (len(shape) - len(o.shape)) + o.shape)
        if o.shape != shape:
            o = self.view(o, "expand", shape)
        return o

    def absorbed(self, i: int, refs) -> list[int]:
        """Graph nodes a fused op computes: ``i`` and its producers up to the operands it reads."""
        seen, stack = set(), [i]
        while stack:
            j = stack.pop()
            if j in seen or j in refs or self.graph.nodes[j].op in LEAF_OPS:
                continue
            seen.add(j)
            stack.extend(self.graph.nodes[j].inputs)
        return sorted(seen)

    # --- ops -----------------------------------------------------------------------------
    def emit(self, kind: str, sources, inputs, output: Operand, params: dict) -> BlockOp:
        inputs = [self.strided(o, sources) for o in inputs]
        if layout_of(self.buffers[output.buffer].shape, output.views) is None:
            raise GraphError(f"{kind}: cannot write through view chain {output} (no strided layout)")
        part = REGISTRY[kind].build(inputs, output, params)
        op = BlockOp(id=len(self.ops), kind=kind, sources=tuple(sources), inputs=tuple(inputs), output=output,
                     grid=part.grid, reads=part.reads, writes=part.writes, params=params)
        op.estimate = self.estimate(op)
        self.ops.append(op)
        return op

    def estimate(self, op: BlockOp) -> Estimate:
        env = dict(self.env_hint)
        nbytes = REGISTRY[op.kind].bytes_moved(op, env)
        inst = op.launch_count.eval(env) if op.grid else 1
        kind = REGISTRY[op.kind]
        return Estimate(bytes=nbytes, instances=inst, flops=kind.flops(op, env), steps=kind.pipeline_steps(op, env),
                        hops=kind.hops(op, env))

    def strided(self, o: Operand, sources) -> Operand:
        """``o`` itself if its views have a strided layout, else the views before the first reshape
        that has none copied into a contiguous buffer, and the rest of them applied to the copy
        (the copy reads through views that have a layout: copying ``o`` itself would recurse)."""
        base = self.buffers[o.buffer].shape
        if layout_of(base, o.views) is not None:
            return o
        k = next(k for k in range(len(o.views)) if layout_of(base, o.views[: k + 1]) is None)
        shape = base
        for v in o.views[:k]:
            shape = view_shape(shape, v)
        if layout_of(shape, o.views[k : k + 1]) is None:  # not even from contiguous storage
            raise GraphError(f"cannot view {self.buffers[o.buffer].name!r} {fmt_shape(shape)} as "
                             f"{fmt_shape(o.views[k].args)}: the element counts are not provably equal")
        dst = self.scratch(f"copy{len(self.buffers)}", shape, o.dtype)
        materialize(self, Operand(o.buffer, shape, o.dtype, o.views[:k]), dst, sources)
        for v in o.views[k:]:
            dst = self.view(dst, v.kind, v.args)
        return self.strided(dst, sources)

    def lower(self, c: Choice) -> None:
        TERMS[c.term].lower(self, c.value, c.named)


def numel(shape) -> Dim:
    total = as_dim(1)
    for d in shape:
        total = total * d
    return total


def check_in_place(graph: Graph) -> None:
    """A cache that ``kv_append`` / ``kv_store`` update in place has one copy in the kernel: its updates
    must form one chain, and no op built before an update may read it (the reference executor gives
    such a reader the old rows, which the kernel no longer holds)."""
    live = graph.live_nodes()
    root = {}  # in-place node or cache input -> the cache input (its storage)
    updates: dict[int, list[Node]] = {}  # cache input -> its in-place updates, in graph order
    for n in graph.nodes:
        if n.id not in live or n.op not in IN_PLACE_OPS:
            continue
        c = n.inputs[0]
        r = root[n.id] = root.get(c, c)
        chain = updates.setdefault(r, [])
        if c != (chain[-1].id if chain else r):
            raise GraphError(f"{n.op} {n.label}: updates cache {graph.nodes[r].label} that {chain[-1].op} {chain[-1].label} "
                             f"updates too; chain the updates (pass the tensor {chain[-1].op} returns)")
        chain.append(n)
    for n in graph.nodes:
        if n.id not in live or n.op in LEAF_OPS or n.op in VIEW_OPS:
            continue
        for k, i in enumerate(n.inputs):
            r = root.get(base_node(graph, i), base_node(graph, i))
            if k == 0 and n.op in IN_PLACE_OPS or r not in updates:
                continue
            later = next((u for u in updates[r] if u.id > n.id), None)
            if later is not None:
                raise GraphError(f"{n.op} {n.label}: reads cache {graph.nodes[r].label} before {later.op} {later.label} "
                                 f"updates it in place, and the kernel keeps no copy of the old rows; read it after the "
                                 f"update, through the tensor {later.op} returns")


def build_program(graph: Graph, chosen: dict, env_hint: dict[str, int]) -> BlockProgram:
    """Lower the chosen alternatives in topological order (a Sum just after its node's producers)."""
    check_in_place(graph)
    b = ProgramBuilder(graph, env_hint)
    for v in sorted(chosen, key=order):
        b.lower(chosen[v])
    outputs = {name: b.strided(b.operand(i), [i]) for name, i in graph.outputs.items()}  # (a view with no layout: a copy)
    ranks = {n.attrs["ranks"] for n in graph.nodes if n.op in COLLECTIVES}
    if len(ranks) > 1:
        raise GraphError(f"the collectives of one graph span different numbers of ranks: {sorted(ranks)}")
    live = graph.live_nodes()
    unused = tuple(sorted(n.name for n in graph.nodes if n.op in ("input", "weight") and n.id not in live))
    return BlockProgram(b.buffers, b.ops, outputs, tuple(sorted(graph.symbols())), range_checks(graph),
                        ranks=ranks.pop() if ranks else 1, unused_leaves=unused)


def range_checks(graph: Graph) -> tuple[RangeCheck, ...]:
    """The runtime bounds the reference executor enforces, for the host to check each call:
    attention reads ``length`` rows of its cache, ``kv_append`` writes row ``pos``, a slice at
    runtime bounds stays inside its dim, an argmax row is not empty. Checks that only differ in
    the op they name (every layer's) are kept once."""
    out: dict[tuple, RangeCheck] = {}
    live = graph.live_nodes()
    for n in graph.nodes:
        if n.id not in live:
            continue
        if n.op == "slice" and not (n.attrs["start"].is_const and n.attrs["stop"].is_const):
            start, stop, size = n.attrs["start"], n.attrs["stop"], graph.nodes[n.inputs[0]].shape[n.attrs["dim"]]
            for check in (RangeCheck(f"slice {n.label}: start", start, as_dim(0), stop),
                          RangeCheck(f"slice {n.label}: stop", stop, start, size)):
                out.setdefault((check.value, check.lo, check.hi), check)
            continue
        if n.op == "argmax" and not graph.nodes[n.inputs[0]].shape[n.attrs["dim"]].is_const:
            size = graph.nodes[n.inputs[0]].shape[n.attrs["dim"]]  # (no largest element in an empty row)
            check = RangeCheck(f"argmax {n.label}: the length of the reduced dim", size, as_dim(1), dmax(size, 1))
        elif n.op == "attention":
            rows = graph.nodes[n.inputs[1]].shape[1]
            check = RangeCheck(f"attention {n.label}: length", n.attrs["length"], as_dim(1), rows)
        elif n.op == "kv_append":
            rows = graph.nodes[n.inputs[0]].shape[1]
            check = RangeCheck(f"kv_append {n.label}: position", n.attrs["pos"], as_dim(0), rows - 1)
        elif n.op == "ragged_attention":  # (a paged cache: its page table's pages of rows a sequence)
            rows = graph.nodes[n.inputs[1]].shape[2] * (graph.nodes[n.inputs[5]].shape[1] if len(n.inputs) > 5 else 1)
            check = RangeCheck(f"ragged_attention {n.label}: length", n.attrs["length"], as_dim(1), rows)
        else:
            continue
        out.setdefault((check.value, check.lo, check.hi), check)
    return tuple(out.values())


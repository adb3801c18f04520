"""Chosen alternatives -> BlockProgram: buffers, operands (buffer + views), block ops.

Each family's ``lower_*`` function turns one chosen alternative into block ops of
the registered kinds; the kinds' ``build`` gives grids and footprints. Operands
whose view chain has no strided layout are materialised by an inserted copy.
"""

from __future__ import annotations

import math
from typing import Callable

from ..blockops import REGISTRY
from ..dims import Dim, as_dim, ceildiv
from ..dtypes import f32
from ..graph import Graph, GraphError, Node
from .encode import VIEW_OPS, base_node
from .extract import Choice
from .layout import layout_of, view_shape
from .program import BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, View
from .terms import NONE


MAX_MATVEC_M = 16  # x rows one matvec instance handles (decode has 1)
ACC_RESIDUAL_TILE = 1024  # elements per acc_residual instance: a few instances, one round trip each


def with_view(o: Operand, view: View) -> Operand:
    return Operand(o.buffer, view_shape(o.shape, view), o.dtype, o.views + (view,))


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
    """Accumulates buffers and block ops while lowering chosen alternatives in order."""

    def __init__(self, graph: Graph, env_hint: dict[str, int]) -> None:
        self.graph = graph
        self.env_hint = env_hint
        self.buffers: list[Buffer] = []
        self.buffer_of: dict[int, int] = {}
        self.transposed_of: dict[int, int] = {}  # weight node -> its transposed copy's buffer
        self.ops: list[BlockOp] = []
        self.folded: set[int] = set()  # glu_down nodes whose readers add the sum themselves
        self.sums: dict[int, tuple[Operand, Operand]] = {}  # folded node -> (residual, f32 sum) rows

    # --- buffers and operands ----------------------------------------------------------
    def new_buffer(self, name: str, kind: str, shape, dtype) -> int:
        self.buffers.append(Buffer(len(self.buffers), name, kind, tuple(as_dim(d) for d in shape), dtype))
        return len(self.buffers) - 1

    def buffer(self, i: int) -> int:
        """Buffer holding base node ``i`` (created on first use)."""
        if i not in self.buffer_of:
            n = self.graph.nodes[i]
            if n.op == "kv_append":  # writes its cache in place
                self.buffer_of[i] = self.buffer(base_node(self.graph, n.inputs[0]))
            else:
                kind = n.op if n.op in ("input", "weight", "constant") else "scratch"
                if kind == "input" and any(m.op == "kv_append" and base_node(self.graph, m.inputs[0]) == i for m in self.graph.nodes):
                    kind = "state"
                self.buffer_of[i] = self.new_buffer(n.name or f"t{i}", kind, n.shape, n.dtype)
        return self.buffer_of[i]

    def transposed_weight(self, i: int) -> Operand:
        """Weight node ``i`` ``[N, F]`` as a ``[F, N]`` buffer, transposed once when weights are bound."""
        n = self.graph.nodes[i]
        if i not in self.transposed_of:
            self.buffers.append(Buffer(len(self.buffers), n.name, "weight", tuple(reversed(n.shape)), n.dtype, transposed=True))
            self.transposed_of[i] = len(self.buffers) - 1
        buf = self.buffers[self.transposed_of[i]]
        return Operand(buf.id, buf.shape, buf.dtype)

    def operand(self, ref: int) -> Operand:
        chain = []
        i = ref
        while self.graph.nodes[i].op in VIEW_OPS:
            chain.append(_graph_view(self.graph.nodes[i]))
            i = self.graph.nodes[i].inputs[0]
        base = self.graph.nodes[i]
        o = Operand(self.buffer(i), base.shape, base.dtype)
        for v in reversed(chain):
            o = with_view(o, v)
        return o

    def output(self, n: Node) -> Operand:
        return Operand(self.buffer(n.id), n.shape, n.dtype)

    # --- ops -----------------------------------------------------------------------------
    def emit(self, kind: str, sources, inputs, output: Operand, params: dict) -> BlockOp:
        inputs = [self.strided(o, sources) for o in inputs]
        if layout_of(self.buffers[output.buffer].shape, output.views) is None:
            raise GraphError(f"{kind}: cannot write through view chain {output} (no strided layout)")
        part = REGISTRY[kind].build(inputs, output, params)
        op = BlockOp(len(self.ops), kind, tuple(sources), tuple(inputs), output, part.grid, part.reads, part.writes, params)
        op.estimate = self.estimate(op)
        self.ops.append(op)
        return op

    def estimate(self, op: BlockOp) -> Estimate:
        env = dict(self.env_hint)
        nbytes = REGISTRY[op.kind].bytes_moved(op, env)
        inst = op.launch_count.eval(env) if op.grid else 1
        return Estimate(nbytes, inst, 0.0)

    def strided(self, o: Operand, sources) -> Operand:
        """``o`` itself if its views have a strided layout, else a contiguous copy of it."""
        if layout_of(self.buffers[o.buffer].shape, o.views) is not None:
            return o
        dst = Operand(self.new_buffer(f"copy{len(self.buffers)}", "scratch", o.shape, o.dtype), o.shape, o.dtype)
        self.emit("elementwise", sources, [o], dst, elementwise_params("copy", dst.shape, self.env_hint))
        return dst


def to_rows(o: Operand) -> Operand:
    """View ``[..., D]`` as ``[rows, D]``."""
    if len(o.shape) == 2:
        return o
    rows = as_dim(1)
    for d in o.shape[:-1]:
        rows = rows * d
    return with_view(o, View("reshape", (rows, o.shape[-1])))


def broadcast_to(o: Operand, shape: tuple[Dim, ...]) -> Operand:
    if len(o.shape) < len(shape):
        o = with_view(o, View("reshape", (as_dim(1),) * (len(shape) - len(o.shape)) + o.shape))
    if o.shape != shape:
        o = with_view(o, View("expand", shape))
    return o


def elementwise_params(fn: str, shape, env: dict[str, int], tile: int = 8192) -> dict:
    """Tile along the largest dim, ``tile`` elements per instance in all."""
    if not shape:
        return {"fn": fn, "axis": 0, "tile": 1}
    sizes = [d.eval(env) for d in shape]
    axis = max(range(len(shape)), key=lambda k: sizes[k])
    other = math.prod(sizes) // max(1, sizes[axis])
    return {"fn": fn, "axis": axis, "tile": max(1, tile // max(1, other))}


# --- lowering of each family ------------------------------------------------------------
def lower_matvec(b: ProgramBuilder, n: Node, c: Choice) -> None:
    x, w, w2, g, eps, r, rows = c.args
    roles = {"x": x, "w": w, "w2": w2, "g": g, "r": r}
    present = tuple(k for k, v in roles.items() if v != NONE)
    inputs, sums = [], []
    for role in present:
        if role in ("x", "r") and base_node(b.graph, roles[role]) in b.sums:  # a folded glu_down: read r + sum
            residual, acc = b.sums[base_node(b.graph, roles[role])]
            inputs.append(residual)
            sums.append((role + "a", acc))
            continue
        o = b.operand(roles[role])
        inputs.append(to_rows(o) if role in ("x", "r") else o)
    present += tuple(role for role, _ in sums)
    inputs += [acc for _, acc in sums]
    if n.op == "matmul":  # out = a @ B: B [K, N] read as w [N, K]
        inputs[1] = with_view(inputs[1], View("permute", (1, 0)))
    out = to_rows(b.output(n))
    m = out.shape[0]
    mrows = m.value if m.is_const and m.value <= MAX_MATVEC_M else 1  # a runtime M adds instances
    params = {"rows": rows, "mrows": mrows, "roles": present, "eps": eps}
    b.emit("matvec", absorbed(b.graph, n.id, set(roles.values())), inputs, out, params)


def absorbed(graph: Graph, i: int, refs: set[int]) -> list[int]:
    """Graph nodes a fused op computes: ``i`` and its producers up to the operands it reads."""
    seen, stack = set(), [i]
    while stack:
        j = stack.pop()
        if j in seen or j in refs or graph.nodes[j].op in ("input", "weight", "constant"):
            continue
        seen.add(j)
        stack.extend(graph.nodes[j].inputs)
    return sorted(seen)


def lower_block(b: ProgramBuilder, n: Node, c: Choice) -> None:
    tile = c.args[0]
    ins = [b.operand(i) for i in n.inputs]
    out = b.output(n)
    family = c.kind
    if family == "rms_norm":
        b.emit("rms_norm", [n.id], [to_rows(ins[0]), ins[1]], to_rows(out), {"rows_per": tile, "eps": n.attrs["eps"]})
    elif family == "elementwise" or family in ("cast", "copy"):
        fn = n.op if n.op in ("add", "mul", "silu", "cast") else "copy"
        params = elementwise_params(fn, out.shape, b.env_hint, tile)
        b.emit("elementwise", [n.id], [broadcast_to(o, out.shape) for o in ins], out, params)
    elif family == "concat":
        d, start = n.attrs["dim"], as_dim(0)
        for o in ins:
            stop = start + o.shape[d]
            piece = with_view(out, View("slice", (d, start, stop)))
            b.emit("elementwise", [n.id], [o], piece, elementwise_params("copy", o.shape, b.env_hint, tile))
            start = stop
    elif family == "rope":  # positions from a tensor (decode's runtime-dim RoPE lowers as rope_rows)
        group = math.prod(d.value for d in n.shape[1:-1]) if len(n.shape) > 2 else 1
        params = {"rows_per": tile, "pos": None, "group": group, "roles": ("x", "inv_freq", "pos_ids"), "eps": 0.0}
        b.emit("rope", [n.id], [to_rows(ins[0]), ins[1], ins[2]], to_rows(out), params)
    elif family == "softmax":
        if n.attrs["dim"] != len(n.shape) - 1:
            raise GraphError(f"softmax {n.label}: only the last dim is supported by the megakernel (dim={n.attrs['dim']})")
        b.emit("softmax", [n.id], [to_rows(ins[0])], to_rows(out), {"rows_per": tile})
    elif family == "embedding":
        ids = ins[1] if len(ins[1].shape) == 1 else with_view(ins[1], View("reshape", (_numel(ins[1].shape),)))
        b.emit("embedding", [n.id], [ins[0], ids], to_rows(out), {})
    elif family == "kv_append":
        b.emit("kv_append", [n.id], [ins[1]], b.operand(n.id), {"pos": n.attrs["pos"]})
    elif family == "attention":
        lower_attention(b, n, ins, out, tile)
    elif family == "argmax":
        lower_argmax(b, n, ins[0], out, tile)
    elif family == "matmul":
        lower_matvec(b, n, Choice(n.id, "matvec", (n.inputs[0], n.inputs[1], NONE, NONE, 0.0, NONE, tile)))
    else:
        raise GraphError(f"{n.op} {n.label}: no block-op lowering for family {family!r}")


def lower_attention(b: ProgramBuilder, n: Node, ins, out: Operand, chunk: int) -> None:
    q, kc, vc = ins
    hq, d = (x.value for x in q.shape)
    hkv, smax = kc.shape[0].value, kc.shape[1]
    part_shape = (hq, ceildiv(smax, chunk), d + 2)
    part = Operand(b.new_buffer(f"attn_part{n.id}", "scratch", part_shape, f32), tuple(as_dim(s) for s in part_shape), f32)
    length = n.attrs["length"]
    common = {"length": length, "chunk": chunk}
    b.emit("attn_partial", [n.id], [q, kc, vc], part, {**common, "group": hq // hkv, "scale": n.attrs["scale"]})
    b.emit("attn_merge", [n.id], [part], out, {**common, "rows_per": max(1, hq // hkv)})


def lower_argmax(b: ProgramBuilder, n: Node, x: Operand, out: Operand, chunk: int) -> None:
    if n.attrs["dim"] != len(x.shape) - 1:
        raise GraphError(f"argmax {n.label}: only the last dim is supported by the megakernel")
    x = to_rows(x) if len(x.shape) != 1 else with_view(x, View("reshape", (as_dim(1), x.shape[0])))
    m, cols = x.shape
    part_shape = (m, ceildiv(cols, chunk), as_dim(2))
    part = Operand(b.new_buffer(f"argmax_part{n.id}", "scratch", part_shape, f32), part_shape, f32)
    b.emit("argmax_partial", [n.id], [x], part, {"chunk": chunk})
    flat = out if len(out.shape) == 1 else with_view(out, View("reshape", (m,)))
    b.emit("argmax_reduce", [n.id], [part], flat, {})


def _numel(shape) -> Dim:
    total = as_dim(1)
    for d in shape:
        total = total * d
    return total


def lower_matvec_heads(b: ProgramBuilder, n: Node, c: Choice) -> None:
    x, w, g, eps, rows, rope, append = c.args
    roles = {"x": x, "w": w, "g": g, "inv_freq": b.graph.nodes[rope].inputs[1] if rope != NONE else NONE}
    present = tuple(k for k, v in roles.items() if v != NONE)
    inputs = [to_rows(b.operand(roles[r])) if r == "x" else b.operand(roles[r]) for r in present]
    head_dim = inputs[present.index("w")].shape[0].value // (
        b.graph.nodes[append].shape[0].value if append != NONE else n.shape[0].value)
    pos = b.graph.nodes[rope].attrs["pos"] if rope != NONE else as_dim(0)
    out = cache_row(b, append) if append != NONE else b.output(n)
    params = {"rows": rows, "head_dim": head_dim, "roles": present, "eps": eps, "pos": pos}
    b.emit("matvec_heads", absorbed(b.graph, n.id, {v for v in roles.values() if v != NONE}), inputs, out, params)


def cache_row(b: ProgramBuilder, append: int) -> Operand:
    """The KV cache row that ``kv_append`` node ``append`` writes, seen as ``[Hkv, D]``."""
    a = b.graph.nodes[append]
    row = with_view(b.operand(append), View("slice", (1, a.attrs["pos"], a.attrs["pos"] + 1)))
    return with_view(row, View("reshape", (a.shape[0], a.shape[2])))


def lower_rope_rows(b: ProgramBuilder, n: Node, c: Choice) -> None:
    """RoPE at a runtime-dim position [after qwen3's per-head RMSNorm], into its own
    buffer or straight into the KV cache row (blockops/rope.py)."""
    x, g, eps, rope, append, tile = c.args
    r = b.graph.nodes[rope]
    roles = {"x": x, "inv_freq": r.inputs[1], "g": g}
    present = tuple(k for k, v in roles.items() if v != NONE)
    inputs = [to_rows(b.operand(roles[k])) if k == "x" else b.operand(roles[k]) for k in present]
    out = cache_row(b, append) if append != NONE else to_rows(b.output(r))
    params = {"rows_per": tile, "pos": r.attrs["pos"], "group": 1, "roles": present, "eps": eps}
    b.emit("rope", absorbed(b.graph, n.id, {v for v in roles.values() if v != NONE}), inputs, out, params)


def lower_matvec_argmax(b: ProgramBuilder, n: Node, c: Choice) -> None:
    x, w, g, eps, rows = c.args
    roles = {"x": x, "w": w, "g": g}
    present = tuple(k for k, v in roles.items() if v != NONE)
    inputs = [b.operand(roles[r]) for r in present]
    tiles = ceildiv(inputs[present.index("w")].shape[0], rows)
    part_shape = (as_dim(1), tiles, as_dim(2))
    part = Operand(b.new_buffer(f"argmax_part{n.id}", "scratch", part_shape, f32), part_shape, f32)
    params = {"rows": rows, "roles": present, "eps": eps}
    b.emit("matvec_argmax", absorbed(b.graph, n.id, {v for v in roles.values() if v != NONE}), inputs, part, params)
    out = b.output(n)
    b.emit("argmax_reduce", [n.id], [part], out if len(out.shape) == 1 else with_view(out, View("reshape", (as_dim(1),))), {})


def lower_glu_down(b: ProgramBuilder, n: Node, c: Choice) -> None:
    """r + (gated MLP) @ wd^T: ``glu_down`` accumulates into an f32 ``accum`` buffer,
    ``acc_residual`` rounds it and adds the residual (blockops/glu_down.py)."""
    x, w, w2, g, eps, wd, r, rows = c.args
    roles = {"x": x, "g": g, "w": w, "w2": w2}
    present = tuple(k for k, v in roles.items() if v != NONE)
    inputs = [to_rows(b.operand(roles[k])) if k == "x" else b.operand(roles[k]) for k in present]
    out = to_rows(b.output(n))
    acc = Operand(b.new_buffer(f"mlp_acc{n.id}", "accum", out.shape, f32), out.shape, f32)
    refs = {v for v in (x, w, w2, g, wd, r) if v != NONE}
    sources = [s for s in absorbed(b.graph, n.id, refs) if s != n.id]
    params = {"rows": rows, "roles": (*present, "wd"), "eps": eps}
    b.emit("glu_down", sources, [*inputs, b.transposed_weight(wd)], acc, params)
    residual = to_rows(b.operand(r))
    if n.id in b.folded:  # its readers stage r + T(acc) themselves
        b.sums[n.id] = (residual, acc)
    else:
        b.emit("acc_residual", [n.id], [residual, acc], out, {"tile": ACC_RESIDUAL_TILE})


def foldable_sums(graph: Graph, chosen: dict[int, Choice]) -> set[int]:
    """The ``glu_down`` nodes whose value ``r + T(acc)`` needs no ``acc_residual`` op: every
    reader is a matvec taking it as x or r through reshapes only (one row, as the sum is)
    and it is no graph output. Those readers add the f32 sum as they stage it (perf-notes #34)."""
    sums = {i for i, c in chosen.items() if c.kind == "glu_down"}
    sums -= {base_node(graph, i) for i in graph.outputs.values()}
    for c in chosen.values():
        for ref in c.refs(graph):
            i = base_node(graph, ref)
            if i not in sums:
                continue
            as_x_or_r = c.kind == "matvec" and ref in (c.args[0], c.args[5]) and ref not in c.args[1:4]
            one_row = math.prod(d.value if d.is_const else 0 for d in graph.nodes[ref].shape[:-1]) == 1
            if not (as_x_or_r and one_row and _reshapes_only(graph, ref)):
                sums.discard(i)
    return sums


def _reshapes_only(graph: Graph, i: int) -> bool:
    while graph.nodes[i].op in VIEW_OPS:
        if graph.nodes[i].op != "reshape":
            return False
        i = graph.nodes[i].inputs[0]
    return True


LOWER: dict[str, Callable[[ProgramBuilder, Node, Choice], None]] = {
    "matvec": lower_matvec, "matvec_heads": lower_matvec_heads, "matvec_argmax": lower_matvec_argmax,
    "glu_down": lower_glu_down, "rope_rows": lower_rope_rows,
}


def build_program(graph: Graph, chosen: dict[int, Choice], env_hint: dict[str, int]) -> BlockProgram:
    b = ProgramBuilder(graph, env_hint)
    b.folded = foldable_sums(graph, chosen)
    for i in sorted(chosen):
        c = chosen[i]
        LOWER.get(c.kind, lower_block)(b, graph.nodes[i], c)
    outputs = {name: b.operand(i) for name, i in graph.outputs.items()}
    return BlockProgram(b.buffers, b.ops, outputs, tuple(sorted(graph.symbols())), range_checks(graph))


def range_checks(graph: Graph) -> tuple[RangeCheck, ...]:
    """The runtime bounds the reference executor enforces, for the host to check each call:
    attention reads ``length`` rows of its cache, ``kv_append`` writes row ``pos``. Checks that
    only differ in the op they name (every layer's) are kept once."""
    out: dict[tuple, RangeCheck] = {}
    live = graph.live_nodes()
    for n in graph.nodes:
        if n.id not in live:
            continue
        if n.op == "attention":
            rows = graph.nodes[n.inputs[1]].shape[1]
            check = RangeCheck(f"attention {n.label}: length", n.attrs["length"], as_dim(1), rows)
        elif n.op == "kv_append":
            rows = graph.nodes[n.inputs[0]].shape[1]
            check = RangeCheck(f"kv_append {n.label}: position", n.attrs["pos"], as_dim(0), rows - 1)
        else:
            continue
        out.setdefault((check.value, check.lo, check.hi), check)
    return tuple(out.values())

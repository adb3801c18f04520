"""Graph -> e-graph: one ``Op`` term per computing node, unioned into ``node(i)``.

:data:`ENCODERS` gives, per graph op, the fields of its term in ``terms.GRAPH_TERMS`` (or None
where the node does not fit that term's rules, e.g. RoPE at positions from a tensor); every
other op becomes ``Op.other(op=..., node=i)``, lowered by a single-node term.
"""

from __future__ import annotations

from typing import Callable

from egglog import EGraph, union

from ..blockops.rope import hf_rounding
from ..dims import as_dim
from ..dtypes import f32
from ..graph import LEAF_OPS, Graph, Node
from .terms import Op, node

VIEW_OPS = ("reshape", "permute", "slice", "expand")


def base_node(graph: Graph, i: int) -> int:
    """Follow view nodes down to the node that owns the storage."""
    while graph.nodes[i].op in VIEW_OPS:
        i = graph.nodes[i].inputs[0]
    return i


def _same_shape(graph: Graph, n: Node) -> int:
    return int(all(graph.nodes[j].shape == n.shape for j in n.inputs))


def _is_row_vector(shape) -> bool:
    return len(shape) == 2 and shape[0].is_const and shape[0].value == 1


ENCODERS: dict[str, Callable[[Graph, Node], dict | None]] = {
    "linear": lambda g, n: dict(x=n.inputs[0], w=n.inputs[1]),
    "rms_norm": lambda g, n: dict(x=n.inputs[0], g=n.inputs[1], eps=n.attrs["eps"]),
    "add": lambda g, n: dict(a=n.inputs[0], b=n.inputs[1], same_shape=_same_shape(g, n)),
    "mul": lambda g, n: dict(a=n.inputs[0], b=n.inputs[1], same_shape=_same_shape(g, n)),
    "sub": lambda g, n: dict(a=n.inputs[0], b=n.inputs[1]),
    "div": lambda g, n: dict(a=n.inputs[0], b=n.inputs[1]),
    "neg": lambda g, n: dict(a=n.inputs[0]),
    "silu": lambda g, n: dict(a=n.inputs[0]),
    "rope": lambda g, n: dict(x=n.inputs[0], node=n.id) if n.attrs["pos"] is not None else (
        "rope_at_ids", dict(x=n.inputs[0], inv=n.inputs[1], pos=n.inputs[2], hf=int(hf_rounding(n)), node=n.id)),
    "kv_append": lambda g, n: dict(cache=n.inputs[0], new=n.inputs[1]),
    "kv_store": lambda g, n: dict(new=n.inputs[1], node=n.id),
    "ragged_attention": lambda g, n: dict(q=n.inputs[0], node=n.id),
    "moe_mlp": lambda g, n: dict(x=n.inputs[0], logits=n.inputs[1], w=n.inputs[2], w2=n.inputs[3], wd=n.inputs[4],
                                 node=n.id),
    "all_reduce": lambda g, n: dict(x=n.inputs[0], node=n.id),
    "argmax": lambda g, n: (dict(x=n.inputs[0], node=n.id)
                            if _is_row_vector(g.nodes[n.inputs[0]].shape) and n.attrs["dim"] == 1 else None),
    "cast": lambda g, n: dict(a=n.inputs[0], dtype=n.dtype.name, src=g.nodes[n.inputs[0]].dtype.name),
    "pow": lambda g, n: dict(a=n.inputs[0], p=n.attrs["exponent"]),
    "mean": lambda g, n: (("mean_last", dict(a=n.inputs[0]))
                          if n.attrs["dim"] == len(g.nodes[n.inputs[0]].shape) - 1 and n.attrs["keepdim"] else None),
    "rsqrt": lambda g, n: dict(a=n.inputs[0]),
    "add_scalar": lambda g, n: dict(a=n.inputs[0], c=n.attrs["scalar"]),
    "sigmoid": lambda g, n: dict(a=n.inputs[0], dtype=n.dtype.name),
}


def scale_views(graph: Graph, n: Node) -> list[Op]:
    """A mul node's broadcasting forms: ``Op.scale_last`` (one operand a [D] vector of the other's last
    dim) and ``Op.scale_rows`` (one operand [..., 1] beside the other's rows), for the rules that
    recognise written-out patterns (rules.py: _recover_rms_norm)."""
    if n.op != "mul":
        return []
    out = []
    for x, v in (n.inputs, n.inputs[::-1]):
        xs, vs = graph.nodes[x].shape, graph.nodes[v].shape
        if xs != n.shape or not xs:
            continue
        if len(vs) == 1 and vs[0] == xs[-1]:
            out.append(Op.scale_last(x=x, g=v, dtype=n.dtype.name))
        if len(vs) == len(xs) and vs[:-1] == xs[:-1] and vs[-1].is_const and vs[-1].value == 1:
            out.append(Op.scale_rows(x=x, s=v))
    return out


def _ones(shape) -> bool:
    return all(d.is_const and d.value == 1 for d in shape)


def _keeps_rows(graph: Graph, n: Node) -> bool:
    """Whether view node ``n`` (a reshape or a permute) has its input's rows in their order: the same last
    dim, and the elements in the same order (a reshape; a permute that moves only dims of size 1)."""
    src = graph.nodes[n.inputs[0]].shape
    if not n.shape or not src or n.shape[-1] != src[-1]:
        return False
    if n.op == "reshape":
        return True
    dims = n.attrs["dims"]
    return n.op == "permute" and dims[-1] == len(src) - 1 and \
        [d for d in dims if not _ones(src[d:d + 1])] == [d for d in range(len(src)) if not _ones(src[d:d + 1])]


def rope_views(graph: Graph, n: Node) -> list[Op]:
    """The forms of a node that the rule recovering RoPE as Hugging Face writes it looks for (rules.py:
    ``_recover_rope``): cos, sin, a concatenation of two tensors along the last dim, a half of the last dim,
    a view keeping its input's rows, a product broadcasting one row a token (``scale_tokens``) and the
    angles' outer product of positions and frequencies (``outer``). The node keeps its own term too."""
    ins = [graph.nodes[i] for i in n.inputs]
    if n.op in ("cos", "sin"):
        return [getattr(Op, n.op)(a=n.inputs[0])]
    if n.op == "concat" and len(ins) == 2 and n.attrs["dim"] == len(n.shape) - 1:
        return [Op.concat_last(a=n.inputs[0], b=n.inputs[1])]
    if n.op == "slice" and n.attrs["dim"] == len(n.shape) - 1:
        size, start, stop = ins[0].shape[-1], n.attrs["start"], n.attrs["stop"]
        if size.is_const and size.value % 2 == 0 and start.is_const and stop.is_const:
            h = size.value // 2
            halves = {(0, h): 0, (h, 2 * h): 1}
            if (start.value, stop.value) in halves:
                return [Op.half(src=n.inputs[0], upper=halves[(start.value, stop.value)])]
        return []
    r = len(n.shape)
    if n.op == "permute" and r >= 2 and list(n.attrs["dims"]) == [*range(r - 2), r - 1, r - 2] and ins[0].op == "mul":
        m = ins[0]  # (f @ p).transpose(-1, -2), f [1, .., K, 1], p [.., 1, S]: transformers 4's angles
        for f, p in (m.inputs, m.inputs[::-1]):
            fs, ps = graph.nodes[f].shape, graph.nodes[p].shape
            if m.dtype == f32 and len(fs) == len(ps) == len(m.shape) and _ones(fs[:-2] + fs[-1:]) and \
                    _ones(ps[-2:-1]) and m.shape == ps[:-2] + fs[-2:-1] + ps[-1:]:
                return [Op.outer(p=p, f=f)]
    if n.op in ("reshape", "permute"):
        return [Op.rows_of(src=n.inputs[0])] if _keeps_rows(graph, n) else []
    if n.op != "mul":
        return []
    out = []
    for (x, t), (xn, tn) in zip((n.inputs, n.inputs[::-1]), (ins, ins[::-1])):
        xs, ts = xn.shape, tn.shape
        if r >= 2 and xs == n.shape and len(ts) <= r:
            tp = (as_dim(1),) * (r - len(ts)) + ts
            if tp[-1] == xs[-1] and tp[0] == xs[0] and _ones(tp[1:-1]):
                out.append(Op.scale_tokens(x=x, t=t))
        if n.dtype == f32 and len(ts) == 1 and xs and _ones(xs[-1:]) and n.shape == xs[:-1] + ts:
            out.append(Op.outer(p=x, f=t))
    return out


def term_of(graph: Graph, n: Node) -> Op:
    """The node's graph term: its encoder's fields (and, where it names one, another constructor than the
    op's own), else ``Op.other``."""
    encoder = ENCODERS.get(n.op)
    fields = encoder(graph, n) if encoder else None
    name = n.op
    if isinstance(fields, tuple):
        name, fields = fields
    return getattr(Op, name)(**fields) if fields is not None else Op.other(op=n.op, node=n.id)


def heads_view(graph: Graph, n: Node) -> Op | None:
    """``Op.heads`` for a reshape ``[1, H*D] -> [H, D]`` (what QKV fusion looks through)."""
    if n.op != "reshape" or len(n.shape) != 2 or not all(d.is_const for d in n.shape):
        return None
    src = graph.nodes[n.inputs[0]].shape
    if len(src) == 2 and src[0].is_const and src[0].value == 1 and src[1] == n.shape[0] * n.shape[1]:
        return Op.heads(src=n.inputs[0], head_dim=n.shape[1].value)
    return None


def row_linear_view(graph: Graph, n: Node) -> Op | None:
    """``Op.row_linear`` for a linear of one x row (every dim of x but the last 1; weights have constant dims)."""
    if n.op != "linear" or not _ones(graph.nodes[n.inputs[0]].shape[:-1]):
        return None
    return Op.row_linear(x=n.inputs[0], w=n.inputs[1], n=graph.nodes[n.inputs[1]].shape[0].value)


def encode(graph: Graph, live: set[int]) -> EGraph:
    """An e-graph holding every live computing node's term (leaves and views have none)."""
    egraph = EGraph()
    actions = [
        union(node(n.id)).with_(term_of(graph, n))
        for n in graph.nodes
        if n.id in live and n.op not in LEAF_OPS and n.op not in VIEW_OPS
    ]
    actions += [union(node(n.id)).with_(t) for n in graph.nodes if n.id in live
                for t in (heads_view(graph, n), row_linear_view(graph, n)) if t is not None]
    actions += [union(node(n.id)).with_(t) for n in graph.nodes if n.id in live for t in scale_views(graph, n)]
    actions += [union(node(n.id)).with_(t) for n in graph.nodes if n.id in live for t in rope_views(graph, n)]
    if actions:
        egraph.register(*actions)
    return egraph

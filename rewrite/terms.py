"""The e-graph encoding of a graph: one small ``Op`` term per node, in SSA form.

``node(i)`` is the e-class of graph node ``i``; ``acc(i)`` that of an f32 sum whose rounding
is node ``i``'s value (a :class:`~megaegg.blockops.base.Sum`). Tensor operands are node ids
(``i64``), never nested terms: nested terms share subterms across layers and make extraction
cost overflow (docs/design.md, egglog facts). A node whose operand is a view refers to the
view node's id; views have no term, so no fusion rule sees through one (a fused body reads
its operands unviewed), except the ``heads`` reshape below.

``Op`` has two families of constructors, all with named fields, so that rules can union
what the user wrote with how it runs in one e-class:

- graph-op terms (:data:`GRAPH_TERMS`, built by ``encode.py``): what the user wrote;
- block terms, one per :data:`~megaegg.blockops.TERMS` entry, generated from the fields its
  ``megaegg/blockops`` module declares (``Op.matvec(x=, w=, ..., rows=)``).

Absent optional operands are ``NONE`` (-1).
"""

from __future__ import annotations

import inspect

from egglog import Expr, StringLike, f64Like, function, i64Like

from ..blockops import TERMS
from ..blockops.base import NONE, fields

# Graph ops that rules rewrite, with their fields (``encode.py`` fills them from a node).
GRAPH_TERMS = {
    "linear": fields("x:ref w:ref"),
    "rms_norm": fields("x:ref g:ref eps:float"),
    "add": fields("a:ref b:ref same_shape:int"),
    "mul": fields("a:ref b:ref same_shape:int"),
    "sub": fields("a:ref b:ref"),
    "div": fields("a:ref b:ref"),
    "neg": fields("a:ref"),
    "silu": fields("a:ref"),
    "heads": fields("src:ref head_dim:int"),  # a reshape view [1, H*D] -> [H, D], seen so QKV fusion can look through it
    # a linear of one x row (x's dims but the last all 1) and its weight's n rows, seen so that a tall one (an LM head)
    # gets the tile heights that fill the SMs (rules.py: wave_tiles)
    "row_linear": fields("x:ref w:ref n:int"),
    "rope": fields("x:ref node:node"),  # RoPE at a runtime-dim position
    # RoPE at positions from the i32 tensor pos (a batch, a prompt), frequencies inv, hf: Hugging Face's rounding
    # (ops.rope's rounding="hf"); node: its value (a rope node, or the sum of a RoPE written out: rules.py)
    "rope_at_ids": fields("x:ref inv:ref pos:ref hf:int node:node"),
    "kv_append": fields("cache:ref new:ref"),
    "kv_store": fields("new:ref node:node"),  # rows into a cache at (slot, position) pairs from i32 tensors
    "ragged_attention": fields("q:ref node:node"),  # its q seen, so q's RoPE can fold into the prompt's flash
    "argmax": fields("x:ref node:node"),  # over the last dim of a [1, N] tensor
    "moe_mlp": fields("x:ref logits:ref w:ref w2:ref wd:ref node:node"),  # top_k, normalize: the node's attrs
    "all_reduce": fields("x:ref node:node"),  # ranks: the node's attr
    "cast": fields("a:ref dtype:str src:str"),  # to dtype from src (dtype names)
    # primitives of written-out patterns (megaegg/ops.py: pow, mean, rsqrt, add_scalar) and the two
    # broadcasting products they use; no block op of their own
    "pow": fields("a:ref p:float"),
    "mean_last": fields("a:ref"),  # over the last dim, keepdim
    "rsqrt": fields("a:ref"),
    "add_scalar": fields("a:ref c:float"),
    "sigmoid": fields("a:ref dtype:str"),
    "scale_last": fields("x:ref g:ref dtype:str"),  # x [..., D] * g [D] (either order), the product's dtype
    "scale_rows": fields("x:ref s:ref"),  # x [..., D] * s [..., 1] (either order)
    # ... and of RoPE as Hugging Face writes it (rules.py: _recover_rope); cos and sin also stay Op.other
    "cos": fields("a:ref"),
    "sin": fields("a:ref"),
    "concat_last": fields("a:ref b:ref"),  # two tensors concatenated along their last dim
    "half": fields("src:ref upper:int"),  # a slice view: the lower (0) or upper (1) half of the last dim
    "rows_of": fields("src:ref"),  # a view with src's rows in src's order (its last dim, its elements' order)
    "scale_tokens": fields("x:ref t:ref"),  # x [T, ..., D] * t [T, 1, ..., 1, D] (either order): a row of t a token
    # angles in f32: p [..., 1] * f [K] (either order) -> [..., K], or (f [1, .., 1, K, 1] @ p [.., 1, S]) transposed
    "outer": fields("p:ref f:ref"),
    "other": fields("op:str node:node"),  # any other graph op: lowered by a single-node term
}
_EGG_TYPES = {"ref": i64Like, "sum": i64Like, "node": i64Like, "int": i64Like, "float": f64Like, "str": StringLike}


def _constructor(name: str, spec, doc: str | None):
    """A classmethod ``Op.<name>(field, ...)`` with typed parameters, as egglog reads them."""

    def make(cls, *args, **kwargs): ...

    params = [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_EGG_TYPES[f.kind]) for f in spec]
    make.__signature__ = inspect.Signature(params, return_annotation="Op")
    make.__annotations__ = {f.name: _EGG_TYPES[f.kind] for f in spec} | {"return": "Op"}
    make.__name__, make.__qualname__, make.__doc__ = name, f"Op.{name}", doc
    return classmethod(make)


def _op_sort() -> type:
    clash = set(GRAPH_TERMS) & set(TERMS)
    if clash:
        raise ValueError(f"block terms named like graph terms: {sorted(clash)}")
    namespace = {"__module__": __name__, "__doc__": "A graph op or a block term (see the module docstring)."}
    for name, spec in GRAPH_TERMS.items():
        namespace[name] = _constructor(name, spec, None)
    for name, t in TERMS.items():
        namespace[name] = _constructor(name, t.fields, type(t).__doc__)
    return type("Op", (Expr,), namespace)


Op = _op_sort()


@function
def node(i: i64Like) -> Op: ...


@function
def acc(i: i64Like) -> Op: ...


__all__ = ["GRAPH_TERMS", "NONE", "Op", "acc", "node"]

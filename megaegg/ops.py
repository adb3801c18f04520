"""Graph ops: each checks its operands, infers the result's shape and dtype, adds a node.

Every function takes and returns :class:`~megaegg.graph.Tensor` handles. A bad
operand raises :class:`~megaegg.graph.ShapeError` naming the op, the tensors and
their shapes.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from .ir.dimform import canonical, product
from .dims import Dim, DimLike, as_dim, fmt_shape
from .dtypes import DType, as_dtype, f32, i32
from .graph import OPERATORS, GraphError, ShapeError, Tensor, check_static_dims

__all__ = [
    "matmul", "linear", "add", "sub", "mul", "div", "neg", "silu", "rms_norm", "rope", "rope_inv_freq", "embedding",
    "softmax", "attention", "kv_append", "kv_store", "ragged_attention", "argmax", "reshape", "transpose", "permute", "slice",
    "expand", "concat", "cast", "moe_mlp", "sample", "all_reduce", "all_gather", "pow", "mean", "rsqrt", "add_scalar",
    "sigmoid", "gelu", "tanh", "exp", "cos", "sin",
]


# --- helpers -------------------------------------------------------------------
def _desc(t: Tensor) -> str:
    return f"{t.node.label} {t.dtype}{fmt_shape(t.shape)}"


def same_dim(a: Dim, b: Dim) -> bool:
    """Structural equality after the constructors' folding (``S + 1`` equals ``1 + S``)."""
    return as_dim(a) == as_dim(b)


def _check_float(op: str, *ts: Tensor) -> None:
    for t in ts:
        if not t.dtype.is_float:
            raise ShapeError(f"{op}: {_desc(t)} must be a float tensor")


def _check_same_dtype(op: str, *ts: Tensor) -> None:
    if len({t.dtype for t in ts}) > 1:
        raise ShapeError(f"{op}: dtypes differ: " + ", ".join(_desc(t) for t in ts) + " (use cast)")


def _check_static(op: str, what: str, t: Tensor, dims: Sequence[int], why: str) -> None:
    """Dims ``dims`` of ``t`` must be constants: the block ops take them at compile time."""
    if not all(t.shape[d].is_const for d in dims):
        raise ShapeError(f"{op}: {what} {_desc(t)} must have static {why} (a runtime dim there is not supported)")


def _norm_dim(op: str, t: Tensor, dim: int) -> int:
    n = t.ndim
    if not -n <= dim < n:
        raise ShapeError(f"{op}: dim {dim} out of range for {_desc(t)}")
    return dim % n


def _new(op: str, inputs: Sequence[Tensor], out_shape, dtype: DType, name: str | None = None, **attrs) -> Tensor:
    g = inputs[0].graph
    g.check_owned(op, *inputs)
    return g.add_node(op, (t.id for t in inputs), out_shape, dtype, attrs, name=name)


def broadcast_shapes(op: str, a: Tensor, b: Tensor) -> tuple[Dim, ...]:
    sa, sb = list(a.shape), list(b.shape)
    n = max(len(sa), len(sb))
    sa = [as_dim(1)] * (n - len(sa)) + sa
    sb = [as_dim(1)] * (n - len(sb)) + sb
    out = []
    for x, y in zip(sa, sb):
        if same_dim(x, y) or (y.is_const and y.value == 1):
            out.append(x)
        elif x.is_const and x.value == 1:
            out.append(y)
        else:
            raise ShapeError(f"{op}: shapes do not broadcast: {_desc(a)} and {_desc(b)}")
    return tuple(out)


# --- arithmetic ----------------------------------------------------------------


def operator(fn):
    """Make ``fn`` the Tensor operator of its name (graph.OPERATORS: ``a + b``, ``a @ b``, ``x.reshape``...)."""
    OPERATORS[fn.__name__] = fn
    return fn


@operator
def matmul(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """``a @ b`` with ``a: [..., M, K]`` (or ``[K]``) and ``b: [K, N]``."""
    _check_float("matmul", a, b)
    _check_same_dtype("matmul", a, b)
    if b.ndim != 2 or a.ndim < 1:
        raise ShapeError(f"matmul: expected a [..., K] and b [K, N], got {_desc(a)} and {_desc(b)}")
    if not same_dim(a.shape[-1], b.shape[0]):
        raise ShapeError(f"matmul: inner dims differ: {_desc(a)} @ {_desc(b)}")
    _check_static("matmul", "b", b, (0, 1), "dims [K, N]")
    return _new("matmul", (a, b), a.shape[:-1] + (b.shape[1],), a.dtype, name)


def linear(x: Tensor, w: Tensor, *, name: str | None = None) -> Tensor:
    """``x @ w.T`` with ``x: [..., K]`` and ``w: [N, K]`` (the PyTorch ``Linear`` layout)."""
    _check_float("linear", x, w)
    _check_same_dtype("linear", x, w)
    if w.ndim != 2 or x.ndim < 1:
        raise ShapeError(f"linear: expected x [..., K] and w [N, K], got {_desc(x)} and {_desc(w)}")
    if not same_dim(x.shape[-1], w.shape[1]):
        raise ShapeError(f"linear: in-features differ: x {_desc(x)} vs weight {_desc(w)} (expects [N, K] with K = x.shape[-1])")
    _check_static("linear", "weight", w, (0, 1), "dims [N, K]")
    return _new("linear", (x, w), x.shape[:-1] + (w.shape[0],), x.dtype, name)


def _binary(op: str, a: Tensor, b: Tensor, name: str | None) -> Tensor:
    if not isinstance(b, Tensor) or not isinstance(a, Tensor):
        raise TypeError(f"{op}: both operands must be Tensors")
    _check_same_dtype(op, a, b)
    return _new(op, (a, b), broadcast_shapes(op, a, b), a.dtype, name)


@operator
def add(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise ``a + b`` with NumPy broadcasting."""
    return _binary("add", a, b, name)


@operator
def mul(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise ``a * b`` with NumPy broadcasting."""
    return _binary("mul", a, b, name)


@operator
def sub(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise ``a - b`` with NumPy broadcasting."""
    return _binary("sub", a, b, name)


@operator
def div(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise ``a / b`` with NumPy broadcasting (floating point: true division)."""
    _check_float("div", a, b)
    return _binary("div", a, b, name)


@operator
def neg(x: Tensor, *, name: str | None = None) -> Tensor:
    """Elementwise ``-x``."""
    if not isinstance(x, Tensor):
        raise TypeError("neg: the operand must be a Tensor")
    return _new("neg", (x,), x.shape, x.dtype, name)


# Primitives that run only inside a pattern a rewrite rule recognises (RMSNorm written out, as exported
# models write it: rewrite/rules.py, _recover_rms_norm); alone, no block op takes them.
def pow(x: Tensor, exponent: float, *, name: str | None = None) -> Tensor:  # noqa: A001 - torch's name
    """``x ** exponent`` elementwise (a scalar exponent)."""
    _check_float("pow", x)
    return _new("pow", (x,), x.shape, x.dtype, name, exponent=float(exponent))


def mean(x: Tensor, dim: int = -1, keepdim: bool = False, *, name: str | None = None) -> Tensor:
    """The mean over ``dim`` (in ``x``'s dtype, as torch computes it)."""
    _check_float("mean", x)
    d = _norm_dim("mean", x, dim)
    shape = x.shape[:d] + ((as_dim(1),) if keepdim else ()) + x.shape[d + 1 :]
    return _new("mean", (x,), shape, x.dtype, name, dim=d, keepdim=bool(keepdim))


def rsqrt(x: Tensor, *, name: str | None = None) -> Tensor:
    """``1 / sqrt(x)`` elementwise."""
    _check_float("rsqrt", x)
    return _new("rsqrt", (x,), x.shape, x.dtype, name)


def add_scalar(x: Tensor, value: float, *, name: str | None = None) -> Tensor:
    """``x + value`` elementwise (a Python scalar)."""
    _check_float("add_scalar", x)
    return _new("add_scalar", (x,), x.shape, x.dtype, name, scalar=float(value))


def sigmoid(x: Tensor, *, name: str | None = None) -> Tensor:
    """``1 / (1 + exp(-x))`` elementwise (``x * sigmoid(x)`` is recognised as SiLU: rewrite/rules.py)."""
    _check_float("sigmoid", x)
    return _new("sigmoid", (x,), x.shape, x.dtype, name)


GELU_APPROXIMATIONS = ("none", "tanh")


def gelu(x: Tensor, approximate: str = "none", *, name: str | None = None) -> Tensor:
    """GELU elementwise, exact (``x * Phi(x)``, erf) or ``approximate="tanh"``, as ``torch.nn.functional.gelu``."""
    _check_float("gelu", x)
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return _new("gelu", (x,), x.shape, x.dtype, name, approximate=approximate)


def _unary(op: str, doc: str):
    def fn(x: Tensor, *, name: str | None = None) -> Tensor:
        _check_float(op, x)
        return _new(op, (x,), x.shape, x.dtype, name)

    fn.__name__, fn.__doc__ = op, doc
    return fn


tanh = _unary("tanh", "``tanh(x)`` elementwise.")
exp = _unary("exp", "``e ** x`` elementwise.")
cos = _unary("cos", "``cos(x)`` elementwise (radians).")
sin = _unary("sin", "``sin(x)`` elementwise (radians).")


def silu(x: Tensor, *, name: str | None = None) -> Tensor:
    """``x * sigmoid(x)``."""
    _check_float("silu", x)
    return _new("silu", (x,), x.shape, x.dtype, name)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, name: str | None = None) -> Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim; ``weight: [D]``."""
    _check_float("rms_norm", x, weight)
    if weight.ndim != 1 or not same_dim(weight.shape[0], x.shape[-1]):
        raise ShapeError(f"rms_norm: weight {_desc(weight)} must be [{x.shape[-1]}] for x {_desc(x)}")
    _check_static("rms_norm", "x", x, (-1,), "last dim")
    if not eps > 0:
        raise GraphError(f"rms_norm: eps must be positive, got {eps}")
    return _new("rms_norm", (x, weight), x.shape, x.dtype, name, eps=float(eps))


def moe_mlp(
    x: Tensor, router_logits: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *, top_k: int,
    normalize: bool, name: str | None = None,
) -> Tensor:
    """A mixture of gated-MLP experts, routed per row (Qwen3-MoE's sparse block).

    ``x: [..., K]``, ``router_logits: [..., E]`` (the router's ``linear``), expert weights stacked
    on a leading expert axis: ``w_gate``, ``w_up: [E, F, K]``, ``w_down: [E, K, F]``. Each row's
    routing weights are the ``top_k`` largest of ``softmax(router_logits)`` (in f32; divided by
    their sum when ``normalize``, the checkpoint's ``norm_topk_prob``; then rounded to x's dtype),
    and the result is ``sum_j p_j * down_e(silu(gate_e(x)) * up_e(x))`` over the chosen experts
    ``e`` (f32 sum, rounded once). Only the chosen experts' weights are read.
    """
    op = "moe_mlp"
    _check_float(op, x, router_logits, w_gate, w_up, w_down)
    _check_same_dtype(op, x, w_gate, w_up, w_down)
    if any(w.ndim != 3 for w in (w_gate, w_up, w_down)) or x.ndim < 1 or router_logits.ndim != x.ndim:
        raise ShapeError(f"{op}: expected x [..., K], router_logits [..., E] and expert weights [E, F, K], [E, F, K], "
                         f"[E, K, F]; got {', '.join(_desc(t) for t in (x, router_logits, w_gate, w_up, w_down))}")
    e, f, k = w_gate.shape
    want = {"w_gate": (w_gate, (e, f, k)), "w_up": (w_up, (e, f, k)), "w_down": (w_down, (e, k, f))}
    for label, (w, shape) in want.items():
        if not all(same_dim(a, b) for a, b in zip(w.shape, shape)):
            raise ShapeError(f"{op}: {label} {_desc(w)} does not match w_gate {_desc(w_gate)} "
                             f"(expected {fmt_shape(shape)})")
    if not same_dim(x.shape[-1], k):
        raise ShapeError(f"{op}: x {_desc(x)} has {x.shape[-1]} features, the experts take {k}")
    if not all(same_dim(a, b) for a, b in zip(router_logits.shape, (*x.shape[:-1], e))):
        raise ShapeError(f"{op}: router_logits {_desc(router_logits)} must be [..., {e}] with x's rows {_desc(x)}")
    if not all(d.is_const for w in (w_gate, w_up, w_down) for d in w.shape):
        raise ShapeError(f"{op}: expert weights must have static shapes, got {_desc(w_gate)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e.value:
        raise ShapeError(f"{op}: top_k must be an int in [1, {e.value}] (the number of experts), got {top_k!r}")
    return _new(op, (x, router_logits, w_gate, w_up, w_down), x.shape, x.dtype, name,
                top_k=top_k, normalize=bool(normalize))


def all_reduce(x: Tensor, *, ranks: int, name: str | None = None) -> Tensor:
    """The sum of ``x`` over the ``ranks`` GPUs of a tensor-parallel group (every rank runs the same
    graph on its own shard of the weights and gets the same sum): a row-parallel projection's partial
    results become the full one. Summed in f32, rounded to ``x``'s dtype once. ``x`` must have a
    static shape (its tiles' counters are counted across launches, megaegg/parallel.py)."""
    _check_float("all_reduce", x)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ShapeError(f"all_reduce: ranks must be an int in [1, {MAX_RANKS}], got {ranks!r}")
    if not all(d.is_const for d in x.shape):
        raise ShapeError(f"all_reduce: {_desc(x)} must have a static shape")
    return _new("all_reduce", (x,), x.shape, x.dtype, name, ranks=ranks)


def all_gather(x: Tensor, *, ranks: int, name: str | None = None) -> Tensor:
    """Every rank's ``x`` concatenated along the last dim, in rank order (every rank gets the whole):
    a vocabulary-parallel LM head's logit slices become all the logits. ``x`` must have a static
    shape of one row (``[n]`` or ``[1, ..., 1, n]``); the result is ``[..., ranks * n]``."""
    _check_float("all_gather", x)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ShapeError(f"all_gather: ranks must be an int in [1, {MAX_RANKS}], got {ranks!r}")
    if not all(d.is_const for d in x.shape):
        raise ShapeError(f"all_gather: {_desc(x)} must have a static shape")
    if any(d.value != 1 for d in x.shape[:-1]):
        raise ShapeError(f"all_gather: {_desc(x)} must be one row ([n] or [1, n]); gathering several rows is not supported")
    return _new("all_gather", (x,), (*x.shape[:-1], x.shape[-1] * ranks), x.dtype, name, ranks=ranks)


MAX_RANKS = 8  # GPUs of one host


def softmax(x: Tensor, dim: int = -1, *, name: str | None = None) -> Tensor:
    _check_float("softmax", x)
    return _new("softmax", (x,), x.shape, x.dtype, name, dim=_norm_dim("softmax", x, dim))


# --- rotary embedding ------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Mapping | None = None):
    """RoPE inverse frequencies ``[head_dim // 2]`` (f32), with optional llama3 scaling."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            pass
        elif kind == "llama3":
            factor = scaling["factor"]
            lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
            old = scaling.get("original_max_position_embeddings", 8192)
            lo_wl, hi_wl = old / lo, old / hi
            wl = 2 * math.pi / inv
            scaled = torch.where(wl > lo_wl, inv / factor, inv)
            smooth = (old / wl - lo) / (hi - lo)
            mid = (1 - smooth) * scaled / factor + smooth * scaled
            is_mid = (wl >= hi_wl) & (wl <= lo_wl)
            inv = torch.where(is_mid, mid, scaled)
        else:
            raise GraphError(f"rope: rope scaling type {kind!r} is not supported (supported: default, llama3)")
    return inv.to(torch.float32)


ROPE_ROUNDINGS = ("f32", "hf")


def rope(
    x: Tensor,
    pos: DimLike | Tensor,
    *,
    theta: float = 10000.0,
    scaling: Mapping | None = None,
    inv_freq: Tensor | None = None,
    rounding: str = "f32",
    name: str | None = None,
) -> Tensor:
    """Rotary position embedding, rotate-half form, over the last dim of ``x``.

    ``pos`` is a runtime dim (every row at that position: decode) or an i32 tensor
    ``[T]`` giving the position of each index of ``x``'s first dim. The angles are
    ``f32(pos) * inv_freq`` in f32, their cos and sin torch's. ``rounding``: ``"f32"``
    (``x1 cos - x2 sin``, ``x2 cos + x1 sin`` in f32, rounded once to x's dtype) or ``"hf"``
    (as Hugging Face's ``apply_rotary_pos_emb`` computes in x's dtype: cos and sin rounded
    to it, then each product and each sum); the same in f32.
    """
    _check_float("rope", x)
    if rounding not in ROPE_ROUNDINGS:
        raise ValueError(f"rope: rounding must be one of {ROPE_ROUNDINGS}, got {rounding!r}")
    hf = {"rounding": "hf"} if rounding == "hf" else {}  # (absent: f32, so graphs built before it are unchanged)
    d = x.shape[-1]
    if not d.is_const or d.value % 2:
        raise ShapeError(f"rope: last dim of {_desc(x)} must be a concrete even head dim")
    g = x.graph
    if inv_freq is None:
        inv = rope_inv_freq(d.value, theta, scaling)
        inv_freq = g.constant(f"rope_inv_freq_{len(g.nodes)}", inv)
    elif inv_freq.ndim != 1 or not same_dim(inv_freq.shape[0], d.value // 2) or inv_freq.dtype != f32:
        raise ShapeError(f"rope: inv_freq {_desc(inv_freq)} must be f32[{d.value // 2}]")
    if isinstance(pos, Tensor):
        if pos.dtype != i32 or pos.ndim != 1 or x.ndim < 2 or not same_dim(pos.shape[0], x.shape[0]):
            raise ShapeError(f"rope: positions {_desc(pos)} must be i32[{x.shape[0] if x.ndim else '?'}] for x {_desc(x)}")
        _check_static("rope", "x", x, range(1, x.ndim - 1), "dims between the first and the last")
        return _new("rope", (x, inv_freq, pos), x.shape, x.dtype, name, pos=None, **hf)
    return _new("rope", (x, inv_freq), x.shape, x.dtype, name, pos=as_dim(pos), **hf)


# --- lookup, attention, cache -------------------------------------------------------
def embedding(table: Tensor, ids: Tensor, *, name: str | None = None) -> Tensor:
    """Rows of ``table: [V, D]`` gathered by ``ids`` (i32, any shape) -> ``ids.shape + [D]``."""
    if table.ndim != 2:
        raise ShapeError(f"embedding: table {_desc(table)} must be [V, D]")
    if ids.dtype != i32:
        raise ShapeError(f"embedding: ids {_desc(ids)} must be i32")
    _check_static("embedding", "table", table, (1,), "row width D")
    return _new("embedding", (table, ids), ids.shape + (table.shape[1],), table.dtype, name)


def _check_cache(op: str, cache: Tensor) -> None:
    node = cache.node
    while node.op == "kv_append":
        node = cache.graph.nodes[node.inputs[0]]
    if node.op != "input" or cache.ndim != 3:
        raise ShapeError(f"{op}: cache {_desc(cache)} must be a graph input of shape [kv_heads, max_len, head_dim]")


def kv_append(cache: Tensor, new: Tensor, pos: DimLike, *, name: str | None = None) -> Tensor:
    """Write ``new: [Hkv, D]`` at position ``pos`` of ``cache: [Hkv, Smax, D]`` in place.

    Returns a handle to the updated cache; read it (e.g. with ``attention``) to see
    the new entry. ``pos`` must be below ``Smax`` at run time.
    """
    _check_cache("kv_append", cache)
    _check_same_dtype("kv_append", cache, new)
    if new.ndim != 2 or not same_dim(new.shape[0], cache.shape[0]) or not same_dim(new.shape[1], cache.shape[2]):
        raise ShapeError(f"kv_append: new entry {_desc(new)} must be [{cache.shape[0]}, {cache.shape[2]}] for cache {_desc(cache)}")
    _check_static("kv_append", "cache", cache, (0, 1, 2), "dims [kv_heads, max_len, head_dim]")
    return _new("kv_append", (cache, new), cache.shape, cache.dtype, name, pos=as_dim(pos))


def attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, length: DimLike, *, scale: float | None = None, name: str | None = None
) -> Tensor:
    """Decode attention of one token: ``q: [Hq, D]`` over the first ``length`` cache rows.

    Caches are ``[Hkv, Smax, D]``; grouped-query heads share a KV head when ``Hq``
    is a multiple of ``Hkv`` (q head ``h`` reads KV head ``h // (Hq // Hkv)``).
    """
    _check_float("attention", q, k_cache, v_cache)
    _check_same_dtype("attention", q, k_cache, v_cache)
    for c in (k_cache, v_cache):
        _check_cache("attention", c)
    if q.ndim != 2:
        raise ShapeError(f"attention: q {_desc(q)} must be [heads, head_dim]")
    if k_cache.shape != v_cache.shape:
        raise ShapeError(f"attention: k cache {_desc(k_cache)} and v cache {_desc(v_cache)} differ")
    hq, d = q.shape
    hkv = k_cache.shape[0]
    if not same_dim(d, k_cache.shape[2]):
        raise ShapeError(f"attention: head dim of q {_desc(q)} differs from cache {_desc(k_cache)}")
    _check_static("attention", "q", q, (1,), "head dim")
    if not (hq.is_const and hkv.is_const) or hq.value % hkv.value:
        raise ShapeError(f"attention: q heads of {_desc(q)} must be a multiple of the KV heads of {_desc(k_cache)}")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d.value)
    return _new("attention", (q, k_cache, v_cache), q.shape, q.dtype, name, length=as_dim(length), scale=scale)


def _check_slots_cache(op: str, cache: Tensor) -> None:
    node = cache.node
    while node.op == "kv_store":
        node = cache.graph.nodes[node.inputs[0]]
    if node.op != "input" or cache.ndim != 4 or not all(d.is_const for d in cache.shape):
        raise ShapeError(f"{op}: cache {_desc(cache)} must be a graph input of static shape "
                         "[slots, kv_heads, max_len, head_dim]")


def _check_rows_index(op: str, what: str, t: Tensor, rows: Dim) -> None:
    if t.dtype != i32 or t.ndim != 1 or not same_dim(t.shape[0], rows):
        raise ShapeError(f"{op}: {what} {_desc(t)} must be i32[{rows}] (one per row)")


def _check_pages(op: str, pages: Tensor | None, cache: Tensor) -> tuple[Tensor, ...]:
    """``(pages,)`` for a paged cache (an i32 page table ``[slots, max_pages]`` of static shape), else ``()``."""
    if pages is None:
        return ()
    if not isinstance(pages, Tensor):
        raise GraphError(f"{op}: pages must be a Tensor (an i32 page table [slots, max_pages]), got {type(pages).__name__}")
    if pages.dtype != i32 or pages.ndim != 2 or not all(d.is_const for d in pages.shape):
        raise ShapeError(f"{op}: pages {_desc(pages)} must be an i32 page table [slots, max_pages] of static shape "
                         f"(the pages of cache {_desc(cache)} a sequence's rows are in, in order)")
    return (pages,)


def cache_rows(cache: Tensor, pages: Tensor | None = None) -> int:
    """Rows a sequence of ``cache`` holds: its ``max_len``, or with a page table ``max_pages * page_len``."""
    return cache.shape[2].value * (pages.shape[1].value if pages is not None else 1)


def kv_store(cache: Tensor, new: Tensor, pos: Tensor, slot: Tensor, *, pages: Tensor | None = None,
             name: str | None = None) -> Tensor:
    """Write row ``i`` of ``new: [N, Hkv, D]`` at position ``pos[i]`` of sequence slot ``slot[i]`` of
    ``cache: [slots, Hkv, max_len, D]``, in place (a batch of sequences, or a prompt's tokens).

    ``pos`` and ``slot`` are i32 ``[N]`` tensors read on the device; two rows must not write the
    same (slot, position). An index outside the cache is a run-time error naming the op.

    Paged (``pages``, an i32 page table ``[slots, max_pages]``): ``cache`` is a pool of pages ``[pages,
    Hkv, page_len, D]`` and position ``p`` of sequence ``s`` is row ``p % page_len`` of page
    ``pages[s, p // page_len]``, so a sequence holds only the pages its rows need, and sequences may
    share a prefix's pages.
    """
    op = "kv_store"
    _check_slots_cache(op, cache)
    paged = _check_pages(op, pages, cache)
    _check_same_dtype(op, cache, new)
    _, hkv, _, d = cache.shape
    if new.ndim != 3 or not same_dim(new.shape[1], hkv) or not same_dim(new.shape[2], d):
        raise ShapeError(f"{op}: new rows {_desc(new)} must be [N, {hkv}, {d}] for cache {_desc(cache)}")
    _check_rows_index(op, "pos", pos, new.shape[0])
    _check_rows_index(op, "slot", slot, new.shape[0])
    return _new(op, (cache, new, pos, slot, *paged), cache.shape, cache.dtype, name)


def ragged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, slot: Tensor, *, length: DimLike | None = None,
    sequences: DimLike | None = None, scale: float | None = None, pages: Tensor | None = None, name: str | None = None,
) -> Tensor:
    """Attention of ``N`` rows, each over its own sequence: row ``i`` (``q[i]: [Hq, D]``) attends
    cache rows ``[0, pos[i]]`` of slot ``slot[i]`` (causal: a prompt's token sees itself and the
    tokens before it, once :func:`kv_store` wrote them). Caches are ``[slots, Hkv, max_len, D]``;
    grouped-query heads share a KV head as in :func:`attention`. Returns ``[N, Hq, D]``.

    ``length``, a runtime dim (default ``max_len``), bounds every ``pos[i] + 1``: the kernel splits
    only that many cache rows, so a step at short positions launches no empty work. A row past it
    is an error. ``sequences``, a runtime dim, about how many sequences (distinct slots) the rows are of,
    only steers the schedule: a tile of a prompt's rows that holds rows of other sequences too (a mixed
    step's decode rows) spreads its one pass a sequence over up to 8 instances.

    Paged (``pages``): the caches are pools of pages read through the page table, as :func:`kv_store`
    writes them; ``length`` defaults to ``max_pages * page_len``.
    """
    op = "ragged_attention"
    _check_float(op, q, k_cache, v_cache)
    _check_same_dtype(op, q, k_cache, v_cache)
    for c in (k_cache, v_cache):
        _check_slots_cache(op, c)
    if k_cache.shape != v_cache.shape:
        raise ShapeError(f"{op}: k cache {_desc(k_cache)} and v cache {_desc(v_cache)} differ")
    if q.ndim != 3:
        raise ShapeError(f"{op}: q {_desc(q)} must be [N, heads, head_dim]")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    if not same_dim(d, k_cache.shape[3]):
        raise ShapeError(f"{op}: head dim of q {_desc(q)} differs from cache {_desc(k_cache)}")
    if not hq.is_const or hq.value % hkv.value:
        raise ShapeError(f"{op}: q heads of {_desc(q)} must be a multiple of the KV heads of {_desc(k_cache)}")
    _check_rows_index(op, "pos", pos, q.shape[0])
    _check_rows_index(op, "slot", slot, q.shape[0])
    paged = _check_pages(op, pages, k_cache)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d.value)
    length = as_dim(length) if length is not None else as_dim(cache_rows(k_cache, pages))
    sequences = as_dim(sequences) if sequences is not None else None
    return _new(op, (q, k_cache, v_cache, pos, slot, *paged), q.shape, q.dtype, name, scale=scale, length=length,
                sequences=sequences)


def sample(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, counter: Tensor, *,
    name: str | None = None,
) -> Tensor:
    """A token drawn from each row of ``logits: [R, V]`` (i32[R]), on the device.

    Per row: ``temperature`` f32 (0: greedy, the argmax), ``top_k`` i32 (0: every token), ``top_p``
    f32 (1: every token), and ``seed``, ``counter`` i32, whose hash is the row's random draw: the
    same seed and counter give the same token. The rule is :mod:`megaegg.sampling`'s:
    ``softmax(logits / temperature)`` restricted to the top-k, then the top-p, renormalised.
    """
    op = "sample"
    _check_float(op, logits)
    if logits.ndim != 2:
        raise ShapeError(f"{op}: logits {_desc(logits)} must be [rows, vocab]")
    _check_static(op, "logits", logits, (1,), "vocab")
    rows = logits.shape[0]
    for what, t, dt in (("temperature", temperature, f32), ("top_k", top_k, i32), ("top_p", top_p, f32),
                        ("seed", seed, i32), ("counter", counter, i32)):
        if t.dtype != dt or t.ndim != 1 or not same_dim(t.shape[0], rows):
            raise ShapeError(f"{op}: {what} {_desc(t)} must be {dt}[{rows}] (one per row of {_desc(logits)})")
    return _new(op, (logits, temperature, top_k, top_p, seed, counter), (rows,), i32, name)


def argmax(x: Tensor, dim: int = -1, *, name: str | None = None) -> Tensor:
    """Index of the largest element along ``dim`` (first one on ties), as i32."""
    d = _norm_dim("argmax", x, dim)
    return _new("argmax", (x,), x.shape[:d] + x.shape[d + 1 :], i32, name, dim=d)


# --- views and data movement ---------------------------------------------------------
@operator
def reshape(x: Tensor, shape: Sequence[DimLike], *, name: str | None = None) -> Tensor:
    """A view with a new shape of the same element count; one entry may be -1."""
    shape = list(shape)
    holes = [i for i, s in enumerate(shape) if isinstance(s, int) and s == -1]
    if len(holes) > 1:
        raise ShapeError(f"reshape: at most one -1 allowed, got {shape} for {_desc(x)}")
    check_static_dims(f"reshape of {_desc(x)}", shape, skip=holes)
    numel = product(x.shape)  # element counts compared as products, up to factor order
    if holes:
        hole = numel.quotient(product(s for i, s in enumerate(shape) if i != holes[0]))
        if hole is None:
            raise ShapeError(f"reshape: cannot infer -1 in {shape} for {_desc(x)}")
        shape[holes[0]] = hole.dim()  # the factors the other entries lack
    shape = tuple(as_dim(s) for s in shape)
    if product(shape) != numel:
        raise ShapeError(f"reshape: {_desc(x)} cannot become {fmt_shape(shape)}: element counts differ")
    return _new("reshape", (x,), shape, x.dtype, name, shape=shape)


def permute(x: Tensor, dims: Sequence[int], *, name: str | None = None) -> Tensor:
    dims = tuple(_norm_dim("permute", x, d) for d in dims)
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute: {dims} is not a permutation of the dims of {_desc(x)}")
    return _new("permute", (x,), tuple(x.shape[d] for d in dims), x.dtype, name, dims=dims)


@operator
def transpose(x: Tensor, d0: int, d1: int, *, name: str | None = None) -> Tensor:
    dims = list(range(x.ndim))
    a, b = _norm_dim("transpose", x, d0), _norm_dim("transpose", x, d1)
    dims[a], dims[b] = dims[b], dims[a]
    return permute(x, dims, name=name)


def slice(x: Tensor, dim: int, start: DimLike, stop: DimLike, *, name: str | None = None) -> Tensor:  # noqa: A001
    """Elements ``start:stop`` along ``dim`` (a view); runtime bounds are checked at each call."""
    d = _norm_dim("slice", x, dim)
    start, stop, size = as_dim(start), as_dim(stop), x.shape[d]
    width = canonical(stop - start)  # (S + 16) - S is 16: a static width
    width = width if width.is_const else stop - start
    if (start.is_const and stop.is_const and not 0 <= start.value <= stop.value) or (width.is_const and width.value < 0):
        raise ShapeError(f"slice: bad range {start}:{stop} on dim {d} of {_desc(x)}")
    if stop.is_const and size.is_const and stop.value > size.value or width.is_const and size.is_const and width.value > size.value:
        raise ShapeError(f"slice: stop {stop} exceeds dim {d} of {_desc(x)}")
    shape = x.shape[:d] + (width,) + x.shape[d + 1 :]
    return _new("slice", (x,), shape, x.dtype, name, dim=d, start=start, stop=stop)


def expand(x: Tensor, shape: Sequence[DimLike], *, name: str | None = None) -> Tensor:
    """Broadcast size-1 (or missing leading) dims to ``shape`` without copying."""
    shape = tuple(as_dim(s) for s in shape)
    check_static_dims(f"expand of {_desc(x)}", shape)
    if len(shape) < x.ndim:
        raise ShapeError(f"expand: {fmt_shape(shape)} has fewer dims than {_desc(x)}")
    for have, want in zip(x.shape, shape[len(shape) - x.ndim :]):
        if not (same_dim(have, want) or (have.is_const and have.value == 1)):
            raise ShapeError(f"expand: {_desc(x)} cannot expand to {fmt_shape(shape)}")
    return _new("expand", (x,), shape, x.dtype, name, shape=shape)


def concat(tensors: Sequence[Tensor], dim: int = 0, *, name: str | None = None) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("concat: needs at least one tensor")
    first = tensors[0]
    d = _norm_dim("concat", first, dim)
    _check_same_dtype("concat", *tensors)
    total = first.shape[d]
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(
            not same_dim(a, b) for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != d
        ):
            raise ShapeError(f"concat: {_desc(t)} does not match {_desc(first)} outside dim {d}")
        total = total + t.shape[d]
    return _new("concat", tensors, first.shape[:d] + (total,) + first.shape[d + 1 :], first.dtype, name, dim=d)


def cast(x: Tensor, dtype, *, name: str | None = None) -> Tensor:
    return _new("cast", (x,), x.shape, as_dtype(dtype), name)

"""The ATen ops ``from_torch`` takes: one entry an op, each building its megaegg ops (``megaegg/ops.py``).

An entry is ``fn(t, node, args, kwargs) -> Tensor | None``: ``args`` / ``kwargs`` are the node's own,
with its input nodes already replaced by their megaegg tensors; ``t.shape(node)`` is its result's shape
as megaegg dims (``export.Translator``). ``None``: the op has no value (an assert).
Adding an op: one entry here; where a pattern of ops should become a fused block op, a rewrite rule in
``rewrite/rules.py`` (docs/frontend.md).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from .. import ops
from . import cache_ops, routed_ops  # noqa: F401  (torch.ops.megaegg.*: the table names them)
from ..dtypes import DType, bf16, f16, f32, i32

Entry = Callable[[Any, Any, list, dict], Any]


class UnsupportedTorch(ValueError):
    """What the frontend cannot translate: the op, and the source line it came from."""


DTYPES: dict[torch.dtype, DType] = {torch.bfloat16: bf16, torch.float16: f16, torch.float32: f32, torch.int32: i32,
                                    torch.int64: i32}  # (int64 ids and positions run as i32)


def dtype_of(t: torch.dtype, what: str) -> DType:
    if t not in DTYPES:
        raise UnsupportedTorch(f"{what}: dtype {t} is not supported (bf16, f16, f32, int32, int64)")
    return DTYPES[t]


def _padded(args: list, defaults: list) -> list:
    """``args`` with the op's defaults for the positions not given (``defaults`` covers every position)."""
    return list(args) + defaults[len(args):]


def _only(name: str, given: Any, allowed: Any) -> None:
    if given != allowed:
        raise UnsupportedTorch(f"{name}={given!r} is not supported (only {allowed!r})")


def _tensor(op: str, v: Any, what: str):
    if not isinstance(v, ops.Tensor):
        raise UnsupportedTorch(f"{op}: {what} must be a tensor, got {type(v).__name__} {v!r} (scalar operands are not supported)")
    return v


def _linear(t, node, args, kwargs):
    x, w, bias = _padded(args, [None, None, None])
    y = ops.linear(x, w)
    return y if bias is None else ops.add(y, bias)


def _rms_norm(t, node, args, kwargs):
    x, shape, weight, eps = _padded(args, [None, None, None, None])
    if list(shape) != [x.shape[-1].value if x.shape[-1].is_const else None]:
        raise UnsupportedTorch(f"rms_norm over {list(shape)}: only the last dim ({x.shape[-1]}) is supported")
    if weight is None:
        raise UnsupportedTorch("rms_norm without a weight is not supported")
    return ops.rms_norm(x, weight, float(torch.finfo(node.args[0].meta["val"].dtype).eps if eps is None else eps))


def _add(t, node, args, kwargs):
    a, b = _tensor("add", args[0], "a"), _tensor("add", args[1], "b")
    _only("add: alpha", kwargs.get("alpha", 1), 1)
    return ops.add(a, b)


def _scalars_as_tensors(t, node, op: str, a: Any, b: Any) -> tuple:
    """``a``, ``b`` with a Python number among them as a [1] constant of the other's dtype, broadcast by the
    elementwise op. Only where that constant is what torch computes with: torch takes the number in f32
    (``bf16_x * 0.1`` uses f32(0.1), which a bf16 constant would round), and an integer tensor by a float
    is a float result."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(a) and number(b) or not (number(a) or number(b)):
        return _tensor(op, a, "a"), _tensor(op, b, "b")
    x, c = (b, a) if number(a) else (a, b)
    if not x.dtype.is_float and isinstance(c, float):
        raise UnsupportedTorch(f"{op} of an integer tensor by the float {c!r}: torch's result would be float")
    value = torch.tensor([c], dtype=x.dtype.torch)
    if x.dtype.is_float and value.float().item() != torch.tensor(c, dtype=torch.float32).item():
        raise UnsupportedTorch(f"{op} by the scalar {c!r}: not exact in {x.dtype}, where torch keeps it in f32 "
                               "(pass it as a tensor, or use an f32 input)")
    const = t.graph.constant(f"{node.name}_scalar", value)
    return (const, x) if number(a) else (x, const)


def _sub(t, node, args, kwargs):
    _only("sub: alpha", kwargs.get("alpha", 1), 1)
    return ops.sub(*_scalars_as_tensors(t, node, "sub", args[0], args[1]))


def _div(t, node, args, kwargs):
    _only("div: rounding_mode", kwargs.get("rounding_mode"), None)
    return ops.div(*_scalars_as_tensors(t, node, "div", args[0], args[1]))


def _mul(t, node, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(b, (int, float)) and not isinstance(b, bool) and b == 1:  # (x * 1.0: HF's default rotary scale)
        return _tensor("mul", a, "a")
    return ops.mul(*_scalars_as_tensors(t, node, "mul", a, b))


def _add_tensor_or_scalar(t, node, args, kwargs):
    a, b = args[0], args[1]
    if isinstance(a, ops.Tensor) and isinstance(b, (int, float)) and not isinstance(b, bool):
        _only("add: alpha", kwargs.get("alpha", 1), 1)
        return ops.add_scalar(a, b)
    return _add(t, node, args, kwargs)


def _mean(t, node, args, kwargs):
    x, dims, keepdim = _padded(args, [None, None, False])
    if dims is None or len(dims) != 1:
        raise UnsupportedTorch(f"mean over {dims}: only one dim is supported")
    return ops.mean(x, dims[0], keepdim)


def _softmax(t, node, args, kwargs):
    x, dim = args[0], args[1]
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 and not isinstance(args[2], bool) else None)
    if dtype is not None:
        x = _cast_to(x, dtype)
    return ops.softmax(x, dim)


def _cast_to(x, dtype: torch.dtype):
    d = dtype_of(dtype, "cast")
    return x if d == x.dtype else ops.cast(x, d)


def _to(t, node, args, kwargs):
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
    return args[0] if dtype is None else _cast_to(args[0], dtype)


def _reshape(t, node, args, kwargs):  # the result's own sizes: -1 and symbolic products already resolved
    return ops.reshape(args[0], t.shape(node))


def _slice(t, node, args, kwargs):
    x, dim, start, end, step = _padded(args, [None, 0, None, None, 1])
    d = dim % x.ndim
    size = x.shape[d]
    if step != 1:
        return _strided_slice(x, d, start, end, step)
    start = 0 if start is None else start
    if end is None or (isinstance(end, int) and size.is_const and end >= size.value) or end == sys.maxsize:
        end = size
    # a negative bound counts from the end (x[-1:], transformers' logits_to_keep), also of a runtime size;
    # past either end it is clamped where the size is known, as torch does
    if size.is_const:
        n = size.value
        clamp = lambda b: b if not isinstance(b, int) else min(max(b + n if b < 0 else b, 0), n)  # noqa: E731
        start, end = clamp(start), clamp(end)
    else:
        start = size + start if isinstance(start, int) and start < 0 else start
        end = size + end if isinstance(end, int) and end < 0 else end
    return ops.slice(x, d, start, end)


def _strided_slice(x, d, start, end, step):
    """x[..., start::step] along d (interleaved RoPE's x[..., ::2], x[..., 1::2]): the dim viewed as
    [size / step, step], one column of it taken, the column axis dropped. A static size that is a
    multiple of the step, running to the end."""
    size = x.shape[d]
    start = 0 if start is None else start
    if not (size.is_const and isinstance(step, int) and step > 1 and size.value % step == 0 and isinstance(start, int)
            and 0 <= start < step and (end is None or end == sys.maxsize or (isinstance(end, int) and end >= size.value))):
        raise UnsupportedTorch(f"slice with step {step}: only start::step to the end of a static dim that is a "
                               "multiple of the step is supported")
    shape = list(x.shape)
    y = ops.reshape(x, shape[:d] + [size.value // step, step] + shape[d + 1:])
    y = ops.slice(y, d + 1, start, start + 1)
    return ops.reshape(y, shape[:d] + [size.value // step] + shape[d + 1:])


def _stack(t, node, args, kwargs):
    tensors, dim = _padded(args, [None, 0])
    d = dim % (tensors[0].ndim + 1)
    parts = [ops.reshape(v, list(v.shape[:d]) + [1] + list(v.shape[d:])) for v in tensors]
    return ops.concat(parts, d)


def _split(t, node, args, kwargs):
    """aten.split.Tensor (pieces of ``size``, the last smaller), split_with_sizes (``sizes``): slices of x."""
    x, size, dim = _padded(args, [None, None, 0])
    d = dim % x.ndim
    total = x.shape[d]
    if isinstance(size, (list, tuple)):
        sizes = list(size)
    else:
        if not total.is_const or not isinstance(size, int) or size <= 0:
            raise UnsupportedTorch("split of a runtime-sized dim into pieces of a size is not supported")
        sizes = [min(size, total.value - k) for k in range(0, total.value, size)]
    out, start = [], 0
    for n in sizes:
        out.append(ops.slice(x, d, start, start + n))
        start = start + n
    return out


def _repeat_interleave(t, node, args, kwargs):
    """Each element r times in a row along ``dim`` (interleaved RoPE's cos / sin): r copies of x with a new
    axis after ``dim``, concatenated along it, then the two axes merged."""
    x, repeats, dim = _padded(args, [None, None, kwargs.get("dim")])
    if dim is None or not isinstance(repeats, int) or repeats < 1:
        raise UnsupportedTorch("repeat_interleave needs a dim and an int repeat count")
    d = dim % x.ndim
    shape = list(x.shape)
    y = ops.reshape(x, shape[:d + 1] + [1] + shape[d + 1:])
    y = ops.concat([y] * repeats, d + 1)
    return ops.reshape(y, shape[:d] + [shape[d] * repeats] + shape[d + 1:])


def _chunk(t, node, args, kwargs):
    x, chunks, dim = _padded(args, [None, None, 0])
    total = x.shape[dim % x.ndim]
    if not total.is_const:
        raise UnsupportedTorch("chunk of a runtime-sized dim is not supported")
    return _split(t, node, [x, -(-total.value // chunks), dim], {})


def _matmul(t, node, args, kwargs):
    """``a @ b``: b a matrix, or a batched product over an inner dim of 1 (an outer product: Hugging Face's
    RoPE computes its angles as ``inv_freq[..., None] @ position_ids[:, None, :]``), or b batched over dims
    of size 1 only."""
    a, b = args[0], args[1]
    if b.ndim > 2 and a.ndim >= 2 and a.shape[-1].is_const and a.shape[-1].value == 1 and \
            b.shape[-2].is_const and b.shape[-2].value == 1:
        return ops.mul(a, b)  # (broadcast: [..., M, 1] * [..., 1, N])
    if b.ndim > 2 and all(d.is_const and d.value == 1 for d in b.shape[:-2]):
        b = ops.reshape(b, list(b.shape[-2:]))
    return ops.matmul(a, b)


def _argmax(t, node, args, kwargs):
    x, dim, keepdim = _padded(args, [None, None, False])
    if dim is None or keepdim:
        raise UnsupportedTorch("argmax needs a dim and keepdim=False")
    return ops.argmax(x, dim)


def _identity(t, node, args, kwargs):
    return args[0]


def _dropout(t, node, args, kwargs):
    if _padded(args, [None, 0.5, False])[2]:
        raise UnsupportedTorch("dropout in training mode is not supported (call module.eval() before exporting)")
    return args[0]


def _nothing(t, node, args, kwargs):
    return None


ATEN: dict[str, Entry] = {
    "aten.linear.default": _linear,
    "aten.embedding.default": lambda t, node, args, kwargs: ops.embedding(args[0], args[1]),
    "aten.rms_norm.default": _rms_norm,
    "aten.silu.default": lambda t, node, args, kwargs: ops.silu(args[0]),
    "aten.sigmoid.default": lambda t, node, args, kwargs: ops.sigmoid(args[0]),
    "aten.gelu.default": lambda t, node, args, kwargs: ops.gelu(args[0], kwargs.get("approximate", "none")),
    "aten.tanh.default": lambda t, node, args, kwargs: ops.tanh(args[0]),
    "aten.exp.default": lambda t, node, args, kwargs: ops.exp(args[0]),
    "aten.cos.default": lambda t, node, args, kwargs: ops.cos(args[0]),
    "aten.sin.default": lambda t, node, args, kwargs: ops.sin(args[0]),
    "aten.add.Tensor": _add_tensor_or_scalar,
    # primitives of written-out patterns (RMSNorm as Hugging Face writes it: rewrite/rules.py)
    "aten.pow.Tensor_Scalar": lambda t, node, args, kwargs: ops.pow(args[0], args[1]),
    "aten.mean.dim": _mean,
    "aten.rsqrt.default": lambda t, node, args, kwargs: ops.rsqrt(args[0]),
    "aten.mul.Tensor": _mul,
    "aten.sub.Tensor": _sub,
    "aten.div.Tensor": _div,
    "aten.div.Tensor_mode": _div,
    "aten.mul.Scalar": _mul,
    "aten.div.Scalar": _div,
    "aten.sub.Scalar": _sub,
    "aten.rsub.Scalar": lambda t, node, args, kwargs: _sub(t, node, [args[1], args[0]], kwargs),  # (c - x)
    "aten.rsub.Tensor": lambda t, node, args, kwargs: _sub(t, node, [args[1], args[0]], kwargs),
    "aten.neg.default": lambda t, node, args, kwargs: ops.neg(args[0]),
    "aten.softmax.int": _softmax,
    "aten._softmax.default": lambda t, node, args, kwargs: ops.softmax(args[0], args[1]),
    "aten.matmul.default": _matmul,
    "aten.mm.default": lambda t, node, args, kwargs: ops.matmul(args[0], args[1]),
    "aten.reshape.default": _reshape,
    "aten.view.default": _reshape,
    "aten._unsafe_view.default": _reshape,
    "aten.unsqueeze.default": _reshape,
    "aten.squeeze.dim": _reshape,
    "aten.flatten.using_ints": _reshape,
    "aten.transpose.int": lambda t, node, args, kwargs: ops.transpose(args[0], args[1], args[2]),
    "aten.t.default": lambda t, node, args, kwargs: ops.transpose(args[0], 0, 1),
    "aten.permute.default": lambda t, node, args, kwargs: ops.permute(args[0], args[1]),
    "aten.slice.Tensor": _slice,
    "aten.split.Tensor": _split,
    "aten.split_with_sizes.default": _split,
    "aten.chunk.default": _chunk,
    "aten.repeat_interleave.self_int": _repeat_interleave,
    "aten.stack.default": _stack,
    "aten.cat.default": lambda t, node, args, kwargs: ops.concat(args[0], (args + [0])[1]),
    "aten.argmax.default": _argmax,
    "aten.to.dtype": _to,
    "aten.to.dtype_layout": _to,
    "aten.to.device": _to,  # (the device is the kernel's)
    "aten._to_copy.default": _to,
    "aten.type_as.default": lambda t, node, args, kwargs: _cast_to(args[0], node.args[1].meta["val"].dtype),
    "aten.contiguous.default": _identity,
    "aten.clone.default": _identity,
    "aten.alias.default": _identity,
    "aten.detach.default": _identity,
    "aten.dropout.default": _dropout,
    "aten._assert_tensor_metadata.default": _nothing,
    # a KV cache (cache_ops.py): the row at ctx - 1 written in place, the first ctx rows attended
    "megaegg.kv_append.default": lambda t, node, args, kwargs: ops.kv_append(args[0], args[1], args[2].shape[0] - 1),
    "megaegg.attention.default": lambda t, node, args, kwargs: ops.attention(args[0], args[1], args[2], args[3].shape[0],
                                                                             scale=args[4]),
    # a prompt's or a batch's rows: each at its own (slot, position); bound's length bounds every position + 1
    "megaegg.kv_store.default": lambda t, node, args, kwargs: ops.kv_store(*args),
    "megaegg.moe_mlp.default": lambda t, node, args, kwargs: ops.moe_mlp(*args[:5], top_k=args[5], normalize=args[6]),
    "megaegg.ragged_attention.default": lambda t, node, args, kwargs: ops.ragged_attention(
        *args[:5], length=args[5].shape[0], scale=args[6]),
}


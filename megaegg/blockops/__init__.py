"""The block-op registry: every kind in ``REGISTRY``, every rewrite term in ``TERMS`` (importing
this package registers them all).

One module a block op (``base.py``: :class:`BlockKind`, :class:`Term`, ``register``, ``term``,
``fields``): ``matvec`` (+ ``matmul_rows``), ``matvec_split`` (a batch's narrow projections split over K), ``gemm`` (tensor-core tiles for many rows), ``matvec_heads`` (QKV + RoPE + KV append),
``matvec_argmax`` (LM head + argmax partials), ``glu_down`` (gated MLP + down projection as an f32
sum, ``acc_residual``), ``moe`` (routed experts, one row), ``moe_rows`` (routed experts over many rows, grouped by expert), ``attention`` (split-KV decode attention),
``ragged_attention`` (batches and prompts; ``flash_attention``: prompts on tensor cores), ``rownorm``, ``rope``, ``softmax``, ``argmax``,
``embedding``, ``kv_append``, ``kv_store``, ``sample``, ``elementwise`` (+ ``concat``, copies:
``materialize``), ``all_reduce`` (tensor-parallel peer ops). docs/pipeline.md, "Adding a block op".
"""

from . import (  # noqa: F401
    all_reduce, argmax, attention, elementwise, embedding, flash_attention, gemm, glu_down, kv_append, kv_store, matvec, matvec_argmax, matvec_heads, matvec_split,
    moe, moe_rows,
    ragged_attention, rope, rownorm, sample, softmax,
)
from .base import NONE, REGISTRY, TERMS, BlockKind, CudaOperand, Partition, Term, fields, register, term
from .elementwise import materialize

__all__ = ["NONE", "REGISTRY", "TERMS", "BlockKind", "CudaOperand", "Partition", "Term", "fields", "materialize",
           "register", "term"]

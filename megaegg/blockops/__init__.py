"""Block-op kinds and their rewrite terms. Importing this package registers every kind in
``REGISTRY`` and every term in ``TERMS``."""

from . import (  # noqa: F401
    all_reduce, argmax, attention, elementwise, embedding, glu_down, kv_append, kv_store, matvec, matvec_argmax, matvec_heads, moe,
    ragged_attention, rope, rownorm, sample, softmax,
)
from .base import REGISTRY, TERMS, BlockKind, CudaOperand, Partition, Term
from .elementwise import materialize

__all__ = ["REGISTRY", "TERMS", "BlockKind", "CudaOperand", "Partition", "Term", "materialize"]

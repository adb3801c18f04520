"""Block-op kinds. Importing this package registers every kind in ``REGISTRY``."""

from . import argmax, attention, elementwise, embedding, kv_append, matvec, matvec_argmax, matvec_heads, rope, rownorm, softmax  # noqa: F401
from .base import REGISTRY, BlockKind, CudaOperand, Partition

__all__ = ["REGISTRY", "BlockKind", "CudaOperand", "Partition"]

"""Block-op kinds. Importing this package registers every kind in ``REGISTRY``."""

from . import (  # noqa: F401
    argmax, attention, elementwise, embedding, glu_down, kv_append, matvec, matvec_argmax, matvec_heads, rope, rownorm, softmax,
)
from .base import REGISTRY, BlockKind, CudaOperand, Partition

__all__ = ["REGISTRY", "BlockKind", "CudaOperand", "Partition"]

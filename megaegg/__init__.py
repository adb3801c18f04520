"""megaegg: compile a whole model forward pass into one persistent CUDA kernel.

Build a :class:`Graph` of tensor ops over symbolic dims, check it with
:func:`run_reference`, and compile it with :func:`compile`; or take a PyTorch module or function
through ``torch.export`` with :func:`from_torch`; or a Hugging Face causal LM through its own modelling
code with :func:`from_transformers`.
"""

from .dims import Dim, ceildiv, dmax, dmin, sym
from .dtypes import DType, bf16, f16, f32, i32
from .graph import Graph, GraphError, ShapeError, Tensor
from .ops import (
    add, all_gather, all_reduce, argmax, attention, cast, concat, embedding, expand, kv_append, kv_store, linear, matmul, moe_mlp, mul, permute,
    ragged_attention, reshape, rms_norm, rope, rope_inv_freq, sample, silu, slice, softmax, transpose,
)
from .reference import run_reference, run_reference_ranks
from .compiler import Artifact, Kernel, compile
from .frontend import from_torch
from .frontend.hf import from_transformers

__all__ = [
    "Dim", "ceildiv", "dmax", "dmin", "sym", "DType", "bf16", "f16", "f32", "i32", "Graph", "GraphError",
    "ShapeError", "Tensor", "add", "all_gather", "all_reduce", "argmax", "attention", "cast", "concat", "embedding", "expand", "kv_append",
    "kv_store", "linear", "matmul", "moe_mlp", "mul", "permute", "ragged_attention", "reshape", "rms_norm", "rope",
    "rope_inv_freq", "sample", "silu", "slice", "softmax", "transpose", "run_reference", "run_reference_ranks", "compile", "Kernel", "Artifact",
    "from_torch", "from_transformers",
]

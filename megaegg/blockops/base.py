"""The block-op registry: each kind is defined in ONE module of this package.

A kind declares how a block op of that kind is partitioned (``build``: launch grid
and read/write footprints), what one instance computes on the CPU (``cpu``: the
living definition the simulator runs and the CUDA body is tested against), how the
CUDA interpreter calls its device body (``cuda_call``, body in ``<name>.cuh``; with
``waits_in_body`` the body does its own barrier waits) and what it costs
(``estimate``). Opcodes, the interpreter's switch and the simulator's dispatch are
generated from :data:`REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

import torch

from ..dims import Dim
from .footprint import Footprint

if TYPE_CHECKING:
    from ..rewrite.program import BlockOp, Operand

REGISTRY: dict[str, "BlockKind"] = {}


def register(cls: type["BlockKind"]) -> type["BlockKind"]:
    if cls.name in REGISTRY:
        raise ValueError(f"block op kind {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls()
    return cls


@dataclass(frozen=True)
class Partition:
    """What ``build`` returns: the launch grid and per-operand footprints."""

    grid: tuple[Dim, ...]
    reads: tuple[Footprint, ...]
    writes: Footprint


@dataclass(frozen=True)
class CudaOperand:
    """How generated CUDA addresses one operand: base pointer and per-dim strides (C exprs)."""

    ptr: str
    strides: tuple[str, ...]
    shape: tuple[str, ...]
    ctype: str


class BlockKind:
    name: ClassVar[str]
    cuda_file: ClassVar[str | None] = None
    # The body takes the instance's barrier waits (a `MegaWaits wl`, last argument) and
    # waits itself, after issuing the loads that need no input (weights): they overlap the
    # hand-off from the previous op. Else the interpreter waits before calling the body.
    waits_in_body: ClassVar[bool] = False

    def build(self, inputs: Sequence["Operand"], output: "Operand", params: dict) -> Partition:
        raise NotImplementedError

    def cpu(self, op: "BlockOp", env: dict, ins: list[torch.Tensor], out: torch.Tensor) -> None:
        """Compute the instance whose grid coordinates (``_i*``) and runtime dims are in ``env``."""
        raise NotImplementedError

    def cuda_call(self, op: "BlockOp", ins: list[CudaOperand], out: CudaOperand) -> str:
        raise NotImplementedError

    def bytes_moved(self, op: "BlockOp", env: dict) -> int:
        """Global-memory bytes of the whole op (all instances), for the cost model."""
        total = 0
        for operand in (*op.inputs, op.output):
            n = 1
            for d in operand.shape:
                n *= d.eval(env)
            total += n * operand.dtype.itemsize
        return total


def dimc(name: str) -> str:
    """C name of a runtime dim (or grid coordinate ``_i*``) inside the interpreter."""
    return f"D_{name}"


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def rms_normed(x: torch.Tensor, g: torch.Tensor, eps: float, dt: torch.dtype) -> torch.Tensor:
    """RMSNorm of f32 rows ``x`` rounded as the unfused op stores it, ``T(T(x * rinv) * g)``; f32."""
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float()
    return (y * f32(g)).to(dt).float()

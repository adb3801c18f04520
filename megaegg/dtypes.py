"""Element types of graph tensors and their torch / C equivalents."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    c_type: str
    is_float: bool

    @property
    def torch(self):
        import torch

        return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}[self.name]

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


bf16 = DType("bf16", 2, "__nv_bfloat16", True)
f16 = DType("f16", 2, "__half", True)
f32 = DType("f32", 4, "float", True)
i32 = DType("i32", 4, "int", False)

ALL = (bf16, f16, f32, i32)


def from_torch(t_dtype) -> DType:
    for d in ALL:
        if d.torch == t_dtype:
            return d
    raise TypeError(f"unsupported torch dtype {t_dtype}; megaegg supports {', '.join(d.name for d in ALL)}")


def as_dtype(x) -> DType:
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        for d in ALL:
            if d.name == x:
                return d
        raise TypeError(f"unknown dtype {x!r}; expected one of {', '.join(d.name for d in ALL)}")
    return from_torch(x)

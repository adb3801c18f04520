"""The megakernel's argument struct, described once: ``MegaArgs``, passed by value
(``__grid_constant__``) on every launch.

From :data:`FIELDS` come both sides of the Python/CUDA boundary: :func:`c_declaration`, the
``struct MegaArgs`` that ``render.py`` puts into ``cuda/megakernel.cu`` (slot ``ARGS``), with a
``static_assert`` of every field's offset and of the size as this module computes them, and
:func:`args_type`, the ``ctypes.Structure`` that ``runtime.py`` fills by field name. If the
compiler ever lays the struct out differently from ctypes, the kernel does not compile.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

from ..ops import MAX_RANKS


@dataclass(frozen=True)
class Field:
    """One member: ``ctype`` of one element; ``count`` elements, a number or a symbol of
    :func:`counts` (an array if not 1); ``comment``: one line, rendered after it."""

    name: str
    ctype: str
    count: int | str = 1
    comment: str = ""


FIELDS = (
    Field("arena", "char*", comment="scratch (lowering/queue.py: MemoryPlan.arena_bytes)"),
    Field("counters", "unsigned*", comment="2 * MEGA_COUNTERS"),
    Field("control", "unsigned long long*", comment="see runtime.cuh"),
    Field("parity", "long long", comment="which counter set this launch uses (0, 1)"),
    Field("trace", "unsigned long long*", comment="MEGA_TRACE builds: MEGA_TRACE_WORDS words per instance"),
    Field("table", "const long long*", comment="render.py: EntryTable.words"),
    Field("tmaps", "const char*", comment="TMA tensor maps, 128 bytes each (tensor_maps.py)"),
    Field("rank", "long long", comment="tensor parallel: this GPU's rank"),
    Field("seq", "long long", comment="tensor parallel: this launch's number (1, 2, ...)"),
    Field("peers", "char*", "MEGA_MAX_RANKS", "every rank's peer region (peer-to-peer addresses), by rank"),
    Field("dims", "long long", "NDIMS", "the runtime dims, in Program.symbols order"),
    Field("ptr", "void*", "NPTRS", "every buffer outside the arena, by MemoryPlan.pointer_slot"),
)

# C macros of megakernel.cu a count may name, and their values (a disagreement fails the offset asserts)
C_MACROS = {"MEGA_MAX_RANKS": MAX_RANKS}

_CTYPES = {"long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
           "int": ctypes.c_int, "unsigned": ctypes.c_uint}


def counts(ndims: int, nptrs: int) -> dict[str, int]:
    """The value of every count symbol, for a program of ``ndims`` runtime dims and ``nptrs`` pointer slots."""
    return {**C_MACROS, "NDIMS": max(1, ndims), "NPTRS": max(1, nptrs)}


def _ctype(c: str):
    # a pointer as a 64-bit address (its size is asserted with the offsets); c_uint64 takes any
    # integer (c_void_p refuses numpy's) and is the cheaper of the two to write
    return ctypes.c_uint64 if c.endswith("*") else _CTYPES[c.removeprefix("const ")]


@lru_cache(maxsize=None)
def args_type(ndims: int, nptrs: int) -> type[ctypes.Structure]:
    """``MegaArgs`` as a ctypes struct (fields by name; ``dims``, ``ptr``, ``peers`` are arrays)."""
    n = counts(ndims, nptrs)
    fields = [(f.name, _ctype(f.ctype) if f.count == 1 else _ctype(f.ctype) * n.get(f.count, f.count)) for f in FIELDS]
    return type("MegaArgs", (ctypes.Structure,), {"_fields_": fields})


def c_declaration(ndims: int, nptrs: int) -> str:
    """``struct MegaArgs`` in C, then a static_assert of every offset and of the size (from :func:`args_type`)."""
    n, t = counts(ndims, nptrs), args_type(ndims, nptrs)
    lines = ["struct MegaArgs {"]
    for f in FIELDS:
        # a macro's name stays (its value is checked below); the program's counts are numbers
        dim = "" if f.count == 1 else f"[{f.count if f.count in C_MACROS else n.get(f.count, f.count)}]"
        decl = f"  {f.ctype} {f.name}{dim};"
        lines.append(f"{decl:<34}// {f.comment}" if f.comment else decl)
    lines.append("};")
    where = "differs from interpreter/kernel_args.py"
    lines += [f'static_assert(__builtin_offsetof(MegaArgs, {f.name}) == {getattr(t, f.name).offset}, '
              f'"MegaArgs.{f.name}: offset {where}");' for f in FIELDS]
    lines.append(f'static_assert(sizeof(MegaArgs) == {ctypes.sizeof(t)}, "MegaArgs: size {where}");')
    return "\n".join(lines)

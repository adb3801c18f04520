"""The compiled artifact, its file format and the on-disk artifact cache.

An :class:`Artifact` is everything a :class:`~megaegg.compiler.Kernel` needs without
recompiling: the work queue (block program, barriers, memory plan), the CUDA source,
the compile-time defines, the cubin and the graph's constants. It is stored as one
zip file (no pickle: loading never runs code):

- ``artifact.json``: a format tag, the code version, defines, timings and the queue,
  encoded by :class:`_Encoder` (only the dataclasses in ``_CLASSES`` can come back);
- ``constants.safetensors``: the graph's constant tensors, by buffer id;
- ``kernel.cu`` and, when compiled, ``kernel.cubin``.

``compile()`` keys artifacts by the graph's structure, dtypes, the compile options and
the code version (:func:`artifact_key`) and keeps them under ``$MEGAEGG_CACHE/artifacts``
(default ``~/.cache/megaegg``), so compiling a graph compiled before, in any process,
skips the rewrite, the barrier derivation and NVRTC.

>>> import torch, megaegg as me, tempfile, pathlib
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32); w = g.weight("w", [32, 64], me.f32)
>>> _ = g.output("y", me.silu(me.linear(x, w)))
>>> art = me.compile(g, {"w": torch.randn(32, 64)}, backend="sim", cache=False).artifact
>>> path = pathlib.Path(tempfile.mkdtemp()) / "silu.megaegg"
>>> art.save(path)
>>> Artifact.load(path).queue.program.ops[0].kind
'matvec'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch

from .dims import Dim
from .dtypes import ALL as _DTYPES
from .dtypes import DType
from .graph import Graph, GraphError

FORMAT = "megaegg-artifact"
FORMAT_VERSION = 1
log = logging.getLogger("megaegg")


class ArtifactError(GraphError):
    """A file that is not a loadable megaegg artifact (corrupt, foreign, or from another code version)."""


@dataclass
class Artifact:
    """Everything needed to run without recompiling: the queue, source, defines, cubin and constants."""

    queue: "WorkQueue"  # noqa: F821 (megaegg.lowering.queue)
    source: str
    table: list[int]  # the entry table the kernel reads (interpreter/render.py: EntryTable)
    cubin: bytes | None
    constants: dict[int, torch.Tensor]
    defines: dict[str, int] = field(default_factory=dict)  # what the source was (or is to be) compiled with
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the artifact to ``path`` (one zip file; written whole, then renamed into place)."""
        from safetensors.torch import save as save_tensors

        path = Path(path)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "code": code_version(),
            "defines": self.defines, "timings": self.timings, "table": list(self.table), "queue": encode(self.queue),
        }
        constants = {str(k): t.contiguous() for k, t in self.constants.items()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
            z.writestr("artifact.json", json.dumps(meta, separators=(",", ":")))
            z.writestr("constants.safetensors", save_tensors(constants) if constants else b"")
            z.writestr("kernel.cu", self.source)
            if self.cubin is not None:
                z.writestr("kernel.cubin", self.cubin)
        os.replace(tmp, path)

    @staticmethod
    def load(path: str | Path) -> "Artifact":
        """Read an artifact written by :meth:`save`; anything else raises :class:`ArtifactError`."""
        from safetensors.torch import load as load_tensors

        path = Path(path)
        try:
            with zipfile.ZipFile(path) as z:
                names = set(z.namelist())
                missing = {"artifact.json", "constants.safetensors", "kernel.cu"} - names
                if missing:
                    raise ArtifactError(f"{path}: not a megaegg artifact (no {', '.join(sorted(missing))})")
                meta = json.loads(z.read("artifact.json"))
                if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                    raise ArtifactError(f"{path}: not a megaegg artifact")
                if meta.get("version") != FORMAT_VERSION or meta.get("code") != code_version():
                    raise ArtifactError(f"{path}: made by another megaegg version (format {meta.get('version')}, "
                                        f"code {str(meta.get('code'))[:12]}; this is {code_version()[:12]}): recompile")
                blob = z.read("constants.safetensors")
                constants = {int(k): t for k, t in load_tensors(blob).items()} if blob else {}
                source = z.read("kernel.cu").decode()
                cubin = z.read("kernel.cubin") if "kernel.cubin" in names else None
            queue = decode(meta["queue"])
            defines = {str(k): int(v) for k, v in meta["defines"].items()}
            table = [int(v) for v in meta["table"]]
            timings = {str(k): float(v) for k, v in meta["timings"].items()}
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise ArtifactError(f"{path}: no such artifact file") from None
        except Exception as e:  # a truncated zip, bad JSON, an unknown class: all mean "not ours"
            raise ArtifactError(f"{path}: not a readable megaegg artifact ({type(e).__name__}: {e})") from None
        from .lowering.queue import WorkQueue

        if not isinstance(queue, WorkQueue):
            raise ArtifactError(f"{path}: not a megaegg artifact (no work queue)")
        return Artifact(queue=queue, source=source, table=table, cubin=cubin, constants=constants, defines=defines,
                        timings=timings)


# --- the cache -------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$MEGAEGG_CACHE``, else ``~/.cache/megaegg`` (artifacts, cubins): delete it to clear the cache."""
    root = Path(os.environ.get("MEGAEGG_CACHE") or Path.home() / ".cache" / "megaegg")
    root.mkdir(parents=True, exist_ok=True)
    return root


def cached_path(key: str) -> Path:
    return cache_dir() / "artifacts" / f"{key}.megaegg"


def load_cached(key: str) -> Artifact | None:
    """The cached artifact of ``key``, or None (absent or unreadable: it is then rebuilt)."""
    path = cached_path(key)
    if not path.exists():
        return None
    try:
        return Artifact.load(path)
    except ArtifactError as e:
        log.warning("artifact cache: ignoring %s", e)
        return None


def store_cached(key: str, art: Artifact) -> None:
    """Best effort: a cache that cannot be written only costs the next compile its time."""
    path = cached_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        art.save(path)
    except (OSError, TypeError) as e:
        log.warning("artifact cache: could not write %s (%s)", path, e)


def artifact_key(graph: Graph, options: Mapping[str, Any]) -> str:
    """Hash of what determines the artifact: the graph (ops, shapes, dtypes, names, attributes,
    constants' values), the compile options and the code version."""
    h = hashlib.sha256()
    h.update(f"{FORMAT}/{FORMAT_VERSION}/{code_version()}\n".encode())
    h.update(repr(sorted((k, _canon(v)) for k, v in options.items())).encode())
    for n in graph.nodes:
        attrs = sorted((k, _canon(v)) for k, v in n.attrs.items() if k != "value")
        h.update(repr((n.op, n.inputs, _canon(n.shape), n.dtype.name, n.name, attrs)).encode())
        if "value" in n.attrs:  # a constant: its bytes
            t = n.attrs["value"].contiguous()
            h.update(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
    h.update(repr(sorted(graph.outputs.items())).encode())
    return h.hexdigest()


def _canon(v: Any) -> Any:
    """A value's structure as plain tuples (a Dim's tree, not its printed form)."""
    if isinstance(v, Dim):
        return ("Dim", v.op, tuple(_canon(a) for a in v.args))
    if isinstance(v, (list, tuple)):
        return tuple(_canon(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _canon(x)) for k, x in v.items()))
    if dataclasses.is_dataclass(v):
        return (type(v).__name__, tuple((f.name, _canon(getattr(v, f.name))) for f in dataclasses.fields(v)))
    return v


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the compiler's own source (Python and CUDA): a changed compiler never reuses an artifact."""
    from . import interpreter, lowering, rewrite

    h = hashlib.sha256()
    roots = [Path(__file__).parent, *(Path(m.__file__).parent for m in (rewrite, lowering, interpreter))]
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".cuh", ".cu") and "models" not in p.relative_to(root).parts:
                h.update(str(p.relative_to(root.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


# --- the queue as JSON -------------------------------------------------------------------------
def _classes() -> dict[str, type]:
    from .blockops.footprint import At, Full, Span, Tile
    from .lowering.barriers import BarrierPlan, BarrierSet, Wait
    from .lowering.queue import MemoryPlan, PeerPlan, QueueEntry, WorkQueue
    from .rewrite.program import BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, View

    return {c.__name__: c for c in (
        At, Full, Span, Tile, BarrierPlan, BarrierSet, Wait, MemoryPlan, PeerPlan, QueueEntry, WorkQueue,
        BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, View)}


class _Encoder:
    """Values as JSON: objects (Dims by value, dataclasses by identity) go into one table,
    children before parents, and are referenced by index, so sharing survives a round trip."""

    def __init__(self) -> None:
        self.table: list = []
        self.index: dict = {}
        self.classes = _classes()

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, tuple):
            return {"t": [self.value(x) for x in v]}
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {"m": [[self.value(k), self.value(x)] for k, x in v.items()]}
        return {"r": self.ref(v)}

    def ref(self, obj: Any) -> int:
        key = obj if isinstance(obj, Dim) else id(obj)
        if key in self.index:
            return self.index[key]
        if isinstance(obj, Dim):
            entry = ["Dim", obj.op, [self.value(a) for a in obj.args]]
        elif isinstance(obj, DType):
            entry = ["DType", obj.name]
        elif self.classes.get(type(obj).__name__) is type(obj):
            entry = [type(obj).__name__, {f.name: self.value(getattr(obj, f.name))
                                          for f in dataclasses.fields(obj) if f.init}]
        else:
            raise TypeError(f"cannot store a {type(obj).__name__} in an artifact")
        self.table.append(entry)
        self.index[key] = len(self.table) - 1
        return self.index[key]


def encode(root: Any) -> dict:
    enc = _Encoder()
    top = enc.value(root)
    return {"table": enc.table, "root": top}


def decode(data: dict) -> Any:
    classes = _classes()
    dtypes = {d.name: d for d in _DTYPES}
    table: list = []

    def value(v: Any) -> Any:
        if isinstance(v, list):
            return [value(x) for x in v]
        if isinstance(v, dict):
            if "t" in v:
                return tuple(value(x) for x in v["t"])
            if "m" in v:
                return {value(k): value(x) for k, x in v["m"]}
            return table[v["r"]]
        return v

    for entry in data["table"]:
        kind = entry[0]
        if kind == "Dim":
            table.append(Dim(entry[1], tuple(value(a) for a in entry[2])))
        elif kind == "DType":
            table.append(dtypes[entry[1]])
        else:
            table.append(classes[kind](**{k: value(x) for k, x in entry[1].items()}))
    return value(data["root"])

"""The compiled artifact, its file format and the on-disk artifact cache.

An :class:`Artifact` is everything a :class:`~megaegg.compiler.Kernel` needs without
recompiling: the work queue (block program, barriers, memory plan), the CUDA source,
the compile-time defines, the cubin and the graph's constants. It is stored as one
zip file (no pickle: loading never runs code):

- ``artifact.json``: a format tag, the code version, the sha256 of every other part
  (``parts``), a ``body`` (the JSON text of the defines, timings, entry table and the
  queue, encoded by :class:`_Encoder`: only the dataclasses of ``_classes()`` can come
  back) and a ``digest``: the sha256 of the canonical JSON of all of that;
- ``constants.safetensors``: the graph's constant tensors, by buffer id;
- ``kernel.cu`` and, when compiled, ``kernel.cubin``; a program with row regimes has one kernel image
  per band: ``kernel.cubin`` is band 0's, ``kernel.1.cubin``, ``kernel.2.cubin``, ... the others'.

:meth:`Artifact.load` checks every hash and validates what it decodes (Dim ops, dtypes,
classes, field names and types), so an edited or corrupt file is an :class:`ArtifactError`
naming the file and the part, never an artifact that is used.

``compile()`` keys artifacts by the graph's structure, dtypes, the compile options and
the code version (:func:`artifact_key`) and keeps them under ``$MEGAEGG_CACHE/artifacts``
(default ``~/.cache/megaegg``), so compiling a graph compiled before, in any process,
skips the rewrite, the barrier derivation and NVRTC. The cache is best effort: an entry
that does not load is rebuilt (one warning), and a cache folder that cannot be used
turns caching off for the process (one warning).

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
import secrets
import types
import typing
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .dims import _BINARY as _DIM_BINARY
from .dims import Dim
from .dtypes import ALL as _DTYPES
from .dtypes import DType
from .graph import Graph, GraphError

FORMAT = "megaegg-artifact"
FORMAT_VERSION = 2  # 2: artifact.json carries the sha256 of every part and a digest of itself
META = "artifact.json"
REQUIRED = (META, "constants.safetensors", "kernel.cu")
MAX_IMAGES = 16  # kernel images an artifact may hold (one a band of row counts: ir/program.py Regime)


def image_part(i: int) -> str:
    """The part holding kernel image ``i`` (band ``i`` of a row regime; 0: the only one without)."""
    return "kernel.cubin" if i == 0 else f"kernel.{i}.cubin"


PARTS = ("constants.safetensors", "kernel.cu", *map(image_part, range(MAX_IMAGES)))  # the parts artifact.json hashes
log = logging.getLogger("megaegg")


class ArtifactError(GraphError):
    """A file that is not a loadable megaegg artifact (corrupt, edited, foreign, or from another code
    version), or an artifact that cannot be saved where asked."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _meta_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``meta`` without its "digest" (what :meth:`Artifact.load` recomputes)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class Artifact:
    """Everything needed to run without recompiling: the queue, source, defines, cubins and constants."""

    queue: "WorkQueue"  # noqa: F821 (megaegg.lowering.queue)
    source: str
    table: list[int]  # the entry table the kernel reads (interpreter/render.py: EntryTable)
    constants: dict[int, torch.Tensor]
    # the kernel images, in band order: one, or one a band of the program's row regime
    # (interpreter/render.py: image_defines); none before NVRTC
    cubins: list[bytes] = field(default_factory=list)
    defines: dict[str, int] = field(default_factory=dict)  # what the source was (or is to be) compiled with
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def images_needed(self) -> int:
        """How many kernel images the queue needs."""
        regime = self.queue.program.regime
        return 1 if regime is None else regime.bands

    @property
    def cubin(self) -> bytes | None:
        """The first kernel image (the only one without a row regime), or None."""
        return self.cubins[0] if self.cubins else None

    @property
    def compiled(self) -> bool:
        """Whether every kernel image the queue needs is here."""
        return len(self.cubins) == self.images_needed

    def save(self, path: str | Path) -> None:
        """Write the artifact to ``path`` (one zip file; written whole, then renamed into place). A folder
        that is missing or unwritable, or a ``path`` that is a folder, is an :class:`ArtifactError`; no
        temporary file is left behind."""
        from safetensors.torch import save as save_tensors

        path = Path(path)
        where = f"cannot save artifact to {path}"
        parent = path.parent
        try:
            if not parent.exists():
                raise ArtifactError(f"{where}: folder {parent} does not exist")
            if not parent.is_dir():
                raise ArtifactError(f"{where}: {parent} is not a folder")
            if path.is_dir():
                raise ArtifactError(f"{where}: {path} is a folder")
            if path.exists() and not path.is_file():  # (a device or a pipe: the rename would replace it)
                raise ArtifactError(f"{where}: {path} is not a regular file")
        except OSError as e:  # a parent we may not even look into
            raise ArtifactError(f"{where}: {e.strerror or e}") from None
        constants = {str(k): t.contiguous() for k, t in self.constants.items()}
        parts = {"constants.safetensors": save_tensors(constants) if constants else b"",
                 "kernel.cu": self.source.encode()}
        if len(self.cubins) > MAX_IMAGES:
            raise ArtifactError(f"{where}: {len(self.cubins)} kernel images, at most {MAX_IMAGES}")
        for i, image in enumerate(self.cubins):
            parts[image_part(i)] = bytes(image)
        body = {"defines": self.defines, "timings": self.timings, "table": list(self.table),
                "queue": encode(self.queue)}
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "code": code_version(),
            "parts": {name: _sha256(data) for name, data in parts.items()},
            "body": json.dumps(body, separators=(",", ":")),  # a string: its digest needs no second encoding
        }
        meta["digest"] = _meta_digest(meta)
        text = json.dumps(meta, separators=(",", ":"))
        tmp = parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
                z.writestr(META, text)
                for name, data in parts.items():
                    z.writestr(name, data)
            os.replace(tmp, path)
        except OSError as e:
            raise ArtifactError(f"{where}: {e.strerror or e}") from None
        finally:
            try:
                tmp.unlink()  # gone already when the rename happened
            except OSError:
                pass

    @staticmethod
    def load(path: str | Path) -> "Artifact":
        """Read an artifact written by :meth:`save`, checking the hash of every part; anything else
        (a foreign, corrupt, truncated or edited file) raises :class:`ArtifactError`."""
        path = Path(path)
        try:
            return _load(path)
        except ArtifactError:
            raise
        except FileNotFoundError:
            raise ArtifactError(f"{path}: no such artifact file") from None
        except IsADirectoryError:
            raise ArtifactError(f"{path}: a folder, not an artifact file") from None
        except Exception as e:  # a truncated zip, a bad CRC, a failing constructor: all mean "not ours"
            raise ArtifactError(f"{path}: not a readable megaegg artifact ({type(e).__name__}: {e})") from None


def _load(path: Path) -> Artifact:
    from safetensors.torch import load as load_tensors

    from .lowering.queue import WorkQueue

    def bad(part: str, why: str) -> ArtifactError:
        return ArtifactError(f"{path}: {part}: {why}")

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise bad(twice[0], "stored twice")
        unknown = sorted(set(names) - {META, *PARTS})
        if unknown:
            raise ArtifactError(f"{path}: not a megaegg artifact (unexpected {', '.join(unknown)})")
        missing = sorted(set(REQUIRED) - set(names))
        if missing:
            raise ArtifactError(f"{path}: not a megaegg artifact (no {', '.join(missing)})")
        raw = {n: z.read(n) for n in names}  # a member whose CRC fails raises here
    try:
        meta = json.loads(raw[META])
    except ValueError as e:
        raise bad(META, f"not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a megaegg artifact")
    if meta.get("version") != FORMAT_VERSION or meta.get("code") != code_version():
        raise ArtifactError(f"{path}: made by another megaegg version (format {meta.get('version')}, "
                            f"code {str(meta.get('code'))[:12]}; this is {code_version()[:12]}): recompile")
    if meta.get("digest") != _meta_digest(meta):
        raise bad(META, "content does not match its digest (edited or corrupt)")
    recorded = meta.get("parts")
    if not isinstance(recorded, dict):
        raise bad(META, "no part hashes")
    for name in PARTS:
        if name in raw and name not in recorded:
            raise bad(name, "present but not recorded in artifact.json")
        if name in recorded and name not in raw:
            raise bad(name, "recorded in artifact.json but missing")
        if name in raw and recorded[name] != _sha256(raw[name]):
            raise bad(name, "does not match its hash in artifact.json (edited or corrupt)")
    extra = sorted(set(recorded) - set(PARTS))
    if extra:
        raise bad(META, f"hashes unknown part(s) {', '.join(map(str, extra))}")
    try:
        blob = raw["constants.safetensors"]
        constants = {}
        for k, t in (load_tensors(blob) if blob else {}).items():
            if not k.isdigit():
                raise ValueError(f"tensor name {k!r} is not a buffer id")
            constants[int(k)] = t
    except Exception as e:
        raise bad("constants.safetensors", f"unreadable ({type(e).__name__}: {e})") from None
    try:
        source = raw["kernel.cu"].decode()
    except UnicodeDecodeError as e:
        raise bad("kernel.cu", f"not UTF-8 ({e})") from None
    cubins = []  # the images up to the first missing one: an artifact missing one is not compiled
    while image_part(len(cubins)) in raw:
        cubins.append(raw[image_part(len(cubins))])
    try:
        body = json.loads(meta["body"]) if isinstance(meta.get("body"), str) else None
        if not isinstance(body, dict) or set(body) != {"defines", "timings", "table", "queue"}:
            raise DecodeError("the body is not {defines, timings, table, queue}")
        queue = decode(body["queue"])
        if not isinstance(queue, WorkQueue):
            raise DecodeError(f"the root is a {type(queue).__name__}, not a WorkQueue")
        defines, table, timings = body["defines"], body["table"], body["timings"]
        if not (isinstance(defines, dict) and all(_is_int(v) for v in defines.values())):
            raise DecodeError("defines must map names to ints")
        if not (isinstance(table, list) and all(_is_int(v) for v in table)):
            raise DecodeError("table must be a list of ints")
        if not (isinstance(timings, dict) and all(_is_number(v) for v in timings.values())):
            raise DecodeError("timings must map names to numbers")
    except (DecodeError, ValueError) as e:  # ValueError: the body is not JSON
        raise bad(META, f"invalid content ({e})") from None
    want = {b.id: b for b in queue.program.buffers if b.kind == "constant"}
    if set(constants) != set(want):
        raise bad("constants.safetensors",
                  f"holds buffers {sorted(constants)}; the queue's constants are {sorted(want)}")
    for i, b in want.items():
        t = constants[i]
        if t.dtype != b.dtype.torch or not all(isinstance(d, Dim) and d.is_const for d in b.shape) \
                or t.numel() != _numel(b.shape):
            raise bad("constants.safetensors", f"constant {b.name!r} is {t.dtype}{list(t.shape)}, "
                                               f"the queue wants {b.dtype}{[str(d) for d in b.shape]}")
    return Artifact(queue=queue, source=source, table=list(table), constants=constants, cubins=cubins,
                    defines=dict(defines), timings={k: float(v) for k, v in timings.items()})


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d.value
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_constants(art: Artifact, graph: Graph, where: str | Path) -> None:
    """``art``'s constants are the graph's, byte for byte (the cache key hashes the graph's constants, and
    the artifact's hashes its bytes: this catches what slips between), else :class:`ArtifactError`."""
    values: dict[str, torch.Tensor] = {}
    for n in graph.nodes:
        if n.op == "constant":
            values.setdefault(n.name, n.attrs["value"])
    for b in art.queue.program.buffers:
        if b.kind != "constant":
            continue
        have, want = art.constants.get(b.id), values.get(b.name)
        if have is None or want is None or not _same_tensor(have, want):
            raise ArtifactError(f"{where}: constants.safetensors: constant {b.name!r} differs from the graph's")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# --- the cache -------------------------------------------------------------------------------
_off: dict[str, str] = {}  # cache roots found unusable in this process -> why (each warned about once)


def _root() -> Path:
    return Path(os.path.expanduser(os.environ.get("MEGAEGG_CACHE") or "~/.cache/megaegg"))


def cache_dir() -> Path | None:
    """``$MEGAEGG_CACHE``, else ``~/.cache/megaegg`` (artifacts, cubins): delete it to clear the cache.
    None when it cannot be used (a file, under a file, unwritable): caching is then off, with one warning."""
    try:
        root = _root()
    except Exception as e:  # no home folder to expand
        disable_cache("~/.cache/megaegg", f"{type(e).__name__}: {e}")
        return None
    return _usable(root)


def cache_subdir(name: str) -> Path | None:
    """``cache_dir() / name``, created; None when either cannot be used (caching off, one warning)."""
    root = cache_dir()
    return None if root is None else _usable(root / name)


def disable_cache(path: str | Path, why: str, *, warn: bool = True) -> None:
    """Turn the cache that holds ``path`` off for this process (artifacts and cubins), warning once."""
    path = Path(path)
    try:
        root = _root()
        key = str(root) if path == root or root in path.parents else str(path)
    except Exception:
        key = str(path)
    if key not in _off:
        _off[key] = why
        if warn:
            log.warning("megaegg cache: cannot use %s (%s): caching is off", path, why)


def _usable(path: Path) -> Path | None:
    try:
        if str(_root()) in _off or str(path) in _off:
            return None
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except Exception as e:
        disable_cache(path, _why_unusable(path, e))
        return None
    return path


def _why_unusable(path: Path, e: Exception) -> str:
    try:
        for p in (path, *path.parents):
            if p.is_symlink() and not p.exists():
                return f"{'it' if p == path else p} is a link to {os.readlink(p)}, which does not exist"
            if p.exists():
                if not p.is_dir():
                    return "it is a file, not a folder" if p == path else f"{p} is a file, not a folder"
                break
    except OSError:
        pass
    if isinstance(e, PermissionError):
        return "not writable: permission denied"
    return getattr(e, "strerror", None) or f"{type(e).__name__}: {e}"


def cached_path(key: str) -> Path | None:
    """Where the artifact of ``key`` is cached; None when caching is off."""
    folder = cache_subdir("artifacts")
    return None if folder is None else folder / f"{key}.megaegg"


def load_cached(key: str, graph: Graph | None = None) -> Artifact | None:
    """The cached artifact of ``key``, or None: absent, caching off, or not loadable (an entry that is
    corrupt, edited, or whose constants are not ``graph``'s: one warning, and the caller rebuilds it)."""
    path = cached_path(key)
    if path is None:
        return None
    try:
        if not os.path.lexists(path):
            return None
        art = Artifact.load(path)
        if graph is not None:
            check_constants(art, graph, path)
        return art
    except ArtifactError as e:
        _rebuilding.add(str(path))
        log.warning("artifact cache: %s; rebuilding", e)
        return None


_rebuilding: set[str] = set()  # entries this process warned about at load


def store_cached(key: str, art: Artifact) -> None:
    """Best effort: a cache that cannot be written only costs the next compile its time (caching is then
    off for this process, with one warning)."""
    path = cached_path(key)
    if path is None:
        return
    try:
        art.save(path)
    except (ArtifactError, OSError, TypeError) as e:
        why = str(e).removeprefix(f"cannot save artifact to {path}: ")
        warned = str(path) in _rebuilding  # the load warned about this entry already: say it once
        if warned:
            log.info("artifact cache: could not rewrite %s (%s): caching is off", path, why)
        disable_cache(path, f"cannot write it: {why}", warn=not warned)


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
    from importlib.util import find_spec

    h = hashlib.sha256()  # (the stages' folders found without importing them: no import cycle)
    roots = [Path(__file__).parent, *(Path(find_spec(f"megaegg.{m}").origin).parent
                                      for m in ("rewrite", "lowering", "interpreter"))]
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".cuh", ".cu") and "models" not in p.relative_to(root).parts:
                h.update(str(p.relative_to(root.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


# --- the queue as JSON -------------------------------------------------------------------------
def _classes() -> dict[str, type]:
    from .ir.footprint import At, Full, Span, Tile
    from .lowering.barriers import BarrierPlan, BarrierSet, Wait
    from .lowering.queue import MemoryPlan, PeerPlan, QueueEntry, WorkQueue
    from .ir.program import BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, Regime, View

    return {c.__name__: c for c in (
        At, Full, Span, Tile, BarrierPlan, BarrierSet, Wait, MemoryPlan, PeerPlan, QueueEntry, WorkQueue,
        BlockOp, BlockProgram, Buffer, Estimate, Operand, RangeCheck, Regime, View)}


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


class DecodeError(ValueError):
    """Stored queue JSON that does not describe what the encoder writes (load turns it into ArtifactError)."""


@lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, tuple[Any, Callable[[Any], bool]]]:
    """The init fields of ``cls``: their type hints and checks (a hint that cannot be resolved: not checked)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation this module cannot resolve: check the names only
        hints = {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.init:
            hint = hints.get(f.name)
            try:
                out[f.name] = (hint, _checker(hint))
            except TypeError:  # an unhashable hint: not checked
                out[f.name] = (hint, _anything)
    return out


def _anything(v: Any) -> bool:
    return True


@lru_cache(maxsize=None)
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A test that a value is of type ``hint``, in the shapes the encoder writes (a list or a tuple for
    either); a hint it does not understand passes everything."""
    if hint is None or hint is Any:
        return _anything
    if hint is int:
        return _is_int
    if hint is float:
        return _is_number
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint in (list, tuple):
        return lambda v: isinstance(v, (list, tuple))
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        alts = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in alts)
    if origin in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            items = [_checker(a) for a in args]
            return lambda v: (isinstance(v, (list, tuple)) and len(v) == len(items)
                              and all(c(x) for c, x in zip(items, v)))
        item = _checker(args[0]) if args else _anything
        return lambda v: isinstance(v, (list, tuple)) and all(map(item, v))
    if origin is dict:
        if len(args) != 2:
            return lambda v: isinstance(v, dict)
        key, val = _checker(args[0]), _checker(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and val(x) for k, x in v.items())
    return _anything


def _type_name(v: Any) -> str:
    return type(v).__name__


def decode(data: dict) -> Any:
    """The value :func:`encode` wrote, each object checked as it is built (an unknown Dim op, dtype or
    class, wrong field names or types, a dangling reference: :class:`DecodeError`)."""
    classes = _classes()
    dtypes = {d.name: d for d in _DTYPES}
    table: list = []

    def value(v: Any) -> Any:  # JSON values have exact types (a bool is no int here)
        t = type(v)
        if t is dict and len(v) == 1:
            if "r" in v:
                x = v["r"]
                if type(x) is int and 0 <= x < len(table):
                    return table[x]
                raise DecodeError(f"reference {str(x)[:20]} outside the {len(table)} objects defined before it")
            if type(v.get("t")) is list:
                return tuple(value(y) for y in v["t"])
            if type(v.get("m")) is list:
                out = {}
                for pair in v["m"]:
                    if not (type(pair) is list and len(pair) == 2):
                        raise DecodeError(f"a map item is not a [key, value] pair: {str(pair)[:60]}")
                    k = value(pair[0])
                    try:
                        hash(k)
                    except TypeError:
                        raise DecodeError(f"a map key is not hashable: {str(pair[0])[:60]}") from None
                    out[k] = value(pair[1])
                return out
        if t is list:
            return [value(x) for x in v]
        if v is None or t in (bool, int, float, str):
            return v
        raise DecodeError(f"unexpected value {str(v)[:60]}")

    def dim(op: Any, args: Any) -> Dim:
        if not isinstance(args, list):
            raise DecodeError(f"Dim {op!r}: args must be a list")
        args = [value(a) for a in args]
        if op == "const" and len(args) == 1 and _is_int(args[0]):
            return Dim(op, (args[0],))
        if op == "sym" and len(args) == 1 and isinstance(args[0], str) and args[0]:
            return Dim(op, (args[0],))
        if op in _DIM_BINARY and len(args) == 2 and all(isinstance(a, Dim) for a in args):
            return Dim(op, tuple(args))
        if op not in ("const", "sym", *_DIM_BINARY):
            raise DecodeError(f"unknown Dim op {str(op)[:40]!r}")
        raise DecodeError(f"Dim {op!r} with bad arguments {[str(a)[:20] for a in args]}")

    if not isinstance(data, dict) or set(data) != {"table", "root"} or not isinstance(data["table"], list):
        raise DecodeError("not an encoded object table")
    for i, entry in enumerate(data["table"]):
        if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
            raise DecodeError(f"object {i} is not [kind, ...]")
        kind = entry[0]
        if kind == "Dim" and len(entry) == 3:
            table.append(dim(entry[1], entry[2]))
        elif kind == "DType" and len(entry) == 2:
            if not isinstance(entry[1], str) or entry[1] not in dtypes:
                raise DecodeError(f"unknown dtype {str(entry[1])[:40]!r}")
            table.append(dtypes[entry[1]])
        elif kind in classes and kind not in ("Dim", "DType") and len(entry) == 2 and isinstance(entry[1], dict):
            cls = classes[kind]
            fields = _field_types(cls)
            if entry[1].keys() != fields.keys():
                raise DecodeError(f"{kind}: fields {sorted(entry[1])}, expected {sorted(fields)}")
            kwargs = {k: value(x) for k, x in entry[1].items()}
            for k, v in kwargs.items():
                hint, check = fields[k]
                if not check(v):
                    raise DecodeError(f"{kind}.{k}: a {_type_name(v)} is not a {hint}")
            table.append(cls(**kwargs))
        elif kind in classes or kind in ("Dim", "DType"):
            raise DecodeError(f"object {i}: malformed {kind[:40]}")
        else:
            raise DecodeError(f"object {i}: {kind[:40]!r} is not a class an artifact may hold")
    return value(data["root"])

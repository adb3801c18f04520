"""Weights for a decode graph: from a Hugging Face checkpoint folder, or random.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Tensors go straight to the device in the
model dtype; a tensor the graph needs that is missing or misshaped, and a file that
is missing, truncated or malformed, raise :class:`CheckpointError` naming it. Weights that
cannot fit the device's memory are refused before any is drawn or read, naming their size and the
config fields that make it.

A checkpoint that disagrees with its config.json is read as transformers reads it, with a warning
(logger ``megaegg``): a tied config (``tie_word_embeddings``) whose checkpoint stores an
``lm_head.weight`` that differs from the embedding uses the stored head (:func:`read_config` unties
it); tensors the config does not name (layers beyond ``num_hidden_layers``, others) are ignored and
listed. An ``lm_head.weight`` equal to the tied embedding is skipped silently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..graph import GraphError
from .config import ModelConfig, UnsupportedConfig
from .decoder import ModelSpec, _numel, check_dtype

Progress = Callable[[str], None]  # gets one line of progress, e.g. to print to stderr
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# checkpoint tensors transformers drops without a word (old checkpoints' per-layer RoPE buffers)
SILENTLY_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
log = logging.getLogger("megaegg")


class CheckpointError(GraphError):
    """A checkpoint that does not fit the graph: names the file and tensor."""


def read_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder's ``config.json``, as transformers reads the model:
    a config that ties the LM head to the embeddings (``tie_word_embeddings``) while the checkpoint stores an
    ``lm_head.weight`` that differs from ``model.embed_tokens.weight`` is untied (transformers then uses
    the stored head), with a warning."""
    path = Path(path)
    cfg = _read_config(path)
    if cfg.tie_embeddings and _stored_head_differs(path):
        log.warning("%s: config.json sets tie_word_embeddings, but the checkpoint's %s differs from %s: using the "
                    "stored %s, as transformers does (set tie_word_embeddings to false to silence this)",
                    path, HEAD, EMBED, HEAD)
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    return cfg


def _read_config(path: Path) -> ModelConfig:
    """config.json as it is written."""
    file = path / "config.json"
    try:
        return ModelConfig.from_hf(read_json(file))
    except UnsupportedConfig as e:  # name the file as well as the field
        raise UnsupportedConfig(f"{file}: {e}") from e


def _stored_head_differs(path: Path) -> bool:
    """Whether the checkpoint stores an lm_head.weight unlike its embedding (compared a slab at a time).
    A folder without tensors yet, or whose files are unreadable, says no: load_checkpoint names the problem."""
    if not (path / INDEX).is_file() and not (path / SINGLE).is_file():
        return False
    try:
        files = _tensor_files(path)
        if HEAD not in files or EMBED not in files:
            return False
        return not _same_tensor(path, files, HEAD, EMBED)
    except CheckpointError:
        return False


def _same_tensor(path: Path, files: Mapping[str, str], a: str, b: str, slab_bytes: int = 1 << 26) -> bool:
    with _safetensors(path / files[a]) as fa, _safetensors(path / files[b]) as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        shape = list(sa.get_shape())
        if shape != list(sb.get_shape()) or sa.get_dtype() != sb.get_dtype():
            return False
        if len(shape) < 2:
            return torch.equal(fa.get_tensor(a), fb.get_tensor(b))
        rows = max(1, slab_bytes // max(1, _numel(shape[1:]) * 4))
        return all(torch.equal(sa[i:i + rows], sb[i:i + rows]) for i in range(0, shape[0], rows))


def check_weights_fit(spec: ModelSpec, device, dtype=None) -> None:
    """Weights that cannot fit ``device``'s memory (the host's for the CPU): an UnsupportedConfig naming their
    size and the config fields that make most of it, before any is allocated. ``dtype``: as the weights are
    drawn (random weights: f32 a tensor at a time, then cast)."""
    from ..compiler import memory_of
    from ..graph import fmt_bytes

    where, total, _ = memory_of(device)
    if total is None:
        return
    itemsize = spec.dtype.itemsize
    need = spec.weight_bytes + (max(map(_numel, spec.weights.values()), default=0) * dtype.itemsize if dtype else 0)
    if need > total:
        terms = spec.config.weight_terms()
        field, elements = next(iter(terms.items()))
        raise UnsupportedConfig(f"the weights need {fmt_bytes(spec.weight_bytes)} ({spec.dtype}), more than {where} has "
                                f"({fmt_bytes(total)}): most of it config fields {field}, {fmt_bytes(elements * itemsize)}")


def read_json(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; missing, unreadable, malformed or not an object: a CheckpointError naming it."""
    if not file.is_file():
        raise CheckpointError(f"{file}: no {file.name} in the checkpoint folder")
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__} {_clip(value)}")
    return value


def eos_token_ids(source: str | Path | Mapping[str, Any]) -> tuple[int, ...]:
    """The token ids generation stops at: of a checkpoint folder (its generation_config.json's
    ``eos_token_id`` if it sets one, else its config.json's) or of a config dict (a preset).

    >>> from megaegg.models import PRESETS
    >>> eos_token_ids(PRESETS["qwen3-0.6b"]), eos_token_ids(PRESETS["tiny"])
    ((151645,), ())
    """
    if isinstance(source, Mapping):
        return _token_ids(source.get("eos_token_id"), "config")
    path = Path(source)
    gen = path / "generation_config.json"
    ids = read_json(gen).get("eos_token_id") if gen.is_file() else None
    if ids is not None:
        return _token_ids(ids, str(gen))
    return _token_ids(read_json(path / "config.json").get("eos_token_id"), str(path / "config.json"))


def _token_ids(value: Any, where: str) -> tuple[int, ...]:
    """None (no EOS), an id, or a list of ids."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{where}: eos_token_id must be a token id or a list of them, got {_clip(value)}")
    return tuple(ids)


def _clip(value: Any, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


def load_checkpoint(path, spec: ModelSpec, device="cpu", dtype=None, *, progress: Progress | None = None
                    ) -> dict[str, torch.Tensor]:
    """The weights ``spec`` names, read from the checkpoint folder ``path``.

    The folder's config.json must describe the same architecture as ``spec`` (its
    dtype may differ: tensors are cast to the spec's dtype on the device). ``progress``
    gets a line per shard and, within a file, one about every second.
    """
    path = Path(path)
    dtype = check_dtype(spec, dtype)
    config = _read_config(path)
    files = _tensor_files(path)
    _check_same_model(config, spec.config, path, files)
    check_weights_fit(spec, device)
    parts = _checkpoint_tensors(spec)  # checkpoint tensor -> its shape (a stack's: one expert's)
    missing = sorted(n for n in parts if n not in files)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    ignored = [n for n in files if n not in parts and not SILENTLY_IGNORED.search(n)]
    if spec.config.tie_embeddings and HEAD in ignored:  # a copy of the embedding: skipped; else untied in transformers
        if not _same_tensor(path, files, HEAD, EMBED):
            raise CheckpointError(
                f"{path}: the graph ties the LM head to the embeddings (tie_word_embeddings), but the checkpoint's "
                f"{HEAD} differs from {EMBED} and transformers uses it: build the graph from "
                "megaegg.models.read_config(path), which unties it")
        ignored.remove(HEAD)
    if ignored:
        _warn_ignored(path, ignored, spec.config.layers)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in parts:
        by_file[files[name]].append(name)
    for file, names in by_file.items():  # before reading any: a partial download fails at once
        if not (path / file).is_file():
            raise CheckpointError(f"{path / INDEX}: shard {file!r} (holding {names[0]!r}) not found in {path}")
    out: dict[str, torch.Tensor] = {}
    stacked = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in spec.weights.items()
               if name in spec.stacks}  # filled expert by expert: no second copy of the experts
    where = {src: (name, e) for name, srcs in spec.stacks.items() for e, src in enumerate(srcs)}
    graph_name = {src: name for name, src in spec.renamed.items()}
    ticker = _Ticker(spec, progress)
    for i, (file, names) in enumerate(by_file.items()):
        with _safetensors(path / file, device) as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:  # (an index that places a tensor in a shard without it)
                    raise CheckpointError(f"{path / INDEX}: places tensor {name!r} in {file!r}, which does not hold it")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != parts[name]:
                    raise CheckpointError(
                        f"{path / file}: tensor {name!r} has shape {list(shape)}, expected {list(parts[name])}"
                    )
                if name in where:
                    stack, e = where[name]
                    stacked[stack][e] = f.get_tensor(name).to(dtype)
                    if e == len(spec.stacks[stack]) - 1:
                        ticker.tick(stack, file)
                else:
                    out[graph_name.get(name, name)] = f.get_tensor(name).to(dtype).contiguous()
                    ticker.tick(graph_name.get(name, name), file)
        if len(by_file) > 1:
            ticker.tick(None, f"shard {i + 1}/{len(by_file)} {file}", force=True)
    out.update(stacked)
    return {name: out[name] for name in spec.weights}  # in the graph's order


def random_weights(spec: ModelSpec, seed: int = 0, device="cpu", dtype=None, *, progress: Progress | None = None
                   ) -> dict[str, torch.Tensor]:
    """Random weights with non-degenerate logits: matrices N(0, 0.02^2), norm weights 1 + N(0, 0.1^2).

    Drawn on ``device`` with a generator seeded by ``seed`` (CPU and CUDA draws differ).
    ``progress`` gets a line about every second (a few GB on a CPU take a while).
    """
    dtype = check_dtype(spec, dtype)
    check_weights_fit(spec, device, torch.float32)  # before drawing any
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    ticker = _Ticker(spec, progress)
    for name, shape in spec.weights.items():
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        x = 1 + 0.1 * x if len(shape) == 1 else 0.02 * x
        out[name] = x.to(dtype)
        ticker.tick(name, "random weights")
    return out


class _Ticker:
    """Progress lines for a pass over ``spec``'s weights: at most about one a second, unless forced."""

    def __init__(self, spec: ModelSpec, progress: Progress | None, every: float = 1.0) -> None:
        self.spec, self.progress, self.every = spec, progress, every
        self.done = self.bytes = 0
        self.last = time.perf_counter()

    def tick(self, name: str | None, what: str, *, force: bool = False) -> None:
        if name is not None:
            self.done += 1
            self.bytes += _numel(self.spec.weights[name]) * self.spec.dtype.itemsize
        now = time.perf_counter()
        if self.progress and (force or now - self.last >= self.every):
            self.last = now
            total = self.spec.weight_bytes
            self.progress(f"{what}: {self.done}/{len(self.spec.weights)} tensors, "
                          f"{self.bytes / 1e9:.2f}/{total / 1e9:.2f} GB")


@contextmanager
def _safetensors(file: Path, device="cpu"):
    """``safe_open`` whose errors (a truncated, empty or foreign file) are CheckpointErrors naming ``file``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); is it truncated or partly downloaded?"
                              ) from e


def _tensor_files(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``path``)."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{path / INDEX}: expected a 'weight_map' object of tensor name -> shard file, "
                                  f"got {_clip(weight_map)}")
        return dict(weight_map)
    if (path / SINGLE).is_file():
        with _safetensors(path / SINGLE) as f:
            return {name: SINGLE for name in f.keys()}
    raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} found")



def _checkpoint_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors ``spec`` reads, with their shapes: a stacked graph weight's experts
    are separate tensors (Hugging Face's ``mlp.experts.{e}.gate_proj.weight``)."""
    out = {}
    for name, shape in spec.weights.items():
        for src in spec.stacks.get(name, (spec.renamed.get(name, name),)):
            out[src] = shape[1:] if name in spec.stacks else shape
    return out


def _warn_ignored(path: Path, names: list[str], layers: int, show: int = 8) -> None:
    """One warning listing checkpoint tensors the config does not name (transformers' UNEXPECTED keys):
    layers beyond num_hidden_layers summed up, then the others by name, a long list cut short."""
    beyond: dict[int, int] = defaultdict(int)
    others = []
    for n in sorted(names):
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m and int(m.group(1)) >= layers:
            beyond[int(m.group(1))] += 1
        else:
            others.append(n)
    parts = []
    if beyond:
        ids = sorted(beyond)
        span = f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}" if ids[-1] - ids[0] + 1 == len(ids) \
            else f"layers {', '.join(map(str, ids))}"
        parts.append(f"{span} ({sum(beyond.values())} tensors), beyond num_hidden_layers={layers}")
    if others:
        more = len(others) - show
        parts.append(", ".join(others[:show]) + (f" and {more} more" if more > 0 else ""))
    log.warning("%s: ignored %d checkpoint tensor(s) that config.json does not name (as transformers does): %s",
                path, len(names), "; ".join(parts))


def _check_same_model(found: ModelConfig, want: ModelConfig, path: Path, files: Mapping[str, str]) -> None:
    if found.tie_embeddings and not want.tie_embeddings and HEAD in files:
        # a tied config whose checkpoint stores its own head (read_config unties it when it differs): the
        # untied graph reads that head, as transformers does (or the same values, where they are equal)
        found = dataclasses.replace(found, tie_embeddings=False)
    for field in ModelConfig.__dataclass_fields__:
        if field != "dtype" and getattr(found, field) != getattr(want, field):
            have, built = getattr(found, field), getattr(want, field)
            raise CheckpointError(f"{path}/config.json: {field} is {have!r}, but the graph was built with {built!r}")

"""Weights for a decode graph: from a Hugging Face checkpoint folder, or random.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Tensors go straight to the device in the
model dtype; a tensor the graph needs that is missing or misshaped, and a file that
is missing, truncated or malformed, raise :class:`CheckpointError` naming it. Tensors
the graph does not read (e.g. a tied ``lm_head.weight``) are skipped.
"""

from __future__ import annotations

import json
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


class CheckpointError(GraphError):
    """A checkpoint that does not fit the graph: names the file and tensor."""


def read_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder's ``config.json``."""
    file = Path(path) / "config.json"
    try:
        return ModelConfig.from_hf(read_json(file))
    except UnsupportedConfig as e:  # name the file as well as the field
        raise UnsupportedConfig(f"{file}: {e}") from e


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
    _check_same_model(read_config(path), spec.config, path)
    files = _tensor_files(path)
    parts = _checkpoint_tensors(spec)  # checkpoint tensor -> its shape (a stack's: one expert's)
    missing = sorted(n for n in parts if n not in files)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
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
    ticker = _Ticker(spec, progress)
    for i, (file, names) in enumerate(by_file.items()):
        with _safetensors(path / file, device) as f:
            for name in names:
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
                    out[name] = f.get_tensor(name).to(dtype).contiguous()
                    ticker.tick(name, file)
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
        for src in spec.stacks.get(name, (name,)):
            out[src] = shape[1:] if name in spec.stacks else shape
    return out


def _check_same_model(found: ModelConfig, want: ModelConfig, path: Path) -> None:
    for field in ModelConfig.__dataclass_fields__:
        if field != "dtype" and getattr(found, field) != getattr(want, field):
            have, built = getattr(found, field), getattr(want, field)
            raise CheckpointError(f"{path}/config.json: {field} is {have!r}, but the graph was built with {built!r}")

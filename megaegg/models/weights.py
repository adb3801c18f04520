"""Weights for a decode graph: from a Hugging Face checkpoint folder, or random.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Tensors go straight to the device in the
model dtype; a tensor the graph needs that is missing or misshaped raises
:class:`CheckpointError` naming it. Tensors the graph does not read (e.g. a tied
``lm_head.weight``) are skipped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from ..graph import GraphError
from .config import ModelConfig
from .decoder import ModelSpec, check_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(GraphError):
    """A checkpoint that does not fit the graph: names the file and tensor."""


def read_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder's ``config.json``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: no config.json in the checkpoint folder")
    return ModelConfig.from_hf(json.loads(file.read_text()))


def load_checkpoint(path, spec: ModelSpec, device="cpu", dtype=None) -> dict[str, torch.Tensor]:
    """The weights ``spec`` names, read from the checkpoint folder ``path``.

    The folder's config.json must describe the same architecture as ``spec`` (its
    dtype may differ: tensors are cast to the spec's dtype on the device).
    """
    from safetensors import safe_open

    path = Path(path)
    dtype = check_dtype(spec, dtype)
    _check_same_model(read_config(path), spec.config, path)
    files = _tensor_files(path)
    missing = sorted(n for n in spec.weights if n not in files)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in spec.weights:
        by_file[files[name]].append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(path / file), framework="pt", device=str(device)) as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != spec.weights[name]:
                    raise CheckpointError(
                        f"{path / file}: tensor {name!r} has shape {list(shape)}, expected {list(spec.weights[name])}"
                    )
                out[name] = f.get_tensor(name).to(dtype).contiguous()
    return {name: out[name] for name in spec.weights}  # in the graph's order


def random_weights(spec: ModelSpec, seed: int = 0, device="cpu", dtype=None) -> dict[str, torch.Tensor]:
    """Random weights with non-degenerate logits: matrices N(0, 0.02^2), norm weights 1 + N(0, 0.1^2).

    Drawn on ``device`` with a generator seeded by ``seed`` (CPU and CUDA draws differ).
    """
    dtype = check_dtype(spec, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in spec.weights.items():
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        x = 1 + 0.1 * x if len(shape) == 1 else 0.02 * x
        out[name] = x.to(dtype)
    return out


def _tensor_files(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``path``)."""
    if (path / INDEX).is_file():
        return dict(json.loads((path / INDEX).read_text())["weight_map"])
    if (path / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}
    raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} found")


def _check_same_model(found: ModelConfig, want: ModelConfig, path: Path) -> None:
    for field in ModelConfig.__dataclass_fields__:
        if field != "dtype" and getattr(found, field) != getattr(want, field):
            have, built = getattr(found, field), getattr(want, field)
            raise CheckpointError(f"{path}/config.json: {field} is {have!r}, but the graph was built with {built!r}")

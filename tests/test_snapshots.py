"""Snapshots of what the compiler emits for the tiny presets: the printed BlockProgram (with its
barriers) and the rendered CUDA source. A diff here shows what a change did to the kernel.

A deliberate change updates them with ``python3 -m pytest tests/test_snapshots.py --update-snapshots``.
"""

import difflib
from pathlib import Path

import pytest

from megaegg.compiler import build_artifact
from megaegg.models import ModelConfig, build_decode_graph

SNAPSHOTS = Path(__file__).parent / "snapshots"
PRESETS = ["tiny", "qwen3-tiny", "qwen3-moe-tiny"]


def emitted(preset: str) -> dict[str, str]:
    graph, _ = build_decode_graph(ModelConfig.preset(preset), max_len=1024, logits=False)
    art = build_artifact(graph, max_dims={"pos": 1023}, dims_hint={"pos": 512}, compile_cuda=False)
    program = f"{art.queue.program}\nbarriers:\n{art.queue.barriers}\n"
    return {f"{preset}.program.txt": program, f"{preset}.cu": art.source}


@pytest.mark.parametrize("preset", PRESETS)
def test_emitted_code_matches_the_snapshot(preset, request):
    for name, text in emitted(preset).items():
        path = SNAPSHOTS / name
        if request.config.getoption("--update-snapshots"):
            path.write_text(text)
            continue
        assert path.exists(), f"no snapshot {path}: run pytest {__file__} --update-snapshots"
        want = path.read_text()
        if text != want:
            diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "emitted", n=2))
            pytest.fail(f"{name} differs from its snapshot (if deliberate: --update-snapshots):\n{diff[:6000]}")

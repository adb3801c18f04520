"""The machine code of the interpreter loop's claim (no GPU needed: NVRTC, then NVIDIA's nvdisasm).

Thread 0 claims the next instance in divergent code; then the block meets at `__syncthreads()`, an aligned
`bar.sync 0`, which every warp must reach whole. A layout where ptxas branches into the barrier's block from
outside the claim leaves the claim without its reconvergence (BSSY ... BSYNC) and warp 0 reaches the barrier
split: on an H200 that ran no instance's body for a graph of two independent copies (perf-notes #108: an
entry cursor set in a branch before the loop). These kernels must keep the claim reconverged, or predicated.
"""

import re
import subprocess
from pathlib import Path

import pytest

import megaegg as me
from megaegg.compiler import build_artifact
from megaegg.interpreter.nvrtc import compile_cubin
from megaegg.models import ModelConfig, build_decode_graph
from op_cases import CASES


def nvdisasm() -> str | None:
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(p) for root in nvidia.__path__ for p in Path(root).rglob("nvdisasm")), None)


TOOL = nvdisasm()
pytestmark = pytest.mark.skipif(TOOL is None, reason="no nvdisasm (pip install nvidia-cuda-nvdisasm)")


def kernel_sass(art, tmp_path) -> list[str]:
    path = tmp_path / "k.cubin"
    path.write_bytes(compile_cubin(art.source, defines=art.defines, use_cache=False).cubin)
    sass = subprocess.run([TOOL, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    return sass.split(".text.megakernel:", 1)[1].split("\n//----", 1)[0].splitlines()


def claim_is_whole(lines: list[str]) -> bool:
    """The claim's atomic (the loop's one 64-bit add) sits between a BSSY and the BSYNC before the next
    `BAR.SYNC 0x0`, or is predicated itself (no branch around it)."""
    claim = next(k for k, line in enumerate(lines) if "ATOMG.E.ADD.64" in line)
    barrier = next(k for k in range(claim, len(lines)) if re.search(r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x0 ;", lines[k]))
    if re.search(r"@!?U?P\d+\s+ATOMG", lines[claim]):
        return True
    opened = next((k for k in range(claim, -1, -1) if "BSSY" in lines[k] or "BAR.SYNC" in lines[k]), None)
    return opened is not None and "BSSY" in lines[opened] and any("BSYNC" in line for line in lines[claim:barrier])


# the op cases that an unsound layout broke (perf-notes #108), and a model's kernel
@pytest.mark.parametrize("case", ["concat_transpose", "matmul", "linear_odd_k"])
def test_the_claim_reconverges_before_the_block_barrier(case, tmp_path):
    for dt in (me.f32, me.bf16):
        build, _, _ = CASES[case](dt)
        g = me.Graph(case)
        build(g)
        art = build_artifact(g, max_dims={s: 64 for s in g.symbols()}, compile_cuda=False)
        assert claim_is_whole(kernel_sass(art, tmp_path)), f"{case} {dt}: warp 0 may reach the claim's barrier split"


def test_a_models_claim_reconverges(tmp_path):
    graph, _ = build_decode_graph(ModelConfig.preset("tiny"), max_len=64)
    art = build_artifact(graph, max_dims={"pos": 63}, compile_cuda=False)
    assert claim_is_whole(kernel_sass(art, tmp_path))

"""Dev (CPU): does ptxas keep warp 0 whole at the claim's barrier? (perf-notes #108)

    pip install nvidia-cuda-nvdisasm      # the disassembler, a wheel of NVIDIA's
    python3 scripts/dev/sass_claim_check.py [PRESET ...]    # default: every op case and the tiny presets

Thread 0 claims an instance in divergent code, then the block meets at `__syncthreads()` (an aligned
`bar.sync 0`: every warp must arrive whole). Where ptxas laid out a branch into the loop's barrier block
(a pre-loop `if (threadIdx.x == 0)` store did that), the claim had no BSSY / BSYNC around it and the GPU ran
wrong (test_ops_gpu concat_transpose: rel err 0.98). Prints the kernels whose claim lacks its BSSY.
"""
import subprocess
import sys
from pathlib import Path

import megaegg as me
from megaegg.compiler import build_artifact
from megaegg.interpreter import nvrtc as nv
from megaegg.models import ModelConfig, build_decode_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from op_cases import CASES  # noqa: E402


def nvdisasm() -> str:
    import nvidia

    for root in nvidia.__path__:
        for p in Path(root).rglob("nvdisasm"):
            return str(p)
    raise SystemExit("no nvdisasm: pip install nvidia-cuda-nvdisasm")


def claim_reconverges(art, tool: str) -> bool:
    cubin = nv.compile_cubin(art.source, defines=art.defines, use_cache=False).cubin
    path = Path("/tmp/sass_claim_check.cubin")
    path.write_bytes(cubin)
    sass = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    lines = sass.split(".text.megakernel:", 1)[1].split("\n//----", 1)[0].splitlines()
    claim = next(k for k, line in enumerate(lines) if "ATOMG.E.ADD.64" in line)
    return any("BSSY" in line for line in lines[max(0, claim - 40):claim])


def main(presets: list[str]) -> None:
    tool = nvdisasm()
    arts = {}
    if not presets:
        for name in sorted(CASES):
            for dt in (me.f32, me.bf16):
                build, _, _ = CASES[name](dt)
                g = me.Graph(name)
                build(g)
                arts[f"{name}-{dt}"] = build_artifact(g, max_dims={s: 64 for s in g.symbols()}, compile_cuda=False)
        presets = ["tiny", "qwen3-tiny"]
    for p in presets:
        graph, _ = build_decode_graph(ModelConfig.preset(p), max_len=1024)
        arts[p] = build_artifact(graph, max_dims={"pos": 1023}, dims_hint={"pos": 512}, compile_cuda=False)
    bad = [name for name, art in arts.items() if not claim_reconverges(art, tool)]
    print(f"{len(arts)} kernels; the claim without its BSSY: {bad or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])

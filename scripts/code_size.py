"""dev: SASS bytes per function of a preset's megakernel (NVRTC, no GPU needed).

    python3 scripts/code_size.py llama-3.2-1b

The code is fetched through L2 like data and the per-SM instruction cache is far smaller
than the kernel, so an op's first instance runs its code cold (perf-notes, "What would
close the gap"). Function sizes come from the cubin's ELF symbol table.
"""
import sys

from megaegg.compiler import build_artifact
from megaegg.interpreter.nvrtc import function_sizes
from megaegg.models import ModelConfig, build_decode_graph


if __name__ == "__main__":
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"
    graph, _ = build_decode_graph(ModelConfig.preset(preset), max_len=1024)
    art = build_artifact(graph, max_dims={"pos": 1023}, dims_hint={"pos": 512}, compile_cuda=True)
    sizes = function_sizes(art.cubin)
    bodies = sum(v for k, v in sizes.items() if k != "megakernel")
    print(f"{preset}: {len(art.queue.entries)} queue entries, cubin {len(art.cubin) / 1e3:.0f} KB; "
          f"SASS {sizes['megakernel'] / 1e3:.0f} KB: the kernel's own (dispatch) code "
          f"{(sizes['megakernel'] - bodies) / 1e3:.0f} KB, the functions it calls {bodies / 1e3:.0f} KB")
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[1:20]:  # (the kernel's symbol spans them all)
        print(f"  {size / 1e3:8.1f} KB  {name[:100]}")

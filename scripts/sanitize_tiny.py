"""Run the tiny model's megakernel a few steps (for compute-sanitizer memcheck / racecheck)."""
import torch
import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

graph, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=32)
kernel = me.compile(graph, random_weights(spec, device="cuda"), backend="cuda", max_dims={"pos": 31})
caches = spec.new_caches("cuda")
for pos in range(3):
    out = kernel(token=torch.tensor([pos + 1], dtype=torch.int32, device="cuda"), pos=pos, **caches)
torch.cuda.synchronize()
print("tiny steps ok", out["next_token"].item())

"""Run the tiny model's megakernels a few steps (for compute-sanitizer memcheck / racecheck / initcheck):
the batch-1 decode graph (also with 4 query heads a KV head: the tensor-core decode attention, and the
Qwen3-MoE tiny preset: routing inside the kernel), and the step graph (tiny and qwen3-moe-tiny: the routed
experts in blocks) prefilling two prompts and decoding them with sampling (KV rows by slot, ragged attention,
tensor-core projections of several rows, the sampler)."""
import dataclasses

import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, build_step_graph, random_weights
from megaegg.models.batch import Batcher, Request, Sampling, kernel_batch_step

cfg = ModelConfig.preset("tiny")
for name, c in (("tiny", cfg), ("tiny G4", dataclasses.replace(cfg, heads=8)), ("qwen3-moe-tiny", ModelConfig.preset("qwen3-moe-tiny"))):
    graph, spec = build_decode_graph(c, max_len=96)
    kernel = me.compile(graph, random_weights(spec, device="cuda"), backend="cuda", max_dims={"pos": 95})
    caches = spec.new_caches("cuda")
    for pos in (0, 1, 70):  # (70: two attention splits)
        out = kernel(token=torch.tensor([pos + 1], dtype=torch.int32, device="cuda"), pos=pos, **caches)
    torch.cuda.synchronize()
    print(name, "steps ok", out["next_token"].item())

for name, c in (("tiny", cfg), ("qwen3-moe-tiny", ModelConfig.preset("qwen3-moe-tiny"))):
    graph, spec = build_step_graph(c, max_len=64, slots=2, sampling=True)
    kernel = me.compile(graph, random_weights(spec, device="cuda"), backend="cuda", max_dims={"n": 64, "r": 2, "ctx": 64})
    batcher = Batcher(kernel_batch_step(kernel, spec.new_caches("cuda")), slots=2, max_len=64, device="cuda")
    prompt = [5 + 7 * i for i in range(40)]  # (the MoE's experts: ~17 rows each, two blocks of 16)
    outs = batcher.run([Request(prompt, 3), Request([3], 3, sampling=Sampling(temperature=0.8, top_k=20, seed=1))])
    torch.cuda.synchronize()
    print(name, "batch ok", [o.tokens for o in outs], batcher.launches, "launches")

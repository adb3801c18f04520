"""Time ``me.compile`` of a preset (f32, sim backend) in this process: run it twice in new
processes to see a cold compile, then an artifact-cache hit.

    MEGAEGG_CACHE=/tmp/c python3 scripts/dev/warm_start.py tiny 16   # preset, layers
"""
import dataclasses
import sys
import time

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

preset, layers = sys.argv[1], int(sys.argv[2])
cfg = dataclasses.replace(ModelConfig.preset(preset), dtype=me.f32, layers=layers)
graph, spec = build_decode_graph(cfg, max_len=256, logits=False)
weights = random_weights(spec, seed=0)
t = time.perf_counter()
kernel = me.compile(graph, weights, backend="sim", max_dims={"pos": 255})
total = time.perf_counter() - t
hit = kernel.artifact.timings.get("cache_load")
print(f"{preset}, {layers} layers: compile {total:.3f} s ("
      + (f"artifact cache hit, loaded in {hit:.3f} s; the rest binds the weights)" if hit is not None else "cold)"))

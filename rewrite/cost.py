"""The extraction cost model: estimated seconds of one block op on a persistent grid.

All constants are parameters. Defaults describe a Hopper GPU (132 SMs, ~3 TB/s read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    bandwidth: float = 3.0e12  # bytes/s the whole chip streams
    sms: int = 132
    # an SM streams at most this times its fair share (in-model traces: 21-32 GB/s per SM vs 22.7 here)
    sm_bandwidth_share: float = 1.2
    instance_overhead: float = 0.15e-6  # s per instance: queue pop + barrier check (docs/design.md)
    # s per block op: its hand-off latency. Measured on llama-3.2-1b (H200): 1.5 us (QKV left unfused,
    # 128 instances each) 1.42-1.87 ms vs 4 us (partly fused) 1.50-1.94 ms: wide ops beat fewer ops.
    op_overhead: float = 1.5e-6
    # s from an instance's claim until its weights stream (claim, barrier poll, x staged): measured
    # ~2 us in the model on H200 (trace). Prices side-by-side siblings (siblings.py).
    instance_latency: float = 2.0e-6
    # bytes an SM has in flight before it streams at its share (one register buffer of the
    # matvec): each wave of an op waits that long for its first data after the hand-off, so
    # one op streaming A then B beats two (perf-notes #32: the gated MLP with its down projection)
    ramp_bytes: int = 64 * 1024
    # dense bf16 tensor-core FLOP/s of the chip that a tiled GEMM reaches in the model (H200: the tile alone
    # 590-770 at 200 KB, gemm_probe; in a traced prefill ~460-590 with its ~8 us fixed cost an instance)
    tensor_flops: float = 4.5e14
    # a pipelined tile's step (a k-tile through its shared-memory ring) waits this long for its copy when
    # only `stages_in_flight` are in flight: measured ~1.9 us a 48 KB k-tile with one in flight (the
    # gemm LM head of qwen3-8b at one row, perf-notes #69). The kernel image of a row regime's large
    # rows has the shared memory for 3 (rewrite/regimes.py, interpreter/render.py: TILE_SMEM).
    step_latency: float = 1.9e-6
    stages_in_flight: int = 1
    # an op's byte stream takes this share longer for each SM its last wave leaves idle, as a share of the SMs:
    # within the per-SM share above 110-112 instances price as 128 do, but in the model an SM streams at most
    # ~1.1x its fair share, so tiles that fill the chip win (llama-3.1-8b's glu_down: 128 of 112 rows, not 112
    # of 128; perf-notes #95)
    idle_sm_share: float = 0.1

    def seconds(self, nbytes: int, instances: int, flops: float = 0.0, steps: float = 0, hops: int = 0) -> float:
        """Time for ``instances`` equal instances moving ``nbytes`` in all, doing ``flops`` on tensor
        cores and ``steps`` pipelined steps (an instance streams, computes and waits at once: the slowest
        of the three counts), then ``hops`` dependent round trips (a last arrival's combine)."""
        instances = max(1, instances)
        waves = math.ceil(instances / self.sms)
        per_sm_bw = self.bandwidth / self.sms * self.sm_bandwidth_share
        stream = max(nbytes / self.bandwidth, waves * (nbytes / instances) / per_sm_bw)
        stream *= 1 + self.idle_sm_share * (waves * self.sms - instances) / self.sms  # (streaming only)
        stream = max(stream, waves * (flops / instances) / (self.tensor_flops / self.sms),
                     waves * (steps / instances) * self.step_latency / self.stages_in_flight)
        ramp = waves * min(nbytes / instances, self.ramp_bytes) / per_sm_bw
        return stream + ramp + waves * self.instance_overhead + (1 + hops) * self.op_overhead

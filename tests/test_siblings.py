"""Sibling matvecs (Q, K, V: same input, no path between them) get their tiles chosen together."""

from collections import defaultdict

from megaegg.blockops.matvec import roles
from megaegg.models import ModelConfig, build_decode_graph
from megaegg.rewrite.cost import CostModel
from megaegg.rewrite.schedule import rewrite
from megaegg.rewrite.siblings import group_seconds

MODEL = CostModel()


def test_one_wave_beats_two_for_side_by_side_ops():
    kb = 1024
    # llama-3.2-1b Q (8 MB) + K + V (2 MB each): 128 + 64 + 64 instances vs 64 + 32 + 32
    two_waves = [(8192 * kb, 128), (2048 * kb, 64), (2048 * kb, 64)]
    one_wave = [(8192 * kb, 64), (2048 * kb, 32), (2048 * kb, 32)]
    assert group_seconds(one_wave, MODEL) < group_seconds(two_waves, MODEL)
    # but not at any price: one huge instance per op is slower than a full wave
    assert group_seconds([(8192 * kb, 8), (2048 * kb, 2), (2048 * kb, 2)], MODEL) > group_seconds(one_wave, MODEL)


def _sibling_groups(program, env):
    groups = defaultdict(list)
    for op in program.ops:
        if op.kind == "matvec":
            k = roles(op)
            key = (op.inputs[k["x"]].buffer, op.inputs[k["g"]].buffer if "g" in k else None)
            groups[key].append(op.grid[0].eval(env) * op.grid[1].eval(env))
    return [g for g in groups.values() if len(g) > 1]


def test_llama_qkv_share_one_wave():
    cfg = ModelConfig.preset("llama-3.2-1b")
    graph, _spec = build_decode_graph(cfg, max_len=1024)
    program = rewrite(graph, cost_model=MODEL)
    groups = _sibling_groups(program, {"pos": 512})
    assert len(groups) == cfg.layers  # one Q/K/V group per layer
    for launches in groups:
        assert len(launches) == 3 and sum(launches) <= MODEL.sms, launches

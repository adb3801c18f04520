"""Sibling matvecs (Q, K, V: same input, no path between them) get their tiles chosen together."""

from collections import defaultdict

from megaegg.blockops.matvec import roles
from megaegg.ir.program import Estimate
from megaegg.models import ModelConfig, build_decode_graph, build_step_graph
from megaegg.rewrite.cost import CostModel
from megaegg.rewrite.schedule import rewrite
from megaegg.rewrite.siblings import group_seconds

MODEL = CostModel()


def test_one_wave_beats_two_for_side_by_side_ops():
    kb = 1024
    # llama-3.2-1b Q (8 MB) + K + V (2 MB each): 128 + 64 + 64 instances vs 64 + 32 + 32
    two_waves = [Estimate(8192 * kb, 128), Estimate(2048 * kb, 64), Estimate(2048 * kb, 64)]
    one_wave = [Estimate(8192 * kb, 64), Estimate(2048 * kb, 32), Estimate(2048 * kb, 32)]
    assert group_seconds(one_wave, MODEL) < group_seconds(two_waves, MODEL)
    # but not at any price: one huge instance per op is slower than a full wave
    few = [Estimate(8192 * kb, 8), Estimate(2048 * kb, 2), Estimate(2048 * kb, 2)]
    assert group_seconds(few, MODEL) > group_seconds(one_wave, MODEL)


def test_tensor_core_flops_count_in_a_group():
    """An instance's time is its bytes or its FLOPs, whichever is slower: a compute-bound tile is dearer
    than its bytes alone say."""
    mb, gf = 1 << 20, 1e9
    light = [Estimate(8 * mb, 128, flops=17 * gf), Estimate(2 * mb, 32, flops=4 * gf)]
    heavy = [Estimate(8 * mb, 128, flops=170 * gf), Estimate(2 * mb, 32, flops=40 * gf)]
    assert group_seconds(heavy, MODEL) > 5 * group_seconds(light, MODEL)


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


def test_prompt_k_and_v_join_q_on_gemm_tiles():
    """llama-3.2-1b's step graph for long prompts: K and V (N = 512) priced alone would be matvec tiles, but
    they run beside Q's gemm tiles, where three waves of matvec instances cost more than one more wave of
    gemm tiles: every projection of the prompt's regime is a gemm."""
    cfg = ModelConfig.preset("llama-3.2-1b")
    graph, _spec = build_step_graph(cfg, max_len=2049, slots=65)
    program = rewrite(graph, cost_model=MODEL, dims_hint={"n": 16, "r": 16, "ctx": 513},
                      max_dims={"n": 2112, "r": 65, "ctx": 2049})
    large = [op for op in program.ops if op.regime == program.regime.bands - 1]  # (the most rows' band)
    gemm_weights = {op.inputs[roles(op)["w"]].buffer for op in large if op.kind == "gemm"}
    layer_weights = [b.id for b in program.buffers if b.kind == "weight" and ".layers." in b.name
                     and b.name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj")]
    assert layer_weights and set(layer_weights) <= gemm_weights

"""Qwen3-MoE: the graph op, its routing inside the kernel, configs and checkpoints (CPU: reference
executor and simulator, against Hugging Face transformers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from op_cases import MOE_WEIGHTS, moe
from queue_edits import without_waits
from tiny_checkpoints import save_tiny

import megaegg as me
from megaegg.interpreter import Interleaving, SimulationError
from megaegg.models import (
    CheckpointError, Generator, ModelConfig, UnsupportedConfig, build_decode_graph, build_step_graph, kernel_step,
    load_checkpoint, random_weights, read_config, reference_step,
)
from megaegg.models.batch import Batcher, Request, kernel_batch_step
from megaegg.models.pages import PagePool
from megaegg.reference import moe_routing

transformers = pytest.importorskip("transformers")

TINY_MOE = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=97, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
    rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False,
)


def hf_moe(seed: int, **config):
    """A tiny random Qwen3-MoE (f32) whose weights all matter."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY_MOE, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    return model.float().eval()


@pytest.mark.parametrize("config,executor,seed", [
    # odd expert count, top-2, renormalised, a dense layer among sparse ones
    (dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]), "reference", 20),
    (dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]), "megakernel-sim", 21),
    # every second layer sparse (decoder_sparse_step), top-3 of 7 not renormalised
    (dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2), "megakernel-sim", 22),
])
def test_greedy_matches_transformers(tmp_path, config, executor, seed):
    model = hf_moe(seed, **config)
    model.save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.arch == "qwen3_moe" and cfg.moe.experts == config["num_experts"]
    step = config.get("decoder_sparse_step", 1)
    assert cfg.moe.sparse_layers == tuple(i for i in range(3) if i not in config.get("mlp_only_layers", [])
                                          and (i + 1) % step == 0)
    max_len = 32
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = load_checkpoint(tmp_path, spec)  # the per-expert tensors stacked
    if executor == "reference":
        run = reference_step(graph, weights, spec.new_caches())
    else:
        run = kernel_step(me.compile(graph, weights, backend="sim", max_dims={"pos": max_len - 1}), spec.new_caches())
    prompt = torch.randint(0, cfg.vocab, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = Generator(run, max_len=max_len).generate(prompt, max_new_tokens=12, keep_logits=True)
    with torch.no_grad():
        ids = torch.tensor([prompt + out.tokens])
        want = model.generate(ids[:, : len(prompt)], max_new_tokens=12, do_sample=False)
        hf_logits = model(ids[:, :-1]).logits[0]
    assert want[0, len(prompt):].tolist() == out.tokens
    ours = torch.cat(out.logits)
    err = ((ours - hf_logits).abs().max() / hf_logits.abs().max()).item()
    assert err < 1e-4, f"logits rel err {err:.2e}"
    assert len(set(out.tokens)) > 1


def test_only_the_chosen_experts_are_read():
    """The unchosen experts' weights are NaN: the compiled kernel's result is still the reference's
    (the simulator runs the kernel's instances, each reading its routed expert's rows only)."""
    torch.manual_seed(3)
    g = me.Graph("moe")
    moe(g, me.f32)
    weights = {n: torch.randn(s) * 0.3 for n, s in MOE_WEIGHTS.items()}
    x = torch.randn(1, 128)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weights["g"]
    _, chosen = moe_routing(h @ weights["wr"].T, 2, True, torch.float32)
    poisoned = dict(weights)
    for name in ("we_g", "we_u", "we_d"):
        w = weights[name].clone()
        w[[e for e in range(5) if e not in chosen[0].tolist()]] = float("nan")
        poisoned[name] = w
    want = me.run_reference(g, {"x": x}, weights)["y"]
    k = me.compile(g, poisoned, backend="sim")
    for sch in (Interleaving(sms=1), Interleaving(sms=6, seed=4, adversarial=True)):
        got = k.simulate(sch, x=x.clone())["y"]
        assert torch.isfinite(got).all()
        assert ((got - want).norm() / want.norm()).item() < 1e-5


PROMPTS = [[3, 17, 5], [9, 2, 44, 61, 7, 30, 8], [12], [50, 1, 6, 6, 90], [21, 22]]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("paged", [False, True])
def test_the_step_graph_batches_a_moe_model_as_transformers_decodes_it(tmp_path, paged):
    """Five prompts of 1 to 7 tokens through two slots (or a pool of pages), at most 6 token rows a launch, on
    the simulator under an adversarial interleaving: decode batches, prompts prefilling over two launches and
    mixed steps route their rows through the grouped experts (moe_route, moe_experts), and each sequence's
    greedy tokens are transformers' for its prompt alone. Top-3 of 7, not renormalised; a dense layer first."""
    path = save_tiny(tmp_path, "qwen3_moe", seed=4, num_hidden_layers=2, num_experts=7, num_experts_per_tok=3,
                     norm_topk_prob=False, mlp_only_layers=[0])
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(path)
    cfg = read_config(path)
    pages = dict(page_len=4, pages=24) if paged else {}
    graph, spec = build_step_graph(cfg, max_len=32, slots=2, **pages)
    kernel = me.compile(graph, load_checkpoint(path, spec), backend="sim", max_dims={"n": 6, "r": 2, "ctx": 32})
    kinds = [e.op.kind for e in kernel.queue.entries]
    assert kinds.count("moe_route") == kinds.count("moe_experts") == 1 and "moe_glu_down" not in kinds
    kernel.interleaving = Interleaving(sms=5, seed=2, adversarial=True)
    batcher = Batcher(kernel_batch_step(kernel, spec.new_caches()), slots=2, max_len=32, max_tokens=6,
                      pages=PagePool(24, 4, 8) if paged else None)
    outs = batcher.run([Request(p, 5) for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.tokens == hf_greedy(model, prompt, 5), prompt
    assert batcher.launches < sum(len(p) + 4 for p in PROMPTS) / 2  # far fewer launches than tokens


@pytest.fixture(scope="module")
def moe_step():
    """qwen3-moe-tiny (top-3 of 7, renormalised) in f32 with random weights, 2 layers, its step graph compiled
    for up to 12 rows on the simulator, and a mixed step: a 5-token prompt beside 6 decoding rows."""
    cfg = dataclasses.replace(ModelConfig.preset("qwen3-moe-tiny"), dtype=me.f32, layers=2)
    graph, spec = build_step_graph(cfg, max_len=16, slots=4)
    weights = {n: t * 2 for n, t in random_weights(spec, seed=3).items()}  # (spread-out router logits)
    kernel = me.compile(graph, weights, backend="sim", max_dims={"n": 12, "r": 4, "ctx": 16})
    gen = torch.Generator().manual_seed(6)
    n = 11
    ins = {"token": torch.randint(0, cfg.vocab, (n,), generator=gen, dtype=torch.int32),
           "pos": torch.tensor([0, 1, 2, 3, 4, 9, 3, 7, 12, 5, 15], dtype=torch.int32),
           "slot": torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 1, 2, 3], dtype=torch.int32),
           "out": torch.tensor([4, 8, 9, 10], dtype=torch.int32)}
    caches = {k: torch.randn(c.shape, generator=gen) for k, c in spec.new_caches().items()}
    return graph, weights, kernel, ins, caches, {"n": n, "r": 4, "ctx": 16}


def test_a_mixed_step_routes_rows_to_experts_on_adversarial_interleavings(moe_step):
    """The grouped experts' rows (several a chosen expert: more than one pass of 4) on random and adversarial
    schedules give the reference's logits; without its waits the expert op reads the route before it is
    written."""
    graph, weights, kernel, ins, caches, dims = moe_step
    fresh = lambda: {k: c.clone() for k, c in caches.items()}  # noqa: E731
    ref = me.run_reference(graph, {**ins, **fresh()}, weights, dims)["logits"]
    x = [e for e in kernel.queue.entries if e.op.kind == "moe_experts"][0].op
    route = kernel.queue.program.buffers[x.inputs[list(x.params["roles"]).index("route")].buffer].name
    for seed in range(4):
        got = kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=seed % 2 == 1), **ins, **fresh(), **dims)
        assert ((got["logits"] - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with without_waits(kernel, "moe_experts"), pytest.raises(
            SimulationError, match=rf"moe_experts .* read unwritten elements of buffer '({route}|t\d+)'"):
        for seed in range(6):
            kernel.simulate(Interleaving(sms=4, seed=seed, adversarial=True), **ins, **fresh(), **dims)


def test_the_expert_op_takes_blocks_of_each_chosen_experts_rows_and_skips_the_rest(moe_step):
    """Instance (b, t) takes block b of the routed rows: the chosen experts in increasing id order, each one's
    rows in row order cut into blocks of ``block`` rows. With blocks of 2 and 5 rows of top-3 where expert 4 is
    every row's and experts 1, 2, 3, 5 and 6 two rows' each: 8 blocks, expert 4's three (rows 0-1, 2-3, 4); the
    instances past them do nothing (the grid's bound: ceildiv(15, 2) + min(15, 7) = 15)."""
    from megaegg.blockops import REGISTRY

    _, _, kernel, *_ = moe_step
    op = [e.op for e in kernel.queue.entries if e.op.kind == "moe_experts"][0]
    block = op.params["block"]
    assert [str(d) for d in op.grid] == [f"ceildiv(n * 3, {block}) + min(n * 3, 7)", str(op.grid[1])]
    op = dataclasses.replace(op, params={**op.params, "block": 2})
    route = torch.zeros(5, 2, 3)
    route[:, 1] = torch.tensor([[4.0, 1.0, 6.0], [6.0, 2.0, 4.0], [4.0, 1.0, 3.0], [3.0, 4.0, 5.0], [5.0, 4.0, 2.0]])
    route[:, 0] = 0.5
    k = {r: i for i, r in enumerate(op.params["roles"])}
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn([d.eval({"n": 5}) for d in o.shape], generator=gen) for o in op.inputs]
    ins[k["route"]] = route
    seen = []
    for b in range(10):
        out = torch.zeros(5, ins[k["x"]].shape[1])
        REGISTRY["moe_experts"].cpu(op, {"n": 5, "_i0": b, "_i1": 0}, ins, out)
        seen.append([r for r in range(5) if out[r].abs().sum() > 0])
    # experts 1: rows 0, 2; 2: rows 1, 4; 3: rows 2, 3; 4: rows 0-4 (blocks 0-1, 2-3, 4); 5: rows 3, 4; 6: rows 0, 1
    assert seen == [[0, 2], [1, 4], [2, 3], [0, 1], [2, 3], [4], [3, 4], [0, 1], [], []]


def test_moe_mlp_checks_its_operands():
    g = me.Graph()
    x, logits = g.input("x", [1, 64], me.f32), g.input("l", [1, 5], me.f32)
    wg, wu = g.weight("wg", [5, 32, 64], me.f32), g.weight("wu", [5, 32, 64], me.f32)
    wd = g.weight("wd", [5, 64, 32], me.f32)
    with pytest.raises(me.ShapeError, match="top_k must be an int in \\[1, 5\\]"):
        me.moe_mlp(x, logits, wg, wu, wd, top_k=6, normalize=True)
    with pytest.raises(me.ShapeError, match="w_down .* does not match w_gate"):
        me.moe_mlp(x, logits, wg, wu, g.weight("bad", [5, 32, 64], me.f32), top_k=2, normalize=True)
    with pytest.raises(me.ShapeError, match="router_logits .* must be \\[..., 5\\]"):
        me.moe_mlp(x, g.input("l4", [1, 4], me.f32), wg, wu, wd, top_k=2, normalize=True)
    rows, logits = g.input("xn", [me.sym("n"), 64], me.f32), g.input("ln", [me.sym("n"), 5], me.f32)
    with pytest.raises(me.ShapeError, match="top_k must be an int in \\[1, 5\\]"):  # (many rows: the same checks)
        me.moe_mlp(rows, logits, wg, wu, wd, top_k=6, normalize=True)
    with pytest.raises(me.ShapeError, match="router_logits .* must be \\[..., 5\\] with x's rows"):
        me.moe_mlp(rows, g.input("l1", [3, 5], me.f32), wg, wu, wd, top_k=2, normalize=True)


BASE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("override,field", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(UnsupportedConfig, match=f"'{field}'"):
        ModelConfig.from_hf({**BASE, **override})


def test_config_reads_transformers5_expert_count():
    cfg = {k: v for k, v in BASE.items() if k != "num_experts"}
    assert ModelConfig.from_hf({**cfg, "num_local_experts": 6}).moe.experts == 6


def test_hidden_size_the_experts_cannot_read_is_named():
    """The kernel reads expert weight rows (hidden_size elements) 16 bytes at a time: hidden_size 68 in
    bf16 (136 bytes) is refused naming the field when the graph is built (was: a RuntimeError from
    the rewrite, "no block-op lowering for node %37 (moe_mlp)"); in f32 (272 bytes) it runs."""
    cfg = ModelConfig.from_hf({**BASE, "hidden_size": 68, "torch_dtype": "bfloat16"})
    with pytest.raises(UnsupportedConfig, match="'hidden_size' = 68 .* a multiple of 8"):
        build_decode_graph(cfg, max_len=8)
    dense = ModelConfig.from_hf({**BASE, "hidden_size": 68, "torch_dtype": "bfloat16", "decoder_sparse_step": 3})
    build_decode_graph(dense, max_len=8)  # no sparse layer among the 2: nothing routed
    graph, spec = build_decode_graph(dataclasses.replace(cfg, dtype=me.f32), max_len=8)
    weights = {n: torch.randn(s, generator=torch.Generator().manual_seed(0)) * 0.1 for n, s in spec.weights.items()}
    step = kernel_step(me.compile(graph, weights, backend="sim", max_dims={"pos": 7}), spec.new_caches())
    want = reference_step(graph, weights, spec.new_caches())
    token = torch.tensor([3], dtype=torch.int32)
    got, ref = step(token, 0)[0], want(token, 0)[0]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_checkpoint_missing_expert_is_named(tmp_path):
    hf_moe(5, num_experts=3, num_experts_per_tok=2).save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, spec = build_decode_graph(read_config(tmp_path), max_len=16)
    with pytest.raises(CheckpointError, match="missing tensor\\(s\\) model.layers.2.mlp.experts.1.up_proj.weight"):
        load_checkpoint(tmp_path, spec)


def test_floor_counts_only_the_routed_experts():
    cfg = ModelConfig.preset("qwen3-30b-a3b")
    _, spec = build_decode_graph(cfg, max_len=64)
    expert = 3 * cfg.hidden * cfg.moe.intermediate * 2  # bytes of one expert's three matrices
    routed = len(cfg.moe.sparse_layers) * expert * (cfg.moe.experts - cfg.moe.top_k)
    assert spec.weight_bytes - spec.step_bytes == routed
    assert cfg.moe.sparse_layers == tuple(range(48))


def test_routing_ties_go_to_the_lower_expert():
    """Tied router logits (bf16 ties at the top-k's edge in ~8% of a random 128-expert model's layers): the lower
    expert first, as the CUDA routing takes them, whatever order topk would give."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    p, ids = moe_routing(logits, 3, False, torch.float32)
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    assert torch.allclose(p[0], logits[0].softmax(-1)[[1, 2, 3]])
    p, _ = moe_routing(logits, 3, True, torch.float32)
    assert torch.allclose(p.sum(-1), torch.ones(2))

"""The PyTorch baseline decoders against the reference executor (CPU, f32): megaegg.models.torch_decode
(the reference's rounding) and megaegg.models.torch_plain (the plain gpt-fast-style step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights
from megaegg.models import torch_plain
from megaegg.models.torch_decode import TorchDecoder
from megaegg.models.torch_plain import PlainDecoder

SMALL = dict(
    hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, vocab_size=311, max_position_embeddings=4096, torch_dtype="bfloat16",
)
CONFIGS = {
    "tiny": ModelConfig.preset("tiny"),
    # a 2-layer Qwen3 (per-head q/k norm, untied LM head)
    "qwen3-2l": ModelConfig.from_hf({"model_type": "qwen3", **SMALL,
                                     "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),
    # a 2-layer Llama 3 (llama3 rope scaling, tied embeddings, GQA 4:1)
    "llama3-2l": ModelConfig.from_hf({"model_type": "llama", **SMALL, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                      "rope_theta": 500000.0, "rope_scaling": {
                                          "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    # Qwen3-MoE: routed experts in layer 1, a dense MLP in layer 0
    "qwen3-moe-tiny": ModelConfig.preset("qwen3-moe-tiny"),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def f32(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, dtype=me.f32)


def random_caches(spec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in spec.caches.items()}


@pytest.mark.parametrize("attention", ["sdpa", "exact"])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_match_reference(name, fuse, attention):
    cfg, max_len = f32(CONFIGS[name]), 24
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=7)
    dec = TorchDecoder(cfg, weights, max_len=max_len, device="cpu", fuse=fuse, attention=attention)
    # start from random (not zero) caches: rows past pos must not be read, rows before it must be
    ref_caches = random_caches(spec, seed=3)
    dec.load_caches(ref_caches)
    tokens = [5, 17, 99, 3, 42, 7, 8, 300 % cfg.vocab]
    with torch.no_grad():
        for pos, tok in enumerate(tokens + [0] * 3):
            pos = pos if pos < len(tokens) else max_len - 1 - (pos - len(tokens))  # and the last rows
            t = torch.tensor([tok], dtype=torch.int32)
            logits, nxt = dec.step(t, torch.tensor([pos]))
            ref = me.run_reference(graph, {"token": t, **ref_caches}, weights, {"pos": pos})
            assert logits.shape == ref["logits"].shape and logits.dtype == ref["logits"].dtype
            assert rel_err(logits, ref["logits"]) < 1e-4, f"{name} pos {pos}"
            assert nxt.dtype == torch.int32 and nxt.shape == (1,)
            assert nxt.item() == ref["next_token"].item()
            for cname, c in dec.caches.items():
                assert rel_err(c, ref_caches[cname]) < 1e-5, f"{cname} after pos {pos}"


def test_bf16_close_to_reference():
    """In bf16 the baseline rounds like the reference: logits agree to bf16 precision."""
    cfg, max_len = CONFIGS["qwen3-2l"], 16
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=1)
    dec = TorchDecoder(cfg, weights, max_len=max_len, device="cpu", attention="exact")
    ref_caches = spec.new_caches()
    with torch.no_grad():
        for pos, tok in enumerate([1, 2, 3, 4]):
            t = torch.tensor([tok], dtype=torch.int32)
            logits, _ = dec.step(t, torch.tensor([pos]))
            ref = me.run_reference(graph, {"token": t, **ref_caches}, weights, {"pos": pos})
            assert logits.dtype == torch.bfloat16
            assert rel_err(logits, ref["logits"]) < 2e-2


@pytest.mark.parametrize("decoder, config", [("ref", "llama3-2l"), ("plain", "qwen3-2l")])
def test_one_graph_for_all_positions(decoder, config):
    """Position is data, not a guard: dynamo traces the step once, without graph breaks."""
    from torch._dynamo.testing import CompileCounter

    make = {"ref": TorchDecoder, "plain": PlainDecoder}[decoder]
    torch._dynamo.reset()
    cfg, max_len = f32(CONFIGS[config]), 16
    graph, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=2)
    eager = make(cfg, weights, max_len=max_len, device="cpu")
    dec = make(cfg, weights, max_len=max_len, device="cpu")
    counter = CompileCounter()
    step = torch.compile(dec, backend=counter, fullgraph=True)
    with torch.no_grad():
        for pos in range(5):
            t = torch.tensor([pos + 1], dtype=torch.int32)
            want, _ = eager.step(t, torch.tensor([pos]))
            got, _ = step(t, torch.tensor([pos]))
            assert rel_err(got, want) < 1e-6
    assert counter.frame_count == 1
    for name, c in dec.caches.items():
        assert torch.equal(c, eager.caches[name])
    torch._dynamo.reset()


def test_rejects_mismatched_inputs():
    cfg = CONFIGS["tiny"]
    _, spec = build_decode_graph(cfg, max_len=8)
    weights = random_weights(spec)
    with pytest.raises(me.GraphError, match="must be f32"):
        TorchDecoder(f32(cfg), weights, max_len=8, device="cpu")
    dec = TorchDecoder(cfg, weights, max_len=8, device="cpu")
    with pytest.raises(me.GraphError, match="caches"):
        dec.load_caches({"k_cache.0": torch.zeros(2, 8, 64)})
    with pytest.raises(ValueError, match="attention"):
        TorchDecoder(cfg, weights, max_len=8, device="cpu", attention="flash")


# --- PlainDecoder (megaegg.models.torch_plain): the gpt-fast-style peer -----------------------
PLAIN_CONFIGS = {f"{p}-{'tied' if tie else 'untied'}": dataclasses.replace(ModelConfig.preset(p), tie_embeddings=tie)
                 for p in ("tiny", "qwen3-tiny") for tie in (False, True)}
PLAIN_CONFIGS["llama3-2l"] = CONFIGS["llama3-2l"]  # llama3 rope scaling, GQA 4:1
PLAIN_CONFIGS["qwen3-moe-tiny"] = CONFIGS["qwen3-moe-tiny"]  # a plain loop over the chosen experts


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "repeat_interleave"])
@pytest.mark.parametrize("attention", torch_plain.ATTENTION)
@pytest.mark.parametrize("name", list(PLAIN_CONFIGS))
def test_plain_matches_exact(name, attention, gqa, monkeypatch):
    """f32: the plain step's logits match TorchDecoder(attention="exact") (the reference's
    arithmetic) over steps at scattered positions from random caches; greedy tokens and
    the caches agree too."""
    monkeypatch.setattr(torch_plain, "HAS_ENABLE_GQA", gqa and torch_plain.HAS_ENABLE_GQA)
    cfg, max_len = f32(PLAIN_CONFIGS[name]), 24
    _, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=7)
    exact = TorchDecoder(cfg, weights, max_len=max_len, device="cpu", fuse=False, attention="exact")
    plain = PlainDecoder(cfg, weights, max_len=max_len, device="cpu", attention=attention)
    caches = random_caches(spec, seed=3)
    exact.load_caches(caches)
    plain.load_caches(caches)
    with torch.no_grad():
        for pos, tok in [(0, 5), (1, 17), (9, 99), (max_len - 1, 3), (13, 300 % cfg.vocab)]:
            t, p = torch.tensor([tok], dtype=torch.int32), torch.tensor([pos])
            want, want_next = exact.step(t, p)
            got, got_next = plain.step(t, p)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert rel_err(got, want) < 1e-4, f"{name} pos {pos}"
            assert got_next.dtype == torch.int32 and got_next.shape == (1,)
            assert got_next.item() == want_next.item()
    for cname, c in plain.caches.items():
        assert rel_err(c, exact.caches[cname]) < 1e-5, cname


def test_plain_shares_unfused_weights():
    """Only q/k/v and gate/up are copied (concatenated); the rest share the caller's storage."""
    cfg = f32(ModelConfig.preset("tiny"))
    _, spec = build_decode_graph(cfg, max_len=8)
    weights = random_weights(spec)
    dec = PlainDecoder(cfg, weights, max_len=8, device="cpu")
    assert dec.embed_tokens.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    assert dec.layers[0].wo.data_ptr() == weights["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    assert dec.layers[0].wqkv.shape[0] == (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim


def test_plain_bf16_close_to_exact():
    cfg, max_len = ModelConfig.preset("qwen3-tiny"), 16
    _, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=1)
    exact = TorchDecoder(cfg, weights, max_len=max_len, device="cpu", attention="exact")
    plain = PlainDecoder(cfg, weights, max_len=max_len, device="cpu")
    with torch.no_grad():
        for pos, tok in enumerate([1, 2, 3, 4]):
            t, p = torch.tensor([tok], dtype=torch.int32), torch.tensor([pos])
            want, _ = exact.step(t, p)
            got, _ = plain.step(t, p)
            assert got.dtype == torch.bfloat16
            assert rel_err(got, want) < 3e-2


def test_plain_rejects_mismatched_inputs():
    cfg = CONFIGS["tiny"]
    _, spec = build_decode_graph(cfg, max_len=8)
    weights = random_weights(spec)
    with pytest.raises(me.GraphError, match="must be f32"):
        PlainDecoder(f32(cfg), weights, max_len=8, device="cpu")
    with pytest.raises(me.GraphError, match="max_len"):
        PlainDecoder(cfg, weights, max_len=cfg.max_positions + 1, device="cpu")
    dec = PlainDecoder(cfg, weights, max_len=8, device="cpu")
    with pytest.raises(me.GraphError, match="caches"):
        dec.load_caches({"k_cache.0": torch.zeros(2, 8, 64)})
    with pytest.raises(ValueError, match="attention"):
        PlainDecoder(cfg, weights, max_len=8, device="cpu", attention="flash")


def test_bench_dry_run_has_plain_peers(tmp_path):
    """examples/bench_decode.py --dry-run (CPU) times both families of peers; CUDA graphs and
    torch.compile report skipped; the best peer is named and is in the JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parent.parent / "examples" / "bench_decode.py"
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(bench), "--dry-run", "--iters", "2", "--warmup", "1", "--bw-reps", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line for line in run.stdout.splitlines() if "|" in line}
    assert "vs best peer" in rows["variant"]
    for name in ("ref-rounding eager", "plain eager", "megakernel"):
        assert name in rows and "SKIPPED" not in rows[name], name
    for name in ("ref-rounding CUDA graph", "plain CUDA graph", "ref-rounding torch.compile reduce-overhead",
                 "plain torch.compile", "plain torch.compile reduce-overhead"):
        assert "SKIPPED" in rows[name], name
    report = json.loads(out.read_text())
    best = report["best_peer"]
    assert best["name"] in ("ref-rounding eager", "plain eager")
    assert f"best peer: {best['name']}" in run.stdout
    v = report["variants"]
    assert v[best["name"]]["vs_best_peer"] == 1.0 and v["megakernel"]["vs_best_peer"] > 0
    for name in ("ref-rounding eager", "plain eager"):
        assert v[name]["vs_exact"]["next_token_equal"] and v[name]["vs_exact"]["rel_err_max"] < 1e-4

    run = subprocess.run([sys.executable, str(bench), "--dry-run", "--iters", "1", "--warmup", "0", "--bw-reps", "1",
                          "--skip-ref-rounding", "--skip-compile-baseline", "--no-reference-check"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[0].strip() for line in run.stdout.splitlines() if "|" in line]
    assert rows[rows.index("memory floor"):] == ["memory floor", "plain eager", "plain CUDA graph", "megakernel"]
    assert "plain eager vs exact: rel err max" in run.stdout


def test_bench_dry_run_tensor_parallel(tmp_path):
    """--tp 2 on the CPU: the plain step over 2 gloo processes and the megakernel over 2 simulated GPUs,
    both checked against the exact step, and the summary line naming the TP peer."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parent.parent / "examples" / "bench_decode.py"
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(bench), "--dry-run", "--tp", "2", "--iters", "1", "--warmup", "0",
                          "--bw-reps", "1", "--skip-ref-rounding", "--no-reference-check", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    v = json.loads(out.read_text())["variants"]
    assert v["plain tp=2 eager"]["status"] == "ok", v["plain tp=2 eager"]
    assert v["plain tp=2 eager"]["vs_exact"]["next_token_equal"] and v["plain tp=2 eager"]["vs_exact"]["rel_err_max"] < 1e-4
    assert v["megakernel tp=2"]["status"] == "ok" and v["megakernel tp=2"]["correctness"]["next_token_equal"]
    assert v["plain tp=2 CUDA graph"]["status"] == "skipped"
    assert "tensor parallel over 2 GPUs: megakernel tp=2" in run.stdout and "best PyTorch tp=2 peer (plain tp=2 eager" in run.stdout


# --- PlainBatch (megaegg.models.torch_batch): the batched peer of the step graph ------------------
@pytest.mark.parametrize("batch", [2, 3], ids=["gathered", "every-expert"])
def test_plain_batch_moe_matches_one_sequence_at_a_time(batch):
    """f32 Qwen3-MoE (top-3 of 7 experts): PlainBatch's prompt and its batched decode steps give each sequence's
    logits as PlainDecoder (checked against the reference's arithmetic above) run on that sequence alone; 2
    rows gather their experts (6 picks < 7 experts), 3 run every expert weighted by the routing, as does the
    5-token prompt."""
    from megaegg.models.torch_batch import PlainBatch

    cfg, max_len = f32(CONFIGS["qwen3-moe-tiny"]), 16
    _, spec = build_decode_graph(cfg, max_len=max_len)
    weights = random_weights(spec, seed=7)
    weights = {n: t * 3 if ".mlp.gate." in n else t for n, t in weights.items()}  # (spread routing: fewer near-ties)
    peer = PlainBatch(cfg, weights, max_len=max_len, slots=batch, device="cpu")
    alone = [PlainDecoder(cfg, weights, max_len=max_len, device="cpu") for _ in range(batch)]
    prompt = [5, 17, 99, 3, 42]
    with torch.no_grad():
        got, _ = peer.prefill(torch.tensor(prompt, dtype=torch.int32))
        for pos, tok in enumerate(prompt):
            want, _ = alone[0].step(torch.tensor([tok], dtype=torch.int32), torch.tensor([pos]))
        assert rel_err(got, want) < 1e-4
        positions = [len(prompt)] + [0] * (batch - 1)  # sequence 0 goes on after its prompt, the others start
        for step in range(3):
            tokens = [(7 + 31 * i + 5 * step) % cfg.vocab for i in range(batch)]
            got, got_next = peer.decode(torch.tensor(tokens, dtype=torch.int32), torch.tensor(positions))
            for i, dec in enumerate(alone):
                want, want_next = dec.step(torch.tensor([tokens[i]], dtype=torch.int32), torch.tensor([positions[i]]))
                assert rel_err(got[i : i + 1], want) < 1e-4, (step, i)
                assert got_next[i].item() == want_next.item()
            positions = [p + 1 for p in positions]

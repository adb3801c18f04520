"""Real model configs on the GPU against Hugging Face transformers (random bf16 weights).

The same 32-token sequence goes through transformers (one forward over the sequence)
and through the megakernel (one launch per token). The reference is transformers in
f32 on the bf16-valued weights; transformers' own bf16 run is measured against it too,
since rounding activations to bf16 at every op costs ~2% over 16-36 random layers
whoever does it. Logits at every step must be within max(2e-2, 1.25 x transformers'
own bf16 error) of the f32 reference, with the same argmax wherever the reference's
top-2 margin exceeds that tolerance.
"""

import os

import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, kernel_step, random_weights

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
PRESETS = os.environ.get("MEGAEGG_HF_PRESETS", "llama-3.2-1b,qwen3-0.6b,qwen3-1.7b,qwen3-8b").split(",")
TOL = 2e-2


def hf_model(preset: str, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """The transformers model of ``preset`` holding our (bf16-valued) weights in f32."""
    from megaegg.models.presets import PRESETS as HF

    conf = {k: v for k, v in HF[preset].items() if k not in ("architectures", "model_type", "torch_dtype")}
    cls = transformers.LlamaForCausalLM if cfg.arch == "llama" else transformers.Qwen3ForCausalLM
    config_cls = transformers.LlamaConfig if cfg.arch == "llama" else transformers.Qwen3Config
    with torch.device(next(iter(weights.values())).device):
        model = cls(config_cls(**conf)).float()
    state = dict(weights)  # (load_state_dict copies into the f32 parameters: no second f32 copy, so 8B fits 80 GB)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("preset", PRESETS)
def test_logits_match_transformers(preset):
    cfg = ModelConfig.preset(preset)
    graph, spec = build_decode_graph(cfg, max_len=64)
    need = 3 * sum(torch.Size(s).numel() for s in spec.weights.values()) * 2 + (4 << 30)  # bf16 + the f32 model
    free = torch.cuda.mem_get_info()[0]
    if free < need:  # (other processes on this GPU, e.g. pytest -n: run it alone)
        pytest.skip(f"{preset} needs ~{need / 2**30:.0f} GiB of GPU memory free; {free / 2**30:.0f} GiB are")
    weights = random_weights(spec, seed=5, device="cuda")
    kernel = me.compile(graph, weights, backend="cuda", max_dims={"pos": 63})
    step = kernel_step(kernel, spec.new_caches("cuda"))
    ids = torch.randint(0, cfg.vocab, (32,), generator=torch.Generator().manual_seed(1))
    ours = [step(torch.tensor([t], dtype=torch.int32, device="cuda"), pos)[0].float()[0] for pos, t in enumerate(ids.tolist())]
    model = hf_model(preset, cfg, weights)
    with torch.no_grad():
        ref = model(ids[None].cuda()).logits[0].float()
        hf16 = model.to(torch.bfloat16)(ids[None].cuda()).logits[0].float()
    del model
    worst, worst_hf = 0.0, 0.0
    for pos in range(32):
        err = ((ours[pos] - ref[pos]).norm() / ref[pos].norm()).item()
        err_hf = ((hf16[pos] - ref[pos]).norm() / ref[pos].norm()).item()
        worst, worst_hf = max(worst, err), max(worst_hf, err_hf)
        tol = max(TOL, 1.25 * err_hf)
        assert err < tol, f"{preset} pos {pos}: logits rel err {err:.3e} (transformers bf16: {err_hf:.3e})"
        top2 = ref[pos].topk(2)
        if (top2.values[0] - top2.values[1]) > tol * top2.values[0].abs():
            assert ours[pos].argmax().item() == top2.indices[0].item(), f"{preset} pos {pos}: argmax differs"
    print(f"\n{preset}: worst logits rel err over 32 steps: megakernel {worst:.3e}, transformers bf16 {worst_hf:.3e}")

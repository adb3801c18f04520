"""GPU: Hugging Face models through their own modelling code (megaegg.from_transformers) in bf16: a
prompt long enough for the tensor-core program (gemm tiles, flash attention) and decode steps, against
transformers' own forward of the same tokens."""

import pytest
import torch

import megaegg as me

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# head dim 64 (the flash body's), 4 query heads a KV head, K a multiple of 8 (tensor maps)
CFG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_long_prompt_then_decode_steps_match_transformers(arch):
    torch.manual_seed(0)
    cfg = (transformers.LlamaConfig(**CFG) if arch == "llama" else transformers.Qwen3Config(**CFG, head_dim=64))
    model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    lm = me.from_transformers(model, max_len=512, backend="cuda")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (300,), generator=gen).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids], device="cuda")).logits[0].float()
    assert rel(lm.prompt(ids[:296]), want[295]) < 2e-2  # (296 rows: the large-rows program where it has one)
    for p in range(296, 300):
        assert rel(lm.step(ids[p], p), want[p]) < 2e-2

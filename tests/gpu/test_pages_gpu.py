"""GPU: the megakernel with the weight page ring on (a loader warp streams weights into shared
memory, interpreter/cuda/pages.cuh) against the reference executor; a wait that can never be met
still ends in an error naming the op, with the loader stopped, never a hang."""

import dataclasses
import pytest
import torch

import megaegg as me
from megaegg.models import ModelConfig, build_decode_graph, random_weights

pytestmark = pytest.mark.gpu
RING = "MEGA_SMEM=57344,MEGA_PAGES=10"
# the interpreters: the claimed ring, the static order with and without the ring (megakernel.cu)
VARIANTS = {"ring": RING, "static-ring": f"MEGA_STATIC=1,{RING},MEGA_INFLIGHT=4,MEGA_SLOTS=8", "static": "MEGA_STATIC=1"}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "llama-3.2-1b"])
def test_paged_model_matches_reference(preset, variant, monkeypatch):
    monkeypatch.setenv("MEGAEGG_DEFINES", VARIANTS[variant])
    cfg = ModelConfig.preset(preset)
    if cfg.layers > 2:
        cfg = dataclasses.replace(cfg, layers=2)
    g, spec = build_decode_graph(cfg, max_len=64)
    W = random_weights(spec, seed=2, device="cuda")
    k = me.compile(g, W, backend="cuda", max_dims={"pos": 63})
    paged = "MEGA_PAGES" in VARIANTS[variant]
    assert (k.artifact.defines["MEGA_PAGES"] == 10 and "mega_load_rows(" in k.artifact.source) == paged
    caches, ref_caches = spec.new_caches("cuda"), spec.new_caches("cuda")
    for pos, tok in enumerate([5, 17, 99, 3, 42, 7]):
        t = torch.tensor([tok], dtype=torch.int32, device="cuda")
        out = k(token=t, pos=pos, **caches)
        ref = me.run_reference(g, {"token": t, **ref_caches}, W, {"pos": pos})
        assert rel(out["logits"], ref["logits"]) < 2e-2, f"pos {pos}"
        top2 = ref["logits"].float().topk(2).values[0]
        if (top2[0] - top2[1]) > 2e-2 * top2[0].abs():
            assert out["next_token"].item() == ref["next_token"].item()


@pytest.mark.parametrize("variant", ["ring", "static-ring"])
def test_paged_timeout_names_the_op(variant, monkeypatch):
    from megaegg.compiler import Kernel, build_artifact
    from megaegg.interpreter.nvrtc import compile_cubin
    from megaegg.interpreter.render import defines, render

    monkeypatch.setenv("MEGAEGG_DEFINES", VARIANTS[variant])
    g, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=64)
    art = build_artifact(g, max_dims={"pos": 63}, compile_cuda=False)
    q, n = art.queue, len(art.queue.entries)
    k_bad = max(k for k, e in enumerate(q.entries) if art.table[2 * n + k] and e.waits)  # a paged entry that waits
    e = q.entries[k_bad]
    bad = tuple(dataclasses.replace(w, expected=w.expected + 1) for w in e.waits)
    q = dataclasses.replace(q, entries=q.entries[:k_bad] + (dataclasses.replace(e, waits=bad),) + q.entries[k_bad + 1:])
    defs = {**defines(), "MEGA_TIMEOUT_NS": 200_000_000}
    rendered = render(q, defs)
    art = dataclasses.replace(art, queue=q, source=rendered.source, table=rendered.table.words(), defines=defs,
                              cubin=compile_cubin(rendered.source, defines=defs).cubin)
    k = Kernel(art, random_weights(spec, seed=3, device="cuda"), backend="cuda")
    t = torch.tensor([5], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=rf"barrier wait timed out in op{e.op.id} {e.op.kind}"):
        k(token=t, pos=2, **spec.new_caches("cuda"))

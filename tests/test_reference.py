"""The reference executor against hand-written torch for a Llama-style decoder layer."""

import math

import pytest
import torch

import megaegg as me

H, HQ, HKV, D, F, SMAX = 64, 4, 2, 16, 96, 32


def build_layer(dtype):
    """A Llama decoder layer for one decode token, written with the Graph API."""
    g = me.Graph("layer")
    pos = me.sym("pos")
    x = g.input("x", [1, H], dtype)
    kc, vc = g.input("k_cache", [HKV, SMAX, D], dtype), g.input("v_cache", [HKV, SMAX, D], dtype)
    w = {n: g.weight(n, s, dtype) for n, s in WEIGHTS.items()}
    h = me.rms_norm(x, w["ln1"], 1e-5)
    q = me.rope(me.linear(h, w["wq"]).reshape(HQ, D), pos, theta=10000.0)
    k = me.rope(me.linear(h, w["wk"]).reshape(HKV, D), pos, theta=10000.0)
    v = me.linear(h, w["wv"]).reshape(HKV, D)
    attn = me.attention(q, me.kv_append(kc, k, pos), me.kv_append(vc, v, pos), pos + 1)
    x = x + me.linear(attn.reshape(1, HQ * D), w["wo"])
    h = me.rms_norm(x, w["ln2"], 1e-5)
    x = x + me.linear(me.silu(me.linear(h, w["wg"])) * me.linear(h, w["wu"]), w["wd"])
    g.output("y", x)
    return g


WEIGHTS = dict(ln1=[H], wq=[HQ * D, H], wk=[HKV * D, H], wv=[HKV * D, H], wo=[H, HQ * D], ln2=[H], wg=[F, H],
               wu=[F, H], wd=[H, F])


def torch_layer(x, kc, vc, W, pos):
    """The same layer in plain torch (fp32 math, rounding to the storage dtype per op)."""
    dt = x.dtype

    def r(t):
        return t.to(dt).float()

    def norm(t, g):
        t = t.float()
        return r(r(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)) * g.float())

    def lin(t, w):
        return r(t @ w.float().T)

    def rope(t):
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
        ang = pos * inv
        cos, sin = torch.cat([ang.cos()] * 2), torch.cat([ang.sin()] * 2)
        rot = torch.cat([-t[:, D // 2:], t[:, : D // 2]], -1)
        return r(t * cos + rot * sin)

    h = norm(x, W["ln1"])
    q = rope(lin(h, W["wq"]).reshape(HQ, D))
    k = rope(lin(h, W["wk"]).reshape(HKV, D))
    v = lin(h, W["wv"]).reshape(HKV, D)
    kc[:, pos], vc[:, pos] = k.to(dt), v.to(dt)
    kk = kc[:, : pos + 1].float().repeat_interleave(HQ // HKV, 0)
    vv = vc[:, : pos + 1].float().repeat_interleave(HQ // HKV, 0)
    p = torch.softmax(torch.einsum("hd,hld->hl", q, kk) / math.sqrt(D), -1)
    a = r(torch.einsum("hl,hld->hd", p, vv)).reshape(1, HQ * D)
    x1 = r(x.float() + lin(a, W["wo"]))
    h2 = norm(x1, W["ln2"])
    m = r(r(torch.nn.functional.silu(lin(h2, W["wg"]))) * lin(h2, W["wu"]))
    return r(x1 + lin(m, W["wd"]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_decoder_layer_matches_torch(dtype, tol, seed):
    torch.manual_seed(1000 + seed)
    md = me.f32 if dtype == torch.float32 else me.bf16
    g = build_layer(md)
    W = {n: (torch.randn(s) * (0.3 if len(s) == 2 else 0.1) + (1.0 if len(s) == 1 else 0.0)).to(dtype) for n, s in WEIGHTS.items()}
    x = torch.randn(1, H).to(dtype)
    kc, vc = torch.randn(HKV, SMAX, D).to(dtype), torch.randn(HKV, SMAX, D).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    for pos in (0, 5, SMAX - 1):
        out = me.run_reference(g, {"x": x, "k_cache": kc, "v_cache": vc}, W, {"pos": pos})["y"]
        ref = torch_layer(x, kc2, vc2, W, pos)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < tol, f"pos {pos}: relative error {err}"
        for got, want in ((kc, kc2), (vc, vc2)):  # the caches were updated in place alike
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_layer_is_about_30_lines():
    import inspect

    assert len(inspect.getsource(build_layer).splitlines()) <= 30


def test_reference_ops_against_torch():
    torch.manual_seed(7)
    g = me.Graph()
    a = g.input("a", [3, 5], me.f32)
    b = g.input("b", [5], me.f32)
    g.output("sm", me.softmax(a, 0))
    g.output("mm", a @ g.input("m", [5, 2], me.f32))
    g.output("bc", a * b)
    g.output("cat", me.concat([a, me.slice(a, 1, 1, 3)], 1))
    g.output("perm", me.permute(a, [1, 0]))
    g.output("am", me.argmax(a, 1))
    g.output("emb", me.embedding(g.weight("t", [7, 5], me.f32), g.input("ids", [4], me.i32)))
    A, B, M, T = torch.randn(3, 5), torch.randn(5), torch.randn(5, 2), torch.randn(7, 5)
    ids = torch.tensor([6, 0, 3, 3], dtype=torch.int32)
    out = me.run_reference(g, {"a": A, "b": B, "m": M, "ids": ids}, {"t": T})
    torch.testing.assert_close(out["sm"], A.softmax(0))
    torch.testing.assert_close(out["mm"], A @ M)
    torch.testing.assert_close(out["bc"], A * B)
    torch.testing.assert_close(out["cat"], torch.cat([A, A[:, 1:3]], 1))
    torch.testing.assert_close(out["perm"], A.T)
    assert out["am"].dtype == torch.int32 and torch.equal(out["am"], A.argmax(1).int())
    torch.testing.assert_close(out["emb"], T[ids.long()])

"""Each block op alone on the GPU against the reference executor (fresh random data)."""

import zlib

import pytest
import torch

import megaegg as me
from op_cases import CASES

pytestmark = pytest.mark.gpu
P = me.sym("pos")


def _check(g, inputs, weights, dims, tol, max_dim=64):
    k = me.compile(g, weights, backend="cuda", max_dims={s: max_dim for s in g.symbols()})
    ins_ref = {n: t.clone() for n, t in inputs.items()}
    out = k(**inputs, **dims)
    ref = me.run_reference(g, ins_ref, weights, dims)
    for name, r in ref.items():
        o = out[name]
        if r.is_floating_point():
            err = ((o.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
            assert err < tol, f"{name}: relative error {err}"
        else:
            assert torch.equal(o, r), name


def _rand(shape, dt):
    return torch.randn(shape, device="cuda").to(dt.torch)


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-5), (me.bf16, 1e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_op(case, dt, tol):
    torch.manual_seed(zlib.crc32(case.encode()) % 1000)  # hash() varies per process (PYTHONHASHSEED)
    build, ins, ws = CASES[case](dt)
    g = me.Graph(case)
    build(g)
    _check(g, {n: _rand(s, dt) for n, s in ins.items()}, {n: _rand(s, dt) for n, s in ws.items()}, {"pos": 9} if g.symbols() else {}, tol)


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-5), (me.bf16, 1e-2)], ids=["f32", "bf16"])
def test_embedding(dt, tol):
    g = me.Graph()
    g.output("y", me.embedding(g.weight("t", [50, 96], dt), g.input("ids", [3], me.i32)))
    _check(g, {"ids": torch.tensor([49, 0, 7], dtype=torch.int32, device="cuda")}, {"t": _rand([50, 96], dt)}, {}, tol)


@pytest.mark.parametrize("dt, tol", [(me.f32, 1e-4), (me.bf16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("hq, hkv, d, pos", [(4, 2, 64, 9), (8, 2, 128, 40), (4, 4, 64, 0), (16, 2, 128, 200),
                                            (8, 2, 64, 150)])
def test_attention_kv_append(dt, tol, hq, hkv, d, pos):
    """G = hq / hkv query heads a KV head: bf16 at G >= 4 runs the tensor-core body (attention.cuh: attn_partial),
    several splits where pos >= 64."""
    g = me.Graph()
    n = 64 if pos < 64 else 256
    kc, vc = g.input("kc", [hkv, n, d], dt), g.input("vc", [hkv, n, d], dt)
    kc2 = me.kv_append(kc, g.input("k", [hkv, d], dt), P)
    vc2 = me.kv_append(vc, g.input("v", [hkv, d], dt), P)
    g.output("y", me.attention(g.input("q", [hq, d], dt), kc2, vc2, P + 1))
    ins = {"kc": _rand([hkv, n, d], dt), "vc": _rand([hkv, n, d], dt), "k": _rand([hkv, d], dt),
           "v": _rand([hkv, d], dt), "q": _rand([hq, d], dt)}
    _check(g, ins, {}, {"pos": pos}, tol, max_dim=n - 1)

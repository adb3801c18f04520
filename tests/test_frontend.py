"""megaegg.from_torch: a module or function through torch.export into a kernel (simulator), against eager."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import megaegg as me
from megaegg.frontend import ATEN, UnsupportedTorch


class GatedBlock(nn.Module):
    """Embedding, RMSNorm, a gated MLP with a residual, then a reshape, transpose and softmax in f32."""

    def __init__(self, vocab=100, d=64, f=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        x = self.norm(h)
        y = h + self.down(F.silu(self.gate(x)) * self.up(x))
        return torch.softmax(y.reshape(-1, 4, 16).transpose(0, 1).float(), dim=-1)


def close(got, want, tol=2e-2):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.float().abs().max().item()))


def test_a_module_with_a_runtime_dim_matches_eager():
    torch.manual_seed(0)
    m = GatedBlock().to(torch.bfloat16).eval()
    n = torch.export.Dim("n", min=1, max=64)
    run = me.from_torch(m, (torch.randint(0, 100, (5,)),), dynamic_shapes=({0: n},), backend="sim")
    assert "n" in run.graph.symbols()
    for rows in (5, 13, 1):  # int64 ids, as torch makes them; other row counts than the example's
        ids = torch.randint(0, 100, (rows,), generator=torch.Generator().manual_seed(rows))
        close(run(ids), m(ids))
    assert sorted(w for w in run.graph.weights) == sorted(["p_emb_weight", "p_norm_weight", "p_gate_weight",
                                                           "p_up_weight", "p_down_weight"])


def test_an_export_survives_torchs_constraint_report_failing(monkeypatch):
    """torch 2.11's report of solved dim constraints raises ValueError on a result it cannot split (seen on
    a CUDA export of a transformers model): the report is only words for a violation, so the export goes
    on; a real violation still raises, naming the dim."""
    from torch.fx.experimental.symbolic_shapes import DimConstraints

    def unsplittable(self, *args, **kwargs):
        raise ValueError("not enough values to unpack (expected 3, got 1)")

    monkeypatch.setattr(DimConstraints, "prettify_results", unsplittable)
    torch.manual_seed(0)
    m = GatedBlock().eval()
    n = torch.export.Dim("n", min=1, max=64)
    run = me.from_torch(m, (torch.randint(0, 100, (5,)),), dynamic_shapes=({0: n},), backend="sim")
    ids = torch.randint(0, 100, (7,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        close(run(ids), m(ids))
    with pytest.raises(Exception, match=r"Solved dim constraints:\n.*size\(\)\[0\] == 4"):  # (n fixed at 4)
        me.from_torch(lambda x: x.reshape(4, -1), (torch.randn(4, 3),),
                      dynamic_shapes=({0: torch.export.Dim("n", min=1, max=64)},), backend="sim")
    assert DimConstraints.prettify_results is unsplittable  # (restored after each export)


def test_a_function_of_several_inputs_and_outputs():
    def fn(a, b, w):
        x = torch.cat([a, b], dim=1)  # [n, 96]
        y = x[:, 16:80] @ w  # slice, matmul
        return y.argmax(dim=-1), y.permute(1, 0).contiguous()

    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 32, generator=gen), torch.randn(7, 64, generator=gen)
    w = torch.randn(64, 24, generator=gen)
    n = torch.export.Dim("rows", min=2, max=32)
    run = me.from_torch(fn, (a, b, w), dynamic_shapes=({0: n}, {0: n}, None), backend="sim")
    for rows in (7, 20):
        a, b = torch.randn(rows, 32, generator=gen), torch.randn(rows, 64, generator=gen)
        got, want = run(a, b, w), fn(a, b, w)
        assert isinstance(got, tuple) and len(got) == 2
        assert torch.equal(got[0], want[0].to(torch.int32))
        close(got[1], want[1], tol=1e-4)


def test_a_linear_with_bias_and_a_static_shape():
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 8)).eval()
    x = torch.randn(4, 32)
    run = me.from_torch(m, (x,), backend="sim")
    close(run(x), m(x), tol=1e-4)


def test_an_unsupported_op_names_itself_and_its_source_line():
    def fn(x):
        return torch.erfinv(x) * 2.0  # (erfinv: not in the table)

    with pytest.raises(UnsupportedTorch, match=r"aten\.erfinv\.default is not supported \(.*test_frontend\.py:\d+: return torch\.erfinv"):
        me.from_torch(fn, (torch.randn(4, 8),), backend="sim")


def test_mutated_state_is_refused():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(8))

        def forward(self, x):
            self.total.add_(x.sum(0))
            return x + self.total

    with pytest.raises(UnsupportedTorch, match=r"aten\.add_\.Tensor mutates its input \(.*test_frontend\.py:\d+: self\.total\.add_"):
        me.from_torch(Counter(), (torch.randn(4, 8),), backend="sim")


def test_hugging_face_rotary_embedding_runs_as_written():
    """transformers' own LlamaRotaryEmbedding (cos / sin from the positions and the inv_freq buffer, times
    its attention scaling) and apply_rotary_pos_emb, through from_torch: elementwise ops, equal to eager."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

    class Rotate(nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = LlamaRotaryEmbedding(cfg)

        def forward(self, q, k, pos):
            cos, sin = self.rotary(q, pos)
            return apply_rotary_pos_emb(q, k, cos, sin)

    m = Rotate()
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 4, 6, 16, generator=gen), torch.randn(1, 2, 6, 16, generator=gen)
    pos = torch.arange(3, 9)[None]
    run = me.from_torch(m, (q, k, pos), backend="sim")
    for got, want in zip(run(q, k, pos), m(q, k, pos)):
        close(got, want, tol=1e-5)


def test_a_batched_outer_product_matmul():
    """``inv_freq[None, :, None] @ pos[:, None, :]`` as some transformers versions write RoPE's angles: a
    batched matmul over an inner dim of 1 is a broadcast product; b batched over ones only is a matrix."""
    class M(nn.Module):
        def forward(self, a, b, c):
            return torch.cos(a @ b), a.transpose(1, 2) @ c

    gen = torch.Generator().manual_seed(12)
    a, b, c = torch.randn(1, 8, 1, generator=gen), torch.randn(1, 1, 6, generator=gen), torch.randn(1, 8, 5, generator=gen)
    run = me.from_torch(M(), (a, b, c), backend="sim")
    for got, want in zip(run(a, b, c), M()(a, b, c)):
        close(got, want, tol=1e-5)


def test_a_launcher_checks_the_call_once():
    run = me.from_torch(lambda x, y: x + y, (torch.randn(4, 8), torch.randn(4, 8)), backend="sim")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    launch = run.launcher(x, y)
    launch()  # (the outputs land in the kernel's buffers)
    with pytest.raises(TypeError, match="expected 2 tensor argument"):
        run.launcher(x)


def test_a_scalar_not_exact_in_the_dtype_is_refused_with_the_op():
    with pytest.raises(UnsupportedTorch, match=r"aten\.mul\.Tensor: mul by the scalar 0\.1: not exact in bf16"):
        me.from_torch(lambda x: x * 0.1, (torch.randn(4, 8).bfloat16(),), backend="sim")


def test_calls_are_checked_against_the_export():
    run = me.from_torch(lambda x, y: x + y, (torch.randn(4, 8), torch.randn(4, 8)), backend="sim")
    with pytest.raises(TypeError, match="expected 2 tensor argument"):
        run(torch.randn(4, 8))
    with pytest.raises(TypeError, match="dtype torch.float16, exported with torch.float32"):
        run(torch.randn(4, 8), torch.randn(4, 8).half())


def test_the_table_names_real_aten_ops():
    for key in ATEN:
        ns, name, overload = key.split(".")
        assert ns in ("aten", "megaegg") and hasattr(getattr(getattr(torch.ops, ns), name), overload), key


def test_torch_compile_backend_runs_what_it_takes_and_falls_back_on_the_rest(caplog):
    torch._dynamo.reset()
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8)).eval()
    fast = torch.compile(m, backend="megaegg", dynamic=False)
    x = torch.randn(3, 16)
    with torch.no_grad(), caplog.at_level("WARNING", logger="megaegg.frontend"):
        close(fast(x), m(x), tol=1e-4)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the megakernel ran it, not eager

    def erfinv_mlp(x):  # erfinv is not in the table: that graph runs eagerly, with the reason logged
        return torch.erfinv(torch.tanh(m(x)))

    with torch.no_grad(), caplog.at_level("WARNING", logger="megaegg.frontend"):
        close(torch.compile(erfinv_mlp, backend="megaegg", dynamic=False)(x), erfinv_mlp(x), tol=1e-4)
    assert any("aten.erfinv.default is not supported" in r.getMessage() for r in caplog.records)


def test_torch_compile_backend_never_reads_a_stale_weight(caplog):
    torch._dynamo.reset()
    lin = nn.Linear(8, 8, bias=False).eval()
    fast = torch.compile(lin, backend="megaegg", dynamic=False)
    x = torch.randn(2, 8)
    with torch.no_grad(), caplog.at_level("WARNING", logger="megaegg.frontend"):
        close(fast(x), lin(x), tol=1e-4)
        lin.weight.mul_(2.0)  # changed in place after compiling
        close(fast(x), lin(x), tol=1e-4)
    assert any("a parameter changed" in r.getMessage() for r in caplog.records)


def test_torch_compile_backend_takes_dynamic_sizes_in_one_kernel(caplog, monkeypatch):
    """Dynamo's symbolic sizes (dynamic=True, or its automatic dynamic after a second size) become a runtime
    dim: one megakernel serves every size up to its bound, a size past it compiles again (logged), and
    every call equals eager."""
    from megaegg.frontend import backend as be

    torch._dynamo.reset()
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8)).eval()
    compiles = []
    import megaegg.frontend as fe

    original = fe.compile_exported

    def counted(*a, **k):
        compiles.append(k.get("max_dims"))
        return original(*a, **k)

    monkeypatch.setattr(fe, "compile_exported", counted)
    for dynamic in (True, None):  # (None: Dynamo's default, static first, dynamic from the second size)
        torch._dynamo.reset()
        compiles.clear()
        fast = torch.compile(m, backend="megaegg", dynamic=dynamic)
        with torch.no_grad(), caplog.at_level("WARNING", logger="megaegg.frontend"):
            caplog.clear()
            for rows in (3, 5, 17, 2, 40):
                x = torch.randn(rows, 16)
                close(fast(x), m(x), tol=1e-4)
            assert not caplog.records, [r.getMessage() for r in caplog.records]  # every call a megakernel
            dynamic_builds = [d for d in compiles if d]
            assert len(dynamic_builds) == 1 and list(dynamic_builds[0].values()) == [be.MIN_DYNAMIC_BOUND], compiles
            x = torch.randn(be.MIN_DYNAMIC_BOUND + 1, 16)  # past the bound: compiled again, still right
            close(fast(x), m(x), tol=1e-4)
            assert any("past the compiled bounds" in r.getMessage() for r in caplog.records)
            assert list(compiles[-1].values()) == [be.GROWTH * (be.MIN_DYNAMIC_BOUND + 1)], compiles


def test_sizes_computed_from_a_dynamic_axis(caplog):
    """x.shape[0] * 2 in a reshape (aten.sym_size and a product of sizes in the export) is a runtime-dim
    expression, no op: from_torch and the torch.compile backend both run it (the backend not eagerly)."""
    torch._dynamo.reset()
    lin = nn.Linear(16, 16, bias=False).eval()

    def fn(x):
        y = lin(x).reshape(x.shape[0] * 2, 8)
        return y - y.neg()

    run = me.from_torch(fn, (torch.randn(5, 16),), dynamic_shapes=({0: torch.export.Dim("rows", max=32)},),
                        backend="sim")
    fast = torch.compile(fn, backend="megaegg", dynamic=True)
    with torch.no_grad(), caplog.at_level("WARNING", logger="megaegg.frontend"):
        for rows in (3, 7):
            x = torch.randn(rows, 16)
            close(run(x), fn(x), tol=1e-5)
            close(fast(x), fn(x), tol=1e-5)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_torch_compile_backend_shares_a_size_between_inputs():
    """Two inputs with one symbolic size (a batch of x and of the residual r) share one runtime dim."""
    torch._dynamo.reset()
    lin = nn.Linear(16, 16, bias=False).eval()

    def fn(x, r):
        return F.silu(lin(x)) + r

    fast = torch.compile(fn, backend="megaegg", dynamic=True)
    with torch.no_grad():
        for rows in (3, 9):
            x, r = torch.randn(rows, 16), torch.randn(rows, 16)
            close(fast(x, r), fn(x, r), tol=1e-4)


class WrittenOutRMSNorm(nn.Module):
    """RMSNorm as Hugging Face's LlamaRMSNorm writes it: f32 math, then the weight in the input's dtype."""

    def __init__(self, d, eps=1e-6, exponent=2):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps, self.exponent = eps, exponent

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(self.exponent).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_written_out_rms_norm_becomes_the_matvec_prologue(dtype):
    """pow / mean / rsqrt / casts are recognised by an e-graph rule as rms_norm, which the linear after it
    then takes as its prologue: one block op, and eager's numbers."""
    torch.manual_seed(4)
    m = nn.Sequential(WrittenOutRMSNorm(64), nn.Linear(64, 48, bias=False)).to(dtype).eval()
    rows = torch.export.Dim("rows", max=32)
    run = me.from_torch(m, (torch.randn(6, 64).to(dtype),), dynamic_shapes=({0: rows},), backend="sim")
    assert [(op.kind, op.params["roles"]) for op in run.kernel.program.ops] == [("matvec", ("x", "w", "g"))]
    for n in (6, 17):
        x = torch.randn(n, 64, generator=torch.Generator().manual_seed(n)).to(dtype)
        close(run(x), m(x), tol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_primitive_outside_a_recognised_pattern_is_named():
    """x^3 in place of x^2 is no RMSNorm: the pow has no block op of its own, and the error names it."""
    m = WrittenOutRMSNorm(16, exponent=3).eval()
    with pytest.raises(me.GraphError, match=r"pow .*no block op of the megakernel takes it.*from aten\.pow\.Tensor_Scalar "
                                            r"at .*test_frontend\.py:\d+: variance = hidden_states\.pow"):
        me.from_torch(m, (torch.randn(4, 16),), backend="sim")


def test_written_out_silu_gating_is_the_gated_mlp():
    """x * sigmoid(x) is recognised as SiLU by an e-graph rule: a gated MLP written that way runs as the
    fused gated matvec, and equals eager; alone it is one elementwise silu; a sigmoid in another pattern
    runs as itself."""
    torch.manual_seed(5)
    gate, up, down = (nn.Linear(a, b, bias=False) for a, b in ((16, 48), (16, 48), (48, 16)))

    def mlp(x):
        a = gate(x)
        return down(a * torch.sigmoid(a) * up(x))

    run = me.from_torch(mlp, (torch.randn(1, 16),), backend="sim")
    kinds = [e.op.kind for e in run.kernel.queue.entries]
    assert "glu_down" in kinds or any(e.op.kind == "matvec" and "w2" in e.op.params["roles"]
                                      for e in run.kernel.queue.entries), kinds
    x = torch.randn(1, 16)
    with torch.no_grad():
        close(run(x), mlp(x), tol=1e-4)
    alone = me.from_torch(lambda x: x * torch.sigmoid(x), (torch.randn(4, 16),), backend="sim")  # (no gate)
    assert [e.op.kind for e in alone.kernel.queue.entries] == ["elementwise"]
    x = torch.randn(4, 16)
    close(alone(x), F.silu(x), tol=1e-5)
    other = me.from_torch(lambda x: torch.sigmoid(x) + x, (torch.randn(4, 16),), backend="sim")  # (no pattern)
    close(other(x), torch.sigmoid(x) + x, tol=1e-5)


def test_the_output_structure_is_the_modules():
    run = me.from_torch(lambda x, y: {"sum": x + y, "both": (x * y, x)}, (torch.randn(2, 4), torch.randn(2, 4)),
                        backend="sim")
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    out = run(x, y)
    assert set(out) == {"sum", "both"} and isinstance(out["both"], tuple)
    close(out["sum"], x + y, tol=1e-6)
    close(out["both"][0], x * y, tol=1e-6)
    close(out["both"][1], x, tol=1e-6)


# One small function for each ATen op of the table (some export to several), against eager on random data
OP_CASES = {
    "t_mm": (lambda x, w: torch.mm(x, w.t()), [(5, 16), (8, 16)]),
    "view_unsqueeze_squeeze": (lambda x: x.view(2, 3, 8).unsqueeze(1).squeeze(1).reshape(6, 8), [(6, 8)]),
    "flatten": (lambda x: torch.flatten(x, 0, 1), [(2, 3, 8)]),
    "type_as": (lambda x, y: x.type_as(y) + y, [(4, 8), (4, 8, "bf16")]),
    "softmax_dtype": (lambda x: torch.softmax(x, -1, dtype=torch.float32), [(4, 8, "bf16")]),
    "clone_detach_dropout": (lambda x: F.dropout(x.clone().detach(), 0.5, training=False) * x, [(4, 8)]),
    "slice_tail": (lambda x: x[:, 8:], [(4, 24)]),
    "embedding_2d_ids": (lambda e, i: F.embedding(i, e), [(50, 8), (3, 4, "ids")]),
    "sub_div_neg": (lambda x, y, z: -(x - y) / z, [(4, 8), (4, 8), (8,)]),
    "gelu_both": (lambda x: F.gelu(x) + F.gelu(x, approximate="tanh"), [(4, 40)]),
    "tanh_exp_cos_sin_sigmoid": (lambda x: torch.tanh(x) * torch.exp(x) + torch.cos(x) - torch.sin(x) * torch.sigmoid(x),
                                 [(3, 24)]),
    "gelu_bf16": (lambda x: F.gelu(x, approximate="tanh"), [(4, 40, "bf16")]),
    "exact_scalars": (lambda x: (x * 2.0 - 0.5) / 8 * 1.0, [(4, 40, "bf16")]),
    "f32_scalars": (lambda x: 0.1 * x / 3.0 - 0.7, [(4, 40)]),
    "rsub": (lambda x: 1.0 - x, [(4, 40, "bf16")]),
    # Hugging Face's apply_rotary_pos_emb with cos / sin given: slices, a negation, a concatenation, two
    # broadcasting products and a sum (elementwise ops: cos / sin are no angles of positions, so no rope op)
    "rope_written_out": (lambda q, cos, sin: q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin,
                         [(5, 2, 8), (5, 1, 8), (5, 1, 8)]),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_op_against_eager(case):
    fn, specs = OP_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    args = []
    for spec in specs:
        shape, kind = (spec[:-1], spec[-1]) if isinstance(spec[-1], str) else (spec, "f32")
        if kind == "ids":
            args.append(torch.randint(0, 50, shape, generator=gen))
        else:
            args.append(torch.randn(*shape, generator=gen).to(torch.bfloat16 if kind == "bf16" else torch.float32))
    run = me.from_torch(fn, tuple(args), backend="sim")
    close(run(*args), fn(*args), tol=2e-2 if any(a.dtype == torch.bfloat16 for a in args) else 1e-5)


class HFRotary(nn.Module):
    """q, k [1, heads, tokens, D] rotated at position_ids [1, tokens] as transformers 5 writes it
    (LlamaRotaryEmbedding.forward, then apply_rotary_pos_emb: every op in q's dtype)."""

    def __init__(self, d=16, matmul=False):
        super().__init__()
        self.matmul = matmul  # transformers 4's angles: a matrix product, transposed
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d)), persistent=False)

    def forward(self, q, k, position_ids):
        if self.matmul:
            inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            freqs = (inv.float() @ position_ids[:, None, :].float()).transpose(1, 2)
        else:
            freqs = position_ids[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        half = q.shape[-1] // 2
        rotate_half = lambda x: torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # noqa: E731
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype, matmul", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_rope_as_hugging_face_writes_it_is_one_rope_op_rounded_as_it_is(dtype, matmul):
    """A decode step's RoPE written as transformers writes it (angles from the position, as a product or as
    transformers 4's matrix product; cos / sin cast to the dtype, slices, a negation, a concatenation,
    broadcasting products and a sum) is recovered by a rule as one rope op each for q and k that rounds as
    those ops do: the same bits as eager. With several tokens (a prompt: the position varies along the
    heads' inner dim) it stays elementwise, and correct."""
    m = HFRotary(matmul=matmul)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, h, 1, 16, generator=gen).to(dtype) * 3 for h in (4, 2))
    run = me.from_torch(m, (q, k, torch.tensor([[5]])), backend="sim")
    ops = [e.op for e in run.kernel.queue.entries]
    assert [op.kind for op in ops] == ["rope", "rope"] and all(op.params.get("hf", False) == (dtype != torch.float32)
                                                               for op in ops), [(op.kind, op.params) for op in ops]
    for pos in (0, 7, 1234, 60000):
        ids = torch.tensor([[pos]])
        for got, want in zip(run(q, k, ids), m(q, k, ids)):
            assert torch.equal(got, want), pos
    q3, k3 = q.expand(1, 4, 3, 16).contiguous(), k.expand(1, 2, 3, 16).contiguous()
    run3 = me.from_torch(m, (q3, k3, torch.tensor([[3, 9, 400]])), backend="sim")
    assert "rope" not in [e.op.kind for e in run3.kernel.queue.entries]
    for got, want in zip(run3(q3, k3, torch.tensor([[3, 9, 400]])), m(q3, k3, torch.tensor([[3, 9, 400]]))):
        assert torch.equal(got, want)


def test_negative_and_out_of_range_slice_bounds_count_as_torch_does():
    """x[-2:], x[:-1], x[-10:] (clamped) and x[1:99] on a known size, equal to eager."""
    fn = lambda x: torch.cat([x[-2:], x[:-1], x[-10:], x[1:99]], 0) * 2.0  # noqa: E731
    x = torch.randn(5, 8)
    run = me.from_torch(fn, (x,), backend="sim")
    close(run(x), fn(x), tol=1e-6)


def test_an_op_of_constants_only_is_computed_once_as_a_weight():
    """Gemma's norm weight is 1 + w in f32: folded into a new weight when the program is translated, so no
    kernel op computes it (and the RMSNorm rule sees a weight)."""

    class OnePlus(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return x * (1.0 + self.w.float())

    m = OnePlus().eval()
    x = torch.randn(4, 16)
    run = me.from_torch(m, (x,), backend="sim")
    close(run(x), m(x), tol=1e-6)
    assert [n.op for n in run.graph.nodes if n.op not in ("weight", "input")] == ["mul"]


def test_interleaved_rope_pieces_run_as_views_and_concatenations():
    """x[..., ::2] / x[..., 1::2] (a reshape and a column), torch.stack, repeat_interleave: GLM's and
    Cohere's rotate_half and cos / sin, equal to eager."""
    def f(x, c):
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * torch.repeat_interleave(c, 2, dim=-1) + rotated
    x, c = torch.randn(3, 4, 8), torch.randn(3, 4, 4)
    run = me.from_torch(f, (x, c), backend="sim")
    close(run(x, c), f(x, c), tol=1e-6)
    with pytest.raises(UnsupportedTorch, match="slice with step 3"):
        me.from_torch(lambda x: x[..., ::3] * 2.0, (torch.randn(4, 8),), backend="sim")

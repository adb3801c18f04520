"""Rewrite rules, as named rulesets next to the ``Op`` sort. ``schedule.py`` runs them.

``lowering``: every graph op gets its block-term alternatives (tile sizes); ``wave_tiles(sms)``
adds the heights that fill ``sms`` SMs in a wave or two where those cannot (an LM head).
``fusion``: fused alternatives side by side with the unfused ones; the extractor
chooses by cost. This is the one file that says which graph patterns become which
block terms; each term itself (fields, operands, lowering) lives in ``megaegg/blockops``.
"""

from __future__ import annotations

from functools import cache

from egglog import String, eq, f64, i64, ne, rule, ruleset, union

from ..blockops.gemm import GEMM_SPLITS, GEMM_TILES  # (x rows, weight rows) of a tensor-core tile, its K splits
from .terms import NONE, Op, acc, node

# Rows of the weight per matvec instance. 16 rows x K=2048 x bf16 = 64 KB per instance;
# docs/design.md: pops cost a few % below ~128 KB, so the larger tiles win on big layers.
# 24, 48, 96 and 112 fill 128 SMs with common widths (3072, 6144, 12288 rows: qwen3's MLPs; 14336: llama-3.1-8b's).
MATVEC_ROWS = (8, 16, 24, 32, 48, 64, 96, 112, 128)
# A matvec of one x row too tall for the tallest of those to fill the SMs in one wave (an LM head: 128256 rows are
# 1002 instances, 7.6 waves, whose claims and ragged last wave cost ~30 us over its bytes) also gets the tiles that
# run it in this many waves (wave_tiles)
WAVES = (1, 2)
ELEMENTWISE_TILES = (1024, 8192)
ROW_TILES = (1, 4, 16, 64)  # (16, 64: the rows of a prompt, whose instances would otherwise be mostly overhead)
ATTENTION_CHUNKS = (64, 256)  # KV rows per split-KV instance
ARGMAX_CHUNKS = (1024, 4096)
MOE_ROWS = (8, 16, 32, 48, 64, 128)  # rows of one expert's MLP per moe_glu_down instance (48: 8 experts of 768 on 128)
ALL_REDUCE_TILES = (1024, 4096)  # elements per all-reduce instance
# (weight rows, K splits) of a batch's matvec split over K (blockops/matvec_split.py: fits a runtime row count)
SPLIT_TILES = tuple((r, s) for r in (32, 48, 64) for s in (2, 4))

# Graph ops with no rules of their own (``Op.other``): their terms and the tile field they share.
OTHER_TERMS: dict[str, tuple[tuple[str, ...], str | None, tuple[int, ...]]] = {
    "softmax": (("softmax_rows",), "rows_per", ROW_TILES),
    "attention": (("attention_split", "attention_fold"), "chunk", ATTENTION_CHUNKS),
    "sample": (("sample_rows",), None, ()),
    "argmax": (("argmax_chunks",), "chunk", ARGMAX_CHUNKS),
    "embedding": (("embedding_rows",), None, ()),
    "concat": (("concat_tiles",), "tile", ELEMENTWISE_TILES),
    "matmul": (("matmul_rows",), "rows", MATVEC_ROWS),
    **{op: (("elementwise_tiles",), "tile", ELEMENTWISE_TILES) for op in ("gelu", "tanh", "exp", "cos", "sin")},
    "all_gather": (("all_gather_tiles",), "tile", ALL_REDUCE_TILES),
}


def matvec(x, w, *, w2=NONE, g=NONE, eps=0.0, r=NONE, xa=NONE, ra=NONE, rows) -> Op:
    """``Op.matvec`` with its optional fusions absent unless given."""
    return Op.matvec(x=x, w=w, w2=w2, g=g, eps=eps, r=r, xa=xa, ra=ra, rows=rows)


def rms_norm_rows(i, x, g, eps) -> tuple:
    """Node i's rms_norm as its row tiles (one alternative a tile height)."""
    return tuple(union(node(i)).with_(Op.rms_norm_rows(x=x, g=g, eps=eps, rows_per=t)) for t in ROW_TILES)


def rope_ids_rows(i, x, g, eps, inv, pos, hf) -> tuple:
    """Node i's RoPE at positions from a tensor as its row tiles (rope_ids, one alternative a tile height)."""
    return tuple(union(node(i)).with_(Op.rope_ids(x=x, g=g, eps=eps, inv=inv, pos=pos, hf=hf, rope=i, append=NONE, rows_per=t))
                 for t in ROW_TILES)


def gemm(x, w, *, w2=NONE, r=NONE, bm, bn, splits=1) -> Op:
    """``Op.gemm`` with its optional fusions absent unless given."""
    return Op.gemm(x=x, w=w, w2=w2, r=r, bm=bm, bn=bn, splits=splits)


# A routed MLP's (rounded value, f32 sum) terms: one row (moe_glu_down) or many (moe_route + moe_experts)
MOE_TERMS = ((Op.moe_rounded, Op.moe_sum), (Op.moe_rows_rounded, Op.moe_rows_sum))

lowering = ruleset(name="lowering")
fusion = ruleset(name="fusion")


@lowering.register
def _lower(x: i64, w: i64, g: i64, a: i64, b: i64, s: i64, eps: f64, dt: String, st: String, i: i64):
    yield rule(eq(node(i)).to(Op.linear(x=x, w=w))).then(*(union(node(i)).with_(matvec(x, w, rows=r)) for r in MATVEC_ROWS))
    yield rule(eq(node(i)).to(Op.linear(x=x, w=w))).then(*(union(node(i)).with_(gemm(x, w, bm=m, bn=n, splits=k))
                                                               for m, n in GEMM_TILES for k in GEMM_SPLITS[m]))
    yield rule(eq(node(i)).to(Op.rms_norm(x=x, g=g, eps=eps))).then(*rms_norm_rows(i, x, g, eps))
    for build in (lambda: Op.add(a=a, b=b, same_shape=s), lambda: Op.mul(a=a, b=b, same_shape=s), lambda: Op.silu(a=a),
                  lambda: Op.cast(a=a, dtype=dt, src=st), lambda: Op.sub(a=a, b=b), lambda: Op.div(a=a, b=b),
                  lambda: Op.neg(a=a), lambda: Op.sigmoid(a=a, dtype=dt)):
        yield rule(eq(node(i)).to(build())).then(
            *(union(node(i)).with_(Op.elementwise_tiles(node=i, tile=t)) for t in ELEMENTWISE_TILES)
        )
    yield rule(eq(node(i)).to(Op.rope(x=x, node=i))).then(
        *(union(node(i)).with_(Op.rope_rows(x=x, g=NONE, eps=0.0, rope=i, append=NONE, rows_per=t)) for t in ROW_TILES)
    )
    yield rule(eq(node(i)).to(Op.rope_at_ids(x=x, inv=w, pos=a, hf=s, node=i))).then(*rope_ids_rows(i, x, NONE, 0.0, w, a, s))
    yield rule(eq(node(i)).to(Op.kv_append(cache=x, new=a))).then(union(node(i)).with_(Op.kv_append_row(node=i)))
    yield rule(eq(node(i)).to(Op.kv_store(new=a, node=i))).then(union(node(i)).with_(Op.kv_store_heads(node=i)))
    yield rule(eq(node(i)).to(Op.ragged_attention(q=x, node=i))).then(*(  # (flash: chunk 64 only)
        union(node(i)).with_(make(node=i, chunk=c)) for make in (Op.ragged_split, Op.ragged_flash) for c in ATTENTION_CHUNKS
    ))
    yield rule(eq(node(i)).to(Op.moe_mlp(x=x, logits=a, w=w, w2=b, wd=s, node=i))).then(*(  # (fits: one row or many)
        union(node(i)).with_(make(x=x, g=NONE, eps=0.0, logits=a, w=w, w2=b, wd=s, node=i, rows=r))
        for make, _ in MOE_TERMS for r in MOE_ROWS
    ))
    yield rule(eq(node(i)).to(Op.argmax(x=x, node=i))).then(
        *(union(node(i)).with_(Op.argmax_chunks(node=i, chunk=t)) for t in ARGMAX_CHUNKS)
    )
    yield rule(eq(node(i)).to(Op.all_reduce(x=x, node=i))).then(
        *(union(node(i)).with_(Op.all_reduce_tiles(x=x, xs=NONE, r=NONE, node=i, tile=t)) for t in ALL_REDUCE_TILES)
    )
    for op, (names, tile, tiles) in OTHER_TERMS.items():
        alts = []
        for name in names:
            make = getattr(Op, name)
            alts += [make(node=i, **{tile: t}) for t in tiles] if tile else [make(node=i)]
        yield rule(eq(node(i)).to(Op.other(op=op, node=i))).then(*(union(node(i)).with_(t) for t in alts))


@cache
def wave_tiles(sms: int):
    """The ruleset that gives a linear of one x row taller than ``max(MATVEC_ROWS) * sms`` rows (an LM head) the
    matvec tiles that run it in WAVES waves on ``sms`` SMs (the cost model's), each ``ceil(n / (waves * sms))``
    rows rounded up to a multiple of 8 (whole row groups: matvec.cuh deals rows to 8 warps). One x row only: a
    batch's tensor-core bodies are instantiated per tile height (matvec.cuh: matvec_fixed_rows)."""
    rules = ruleset(name=f"wave_tiles_{sms}")

    @rules.register
    def _wave_tiles(x: i64, w: i64, n: i64, i: i64):
        yield rule(eq(node(i)).to(Op.row_linear(x=x, w=w, n=n)), n > max(MATVEC_ROWS) * sms).then(
            *(union(node(i)).with_(matvec(x, w, rows=(n + 8 * k * sms - 1) / (8 * k * sms) * 8)) for k in WAVES))

    return rules


@fusion.register
def _fuse(
    x: i64, h: i64, w: i64, w2: i64, g: i64, r: i64, a: i64, b: i64, u: i64, eps: f64, rows: i64, i: i64
):
    # RMSNorm prologue: matvec(norm(x)) -> matvec reading x, normalising per instance.
    # Recomputing the norm in every instance costs K elements each; it saves an op.
    yield rule(
        eq(node(i)).to(matvec(h, w, w2=w2, r=r, rows=rows)),
        eq(node(h)).to(Op.rms_norm(x=x, g=g, eps=eps)),
    ).then(union(node(i)).with_(matvec(x, w, w2=w2, g=g, eps=eps, r=r, rows=rows)))
    # Residual epilogue: r + matvec(...) (either operand order), when shapes agree.
    for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(matvec(x, w, w2=w2, g=g, eps=eps, rows=rows)),
        ).then(union(node(i)).with_(matvec(x, w, w2=w2, g=g, eps=eps, r=r, rows=rows)))
    # Gated MLP: silu(x w^T) * (x w2^T) -> one matvec over both weights.
    for lhs in (Op.mul(a=a, b=u, same_shape=1), Op.mul(a=u, b=a, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(a)).to(Op.silu(a=b)),
            eq(node(b)).to(matvec(x, w, g=g, eps=eps, rows=rows)),
            eq(node(u)).to(matvec(x, w2, g=g, eps=eps, rows=rows)),
        ).then(union(node(i)).with_(matvec(x, w, w2=w2, g=g, eps=eps, rows=rows)))


@fusion.register
def _fuse_split(x: i64, w: i64, r: i64, b: i64, i: i64):
    # r + x w^T (either operand order) split over K, the last split adding the residual: the projections
    # that end in the residual stream (O, down). Not Q / K / V: split (with their norm, or K and V after a
    # separate one) they gained nothing at batch 64 and cost 2-7% at batch 1-16 (docs/perf-notes.md #87).
    for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(Op.linear(x=x, w=w)),
        ).then(*(union(node(i)).with_(Op.matvec_split(x=x, w=w, r=r, rows=rows, splits=k)) for rows, k in SPLIT_TILES))


@fusion.register
def _fuse_gemm(x: i64, w: i64, w2: i64, r: i64, a: i64, b: i64, u: i64, bm: i64, bn: i64, bn2: i64, k: i64, i: i64):
    # Residual epilogue: r + gemm(...) (either operand order), of a plain tile (gemm.cuh has no epilogue
    # that both gates and adds).
    for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(gemm(x, w, bm=bm, bn=bn, splits=k)),
        ).then(union(node(i)).with_(gemm(x, w, r=r, bm=bm, bn=bn, splits=k)))
    # Gated MLP: silu(x w^T) * (x w2^T) -> one tile over bn / 2 rows of each weight (the widest tile of
    # its height: 128 + 128 rows, or 64 + 64 for 64 x rows).
    for m in sorted({m for m, _ in GEMM_TILES}):
        widest = max(n for mm, n in GEMM_TILES if mm == m)
        for lhs in (Op.mul(a=a, b=u, same_shape=1), Op.mul(a=u, b=a, same_shape=1)):
            yield rule(
                eq(node(i)).to(lhs),
                eq(node(a)).to(Op.silu(a=b)),
                eq(node(b)).to(gemm(x, w, bm=m, bn=bn, splits=k)),
                eq(node(u)).to(gemm(x, w2, bm=m, bn=bn2, splits=k)),
            ).then(union(node(i)).with_(gemm(x, w, w2=w2, bm=m, bn=widest, splits=k)))


@fusion.register
def _fuse_mlp(x: i64, w: i64, w2: i64, g: i64, eps: f64, r: i64, a: i64, b: i64, wd: i64, rows: i64, rd: i64, i: i64):
    # r + (gated MLP) @ wd^T: the down projection split over the gated op's rows, so one op
    # streams gate, up and down weights with no hand-off between them (blockops/glu_down.py).
    # Its f32 sum is the value acc(b); the residual add rounds it (acc_residual) ...
    for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(matvec(a, wd, rows=rd)),
            eq(node(a)).to(matvec(x, w, w2=w2, g=g, eps=eps, rows=rows)),
            ne(w2).to(i64(NONE)),
        ).then(
            union(acc(b)).with_(Op.glu_down(x=x, w=w, w2=w2, g=g, eps=eps, wd=wd, rows=rows)),
            union(node(i)).with_(Op.acc_residual(r=r, acc=b)),
        )


@fusion.register
def _fuse_all_reduce(x: i64, w: i64, w2: i64, g: i64, eps: f64, r: i64, a: i64, b: i64, d: i64, wd: i64, rows: i64,
                     rd: i64, t: i64, i: i64):
    # Tensor parallel: all_reduce((gated MLP) @ wd^T) sends the glu_down's f32 sum, rounded as sent
    # (no op rounds it first) ...
    yield rule(
        eq(node(b)).to(Op.all_reduce(x=d, node=b)),
        eq(node(d)).to(matvec(a, wd, rows=rd)),
        eq(node(a)).to(matvec(x, w, w2=w2, g=g, eps=eps, rows=rows)),
        ne(w2).to(i64(NONE)),
    ).then(
        union(acc(d)).with_(Op.glu_down(x=x, w=w, w2=w2, g=g, eps=eps, wd=wd, rows=rows)),
        *(union(node(b)).with_(Op.all_reduce_tiles(x=NONE, xs=d, r=NONE, node=b, tile=t)) for t in ALL_REDUCE_TILES),
    )
    # ... and r + all_reduce(...) adds the residual as it sums (one op, one hop fewer).
    for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(Op.all_reduce_tiles(x=x, xs=d, r=i64(NONE), node=b, tile=t)),
        ).then(union(node(i)).with_(Op.all_reduce_tiles(x=x, xs=d, r=r, node=b, tile=t)))


@fusion.register
def _fuse_moe(x: i64, h: i64, g: i64, eps: f64, r: i64, b: i64, lg: i64, w: i64, w2: i64, wd: i64, rows: i64, i: i64):
    for rounded, summed in MOE_TERMS:
        # RMSNorm prologue, as the dense MLP's: each instance normalises x itself.
        yield rule(
            eq(node(i)).to(rounded(x=h, g=NONE, eps=0.0, logits=lg, w=w, w2=w2, wd=wd, node=i, rows=rows)),
            eq(node(h)).to(Op.rms_norm(x=x, g=g, eps=eps)),
        ).then(union(node(i)).with_(rounded(x=x, g=g, eps=eps, logits=lg, w=w, w2=w2, wd=wd, node=i, rows=rows)))
        # r + moe: its f32 sum is acc(b), rounded by the residual add (or folded into its readers, below).
        for lhs in (Op.add(a=r, b=b, same_shape=1), Op.add(a=b, b=r, same_shape=1)):
            yield rule(
                eq(node(i)).to(lhs),
                eq(node(b)).to(rounded(x=x, g=g, eps=eps, logits=lg, w=w, w2=w2, wd=wd, node=b, rows=rows)),
            ).then(
                union(acc(b)).with_(summed(x=x, g=g, eps=eps, logits=lg, w=w, w2=w2, wd=wd, node=b, rows=rows)),
                union(node(i)).with_(Op.acc_residual(r=r, acc=b)),
            )


@fusion.register
def _fold_sum(x: i64, w: i64, w2: i64, g: i64, eps: f64, r: i64, rows: i64, s: i64, b: i64, i: i64, j: i64):
    # ... or a matvec that reads r + T(acc) as its x or its residual adds it while staging, so no
    # acc_residual op or hand-off is needed if every reader does (docs/perf-notes.md #34).
    yield rule(
        eq(node(j)).to(matvec(i, w, w2=w2, g=g, eps=eps, r=r, rows=rows)),
        eq(node(i)).to(Op.acc_residual(r=s, acc=b)),
        ne(r).to(i),
    ).then(union(node(j)).with_(matvec(s, w, w2=w2, g=g, eps=eps, r=r, xa=b, rows=rows)))
    yield rule(
        eq(node(j)).to(matvec(x, w, w2=w2, g=g, eps=eps, r=i, rows=rows)),
        eq(node(i)).to(Op.acc_residual(r=s, acc=b)),
        ne(x).to(i),
    ).then(union(node(j)).with_(matvec(x, w, w2=w2, g=g, eps=eps, r=s, ra=b, rows=rows)))


@fusion.register
def _fuse_heads(x: i64, w: i64, g: i64, eps: f64, rows: i64, d: i64, b: i64, h: i64, r: i64, c: i64, i: i64):
    # QKV projection + RoPE: the rotation happens on the instance's tile (whole heads).
    yield rule(
        eq(node(i)).to(Op.rope(x=h, node=i)),
        eq(node(h)).to(Op.heads(src=b, head_dim=d)),
        eq(node(b)).to(matvec(x, w, g=g, eps=eps, rows=rows)),
        eq(rows % d).to(i64(0)),
    ).then(union(node(i)).with_(Op.matvec_heads(x=x, w=w, g=g, eps=eps, rows=rows, rope=i, append=NONE)))
    # ... + KV append: the rotated heads go straight into the cache row at pos.
    yield rule(
        eq(node(i)).to(Op.kv_append(cache=c, new=h)),
        eq(node(h)).to(Op.matvec_heads(x=x, w=w, g=g, eps=eps, rows=rows, rope=r, append=NONE)),
    ).then(union(node(i)).with_(Op.matvec_heads(x=x, w=w, g=g, eps=eps, rows=rows, rope=r, append=i)))
    # V projection + KV append (no rotation).
    yield rule(
        eq(node(i)).to(Op.kv_append(cache=c, new=h)),
        eq(node(h)).to(Op.heads(src=b, head_dim=d)),
        eq(node(b)).to(matvec(x, w, g=g, eps=eps, rows=rows)),
        eq(rows % d).to(i64(0)),
    ).then(union(node(i)).with_(Op.matvec_heads(x=x, w=w, g=g, eps=eps, rows=rows, rope=NONE, append=i)))


@fusion.register
def _fuse_rope(x: i64, g: i64, eps: f64, h: i64, r: i64, c: i64, t: i64, v: i64, inv: i64, p: i64, hf: i64, i: i64):
    # qwen3's per-head RMSNorm before RoPE: the rope instance normalises its own rows.
    yield rule(
        eq(node(i)).to(Op.rope(x=h, node=i)),
        eq(node(h)).to(Op.rms_norm(x=x, g=g, eps=eps)),
    ).then(*(union(node(i)).with_(Op.rope_rows(x=x, g=g, eps=eps, rope=i, append=NONE, rows_per=tt)) for tt in ROW_TILES))
    # ... and at positions from a tensor (a batch, a prompt, a traced step)
    yield rule(
        eq(node(i)).to(Op.rope_at_ids(x=h, inv=inv, pos=p, hf=hf, node=i)),
        eq(node(h)).to(Op.rms_norm(x=x, g=g, eps=eps)),
    ).then(*rope_ids_rows(i, x, g, eps, inv, p, hf))
    # Views that keep their input's rows in order (a traced model's unsqueezes, transposes of size-1 dims and
    # reshapes to [heads, D]) between the ops: a RoPE rotates, and a KV append writes, those rows alike
    yield rule(
        eq(node(i)).to(Op.rope_at_ids(x=v, inv=inv, pos=p, hf=hf, node=i)),
        eq(node(v)).to(Op.rows_of(src=h)),
    ).then(union(node(i)).with_(Op.rope_at_ids(x=h, inv=inv, pos=p, hf=hf, node=i)))
    yield rule(
        eq(node(i)).to(Op.kv_append(cache=c, new=v)),
        eq(node(v)).to(Op.rows_of(src=h)),
    ).then(union(node(i)).with_(Op.kv_append(cache=c, new=h)))
    # RoPE + KV append: the rotated rows go straight into the cache row (one hand-off fewer
    # between the K projection and attention, perf-notes #35).
    yield rule(
        eq(node(i)).to(Op.kv_append(cache=c, new=h)),
        eq(node(h)).to(Op.rope_rows(x=x, g=g, eps=eps, rope=r, append=NONE, rows_per=t)),
    ).then(union(node(i)).with_(Op.rope_rows(x=x, g=g, eps=eps, rope=r, append=i, rows_per=t)))
    yield rule(  # (at a position from a tensor: a traced decode step's)
        eq(node(i)).to(Op.kv_append(cache=c, new=h)),
        eq(node(h)).to(Op.rope_ids(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, rope=r, append=NONE, rows_per=t)),
    ).then(union(node(i)).with_(Op.rope_ids(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, rope=r, append=i, rows_per=t)))
    # ... and into a batch's cache rows at (slot, position) pairs: the store rotates (and normalises) its rows
    yield rule(
        eq(node(i)).to(Op.kv_store(new=h, node=i)),
        eq(node(h)).to(Op.rope_ids(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, rope=r, append=NONE, rows_per=t)),
    ).then(union(node(i)).with_(Op.kv_store_rope(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, store=i)))
    # ... and q's rows rotated (and normalised) by the prompt's flash attention as it loads them
    yield rule(
        eq(node(i)).to(Op.ragged_attention(q=h, node=i)),
        eq(node(h)).to(Op.rope_ids(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, rope=r, append=NONE, rows_per=t)),
    ).then(union(node(i)).with_(Op.ragged_flash_rope(x=x, g=g, eps=eps, inv=inv, pos=p, hf=hf, node=i)))
    # (a chain of such views is one)
    yield rule(
        eq(node(i)).to(Op.rows_of(src=v)),
        eq(node(v)).to(Op.rows_of(src=h)),
    ).then(union(node(i)).with_(Op.rows_of(src=h)))


@fusion.register
def _recover_rope(x: i64, m1: i64, m2: i64, cv: i64, sv: i64, c: i64, s: i64, cc: i64, ss: i64, r: i64, n: i64,
                  hi: i64, lo: i64, a: i64, f: i64, pf: i64, p: i64, inv: i64, t: String, i: i64):
    # RoPE as Hugging Face writes it (LlamaRotaryEmbedding, apply_rotary_pos_emb), each op rounding to T:
    #   F = f32(P)[..., None] * inv_freq; A = cat(F, F); C, S = T(cos(A)), T(sin(A)), seen as [tokens, 1, .., 1, D]
    #   out = x * C + cat(-x[..., D/2:], x[..., :D/2]) * S
    # is rope_at_ids(x, inv_freq, P) with hf rounding (cos / sin, each product and the sum rounded to T: the
    # rope body rounds at the same points, rope.cuh's rope_rotate), x's rows of token k at position P[k]; then
    # the rules above fold qwen3's q / k norms and the K append into it, and cos, sin and the angles (computed
    # once a step, read by every layer) are dead when every RoPE folds. In f32 (no casts) the two roundings
    # are one.
    rotation = (
        eq(node(m1)).to(Op.scale_tokens(x=x, t=cv)),
        eq(node(m2)).to(Op.scale_tokens(x=r, t=sv)),
        eq(node(r)).to(Op.concat_last(a=n, b=lo)),
        eq(node(n)).to(Op.neg(a=hi)),
        eq(node(hi)).to(Op.half(src=x, upper=1)),
        eq(node(lo)).to(Op.half(src=x, upper=0)),
        eq(node(cv)).to(Op.rows_of(src=c)),
        eq(node(sv)).to(Op.rows_of(src=s)),
        eq(node(a)).to(Op.concat_last(a=f, b=f)),
        eq(node(f)).to(Op.outer(p=pf, f=inv)),
        eq(node(pf)).to(Op.cast(a=p, dtype="f32", src="i32")),
    )
    rounded = (eq(node(c)).to(Op.cast(a=cc, dtype=t, src="f32")), eq(node(cc)).to(Op.cos(a=a)),
               eq(node(s)).to(Op.cast(a=ss, dtype=t, src="f32")), eq(node(ss)).to(Op.sin(a=a)))
    for lhs in (Op.add(a=m1, b=m2, same_shape=1), Op.add(a=m2, b=m1, same_shape=1)):
        for hf, trig in ((1, rounded), (0, (eq(node(c)).to(Op.cos(a=a)), eq(node(s)).to(Op.sin(a=a))))):
            yield rule(eq(node(i)).to(lhs), *rotation, *trig).then(
                union(node(i)).with_(Op.rope_at_ids(x=x, inv=inv, pos=p, hf=hf, node=i)),
                *rope_ids_rows(i, x, NONE, 0.0, inv, p, hf),
            )


@fusion.register
def _fuse_argmax(x: i64, w: i64, g: i64, eps: f64, rows: i64, b: i64, i: i64):
    # Final norm + LM head + argmax partials: each instance reduces its own logits.
    yield rule(
        eq(node(i)).to(Op.argmax(x=b, node=i)),
        eq(node(b)).to(matvec(x, w, g=g, eps=eps, rows=rows)),
    ).then(union(node(i)).with_(Op.matvec_argmax(x=x, w=w, g=g, eps=eps, rows=rows)))


@fusion.register
def _recover_rms_norm(x: i64, g: i64, xf: i64, sq: i64, m: i64, v: i64, rs: i64, h: i64, hc: i64, eps: f64, t: String,
                      i: i64):
    # RMSNorm written out, as exported models write it (Hugging Face's LlamaRMSNorm):
    #   xf = f32(x); h = xf * rsqrt(mean(xf^2, -1, keepdim) + eps); out = g * T(h)
    # is rms_norm(x, g, eps), rounded alike (T(T(x * rinv) * g)): then every rms_norm rule applies (the
    # matvec prologue above). The primitives have no block op of their own.
    # (the lowering rules ran before these: the recovered norm gets its own block op here, for where no
    # consumer fuses it, e.g. qwen3's and OLMo2's q / k norms)
    recovered = (union(node(i)).with_(Op.rms_norm(x=x, g=g, eps=eps)), *rms_norm_rows(i, x, g, eps))
    norm = (eq(node(rs)).to(Op.rsqrt(a=v)), eq(node(v)).to(Op.add_scalar(a=m, c=eps)),
            eq(node(m)).to(Op.mean_last(a=sq)), eq(node(sq)).to(Op.pow(a=xf, p=2.0)))
    yield rule(
        eq(node(i)).to(Op.scale_last(x=hc, g=g, dtype=t)),
        eq(node(hc)).to(Op.cast(a=h, dtype=t, src="f32")),
        eq(node(h)).to(Op.scale_rows(x=xf, s=rs)),
        *norm,
        eq(node(xf)).to(Op.cast(a=x, dtype="f32", src=t)),
    ).then(*recovered)
    # ... and in f32 (no casts)
    yield rule(
        eq(node(i)).to(Op.scale_last(x=h, g=g, dtype="f32")),
        eq(node(h)).to(Op.scale_rows(x=x, s=rs)),
        *norm,
        eq(xf).to(x),
    ).then(*recovered)


@fusion.register
def _recover_silu(x: i64, s: i64, t: String, i: i64):
    # SiLU written out, x * sigmoid(x) (either order), is silu(x): then the gated-MLP rules apply, and
    # alone it runs as the elementwise silu of x (silu_tiles). The written-out form rounds sigmoid(x) to x's
    # dtype before the product, the silu op does not: in bf16 the two differ by at most an ulp of the
    # product.
    for lhs in (Op.mul(a=x, b=s, same_shape=1), Op.mul(a=s, b=x, same_shape=1)):
        yield rule(eq(node(i)).to(lhs), eq(node(s)).to(Op.sigmoid(a=x, dtype=t))).then(
            union(node(i)).with_(Op.silu(a=x)),
            *(union(node(i)).with_(Op.silu_tiles(x=x, node=i, tile=tt)) for tt in ELEMENTWISE_TILES),
        )

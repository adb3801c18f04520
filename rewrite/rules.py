"""Rewrite rules, as named rulesets next to the ``Op`` sort. ``schedule.py`` runs them.

``lowering``: every graph op gets its block-op alternatives (tile sizes).
``fusion``: fused alternatives side by side with the unfused ones; the extractor
chooses by cost.
"""

from __future__ import annotations

from egglog import eq, f64, i64, ne, rule, ruleset, union

from .terms import NONE, Op, node

# Rows of the weight per matvec instance. 16 rows x K=2048 x bf16 = 64 KB per instance;
# DESIGN.md: pops cost a few % below ~128 KB, so the larger tiles win on big layers.
# 24, 48 and 96 fill 128 SMs with common widths (3072, 6144, 12288 rows: qwen3's MLPs).
MATVEC_ROWS = (8, 16, 24, 32, 48, 64, 96, 128)
ELEMENTWISE_TILES = (1024, 8192)
ROW_TILES = (1, 4)
ATTENTION_CHUNKS = (64, 256)  # KV rows per split-KV instance
ARGMAX_CHUNKS = (1024, 4096)

# Which tile alternatives each op family gets when lowered as a single-node block op.
BLOCK_TILES: dict[str, tuple[int, ...]] = {
    "rms_norm": ROW_TILES,
    "elementwise": ELEMENTWISE_TILES,
    "rope": ROW_TILES,
    "softmax": ROW_TILES,
    "attention": ATTENTION_CHUNKS,
    "argmax": ARGMAX_CHUNKS,
    "embedding": (1,),
    "kv_append": (1,),
    "concat": ELEMENTWISE_TILES,
    "cast": ELEMENTWISE_TILES,
    "copy": ELEMENTWISE_TILES,
    "matmul": MATVEC_ROWS,
}

lowering = ruleset(name="lowering")
fusion = ruleset(name="fusion")


@lowering.register
def _lower(x: i64, w: i64, g: i64, a: i64, b: i64, s: i64, eps: f64, i: i64):
    # linear -> matvec with each tile height
    yield rule(eq(node(i)).to(Op.linear(x, w))).then(
        *(union(node(i)).with_(Op.matvec(x, w, NONE, NONE, 0.0, NONE, r)) for r in MATVEC_ROWS)
    )
    yield rule(eq(node(i)).to(Op.rms_norm(x, g, eps))).then(
        *(union(node(i)).with_(Op.block("rms_norm", i, t)) for t in ROW_TILES)
    )
    for build in (lambda: Op.add(a, b, s), lambda: Op.mul(a, b, s), lambda: Op.silu(a)):
        yield rule(eq(node(i)).to(build())).then(
            *(union(node(i)).with_(Op.block("elementwise", i, t)) for t in ELEMENTWISE_TILES)
        )
    yield rule(eq(node(i)).to(Op.rope(x, i))).then(
        *(union(node(i)).with_(Op.rope_rows(x, NONE, 0.0, i, NONE, t)) for t in ROW_TILES)
    )
    yield rule(eq(node(i)).to(Op.kv_append(x, a))).then(union(node(i)).with_(Op.block("kv_append", i, 1)))
    yield rule(eq(node(i)).to(Op.argmax(x, i))).then(
        *(union(node(i)).with_(Op.block("argmax", i, t)) for t in ARGMAX_CHUNKS)
    )
    for family, tiles in BLOCK_TILES.items():
        if family in ("rms_norm", "elementwise"):
            continue
        yield rule(eq(node(i)).to(Op.other(family, i))).then(
            *(union(node(i)).with_(Op.block(family, i, t)) for t in tiles)
        )


@fusion.register
def _fuse(
    x: i64, h: i64, w: i64, w2: i64, g: i64, r: i64, a: i64, b: i64, u: i64, eps: f64, rows: i64, i: i64
):
    # RMSNorm prologue: matvec(norm(x)) -> matvec reading x, normalising per instance.
    # Recomputing the norm in every instance costs K elements each; it saves an op.
    yield rule(
        eq(node(i)).to(Op.matvec(h, w, w2, NONE, 0.0, r, rows)),
        eq(node(h)).to(Op.rms_norm(x, g, eps)),
    ).then(union(node(i)).with_(Op.matvec(x, w, w2, g, eps, r, rows)))
    # Residual epilogue: r + matvec(...) (either operand order), when shapes agree.
    for lhs in (Op.add(r, b, 1), Op.add(b, r, 1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(Op.matvec(x, w, w2, g, eps, NONE, rows)),
        ).then(union(node(i)).with_(Op.matvec(x, w, w2, g, eps, r, rows)))
    # Gated MLP: silu(x w^T) * (x w2^T) -> one matvec over both weights.
    for lhs in (Op.mul(a, u, 1), Op.mul(u, a, 1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(a)).to(Op.silu(b)),
            eq(node(b)).to(Op.matvec(x, w, NONE, g, eps, NONE, rows)),
            eq(node(u)).to(Op.matvec(x, w2, NONE, g, eps, NONE, rows)),
        ).then(union(node(i)).with_(Op.matvec(x, w, w2, g, eps, NONE, rows)))


@fusion.register
def _fuse_mlp(x: i64, w: i64, w2: i64, g: i64, eps: f64, r: i64, a: i64, b: i64, wd: i64, rows: i64, rd: i64, i: i64):
    # r + (gated MLP) @ wd^T -> the down projection split over the gated op's rows, so one op
    # streams gate, up and down weights with no hand-off between them (blockops/glu_down.py).
    for lhs in (Op.add(r, b, 1), Op.add(b, r, 1)):
        yield rule(
            eq(node(i)).to(lhs),
            eq(node(b)).to(Op.matvec(a, wd, NONE, NONE, 0.0, NONE, rd)),
            eq(node(a)).to(Op.matvec(x, w, w2, g, eps, NONE, rows)),
            ne(w2).to(i64(NONE)),
        ).then(union(node(i)).with_(Op.glu_down(x, w, w2, g, eps, wd, r, rows)))


@fusion.register
def _fuse_heads(x: i64, w: i64, g: i64, eps: f64, rows: i64, d: i64, b: i64, h: i64, r: i64, c: i64, i: i64):
    # QKV projection + RoPE: the rotation happens on the instance's tile (whole heads).
    yield rule(
        eq(node(i)).to(Op.rope(h, i)),
        eq(node(h)).to(Op.heads(b, d)),
        eq(node(b)).to(Op.matvec(x, w, NONE, g, eps, NONE, rows)),
        eq(rows % d).to(i64(0)),
    ).then(union(node(i)).with_(Op.matvec_heads(x, w, g, eps, rows, i, NONE)))
    # ... + KV append: the rotated heads go straight into the cache row at pos.
    yield rule(
        eq(node(i)).to(Op.kv_append(c, h)),
        eq(node(h)).to(Op.matvec_heads(x, w, g, eps, rows, r, NONE)),
    ).then(union(node(i)).with_(Op.matvec_heads(x, w, g, eps, rows, r, i)))
    # V projection + KV append (no rotation).
    yield rule(
        eq(node(i)).to(Op.kv_append(c, h)),
        eq(node(h)).to(Op.heads(b, d)),
        eq(node(b)).to(Op.matvec(x, w, NONE, g, eps, NONE, rows)),
        eq(rows % d).to(i64(0)),
    ).then(union(node(i)).with_(Op.matvec_heads(x, w, g, eps, rows, NONE, i)))


@fusion.register
def _fuse_rope(x: i64, g: i64, eps: f64, h: i64, r: i64, c: i64, t: i64, i: i64):
    # qwen3's per-head RMSNorm before RoPE: the rope instance normalises its own rows.
    yield rule(
        eq(node(i)).to(Op.rope(h, i)),
        eq(node(h)).to(Op.rms_norm(x, g, eps)),
    ).then(*(union(node(i)).with_(Op.rope_rows(x, g, eps, i, NONE, tt)) for tt in ROW_TILES))
    # RoPE + KV append: the rotated rows go straight into the cache row (one hand-off fewer
    # between the K projection and attention, perf-notes #35).
    yield rule(
        eq(node(i)).to(Op.kv_append(c, h)),
        eq(node(h)).to(Op.rope_rows(x, g, eps, r, NONE, t)),
    ).then(union(node(i)).with_(Op.rope_rows(x, g, eps, r, i, t)))


@fusion.register
def _fuse_argmax(x: i64, w: i64, g: i64, eps: f64, rows: i64, b: i64, i: i64):
    # Final norm + LM head + argmax partials: each instance reduces its own logits.
    yield rule(
        eq(node(i)).to(Op.argmax(b, i)),
        eq(node(b)).to(Op.matvec(x, w, NONE, g, eps, NONE, rows)),
    ).then(union(node(i)).with_(Op.matvec_argmax(x, w, g, eps, rows)))

"""The e-graph encoding of a graph: one small ``Op`` term per node, in SSA form.

``node(i)`` is the e-class of graph node ``i``. Tensor operands are node ids
(``i64``), never nested terms: nested terms share subterms across layers and make
extraction cost overflow (DESIGN.md, egglog facts). A node whose operand is a view
refers to the view node's id; views have no term, so no fusion rule sees through
one (a fused body reads its operands unviewed).

Graph-op constructors (what the user wrote) and block-op constructors (how it runs)
live in one sort so that rules can union them into the same e-class. Absent
optional operands are ``-1``.
"""

from __future__ import annotations

from egglog import Expr, StringLike, f64Like, function, i64Like

NONE = -1


class Op(Expr):
    # --- graph ops with rewrite rules --------------------------------------------------
    @classmethod
    def linear(cls, x: i64Like, w: i64Like) -> Op: ...

    @classmethod
    def rms_norm(cls, x: i64Like, g: i64Like, eps: f64Like) -> Op: ...

    @classmethod
    def add(cls, a: i64Like, b: i64Like, same_shape: i64Like) -> Op: ...

    @classmethod
    def mul(cls, a: i64Like, b: i64Like, same_shape: i64Like) -> Op: ...

    @classmethod
    def silu(cls, a: i64Like) -> Op: ...

    @classmethod
    def heads(cls, src: i64Like, head_dim: i64Like) -> Op:
        """A reshape view ``[1, H*D] -> [H, D]`` (a term only so that fusion rules can see through it)."""

    @classmethod
    def rope(cls, x: i64Like, i: i64Like) -> Op:
        """RoPE of node ``i`` at a runtime-dim position."""

    @classmethod
    def kv_append(cls, cache: i64Like, new: i64Like) -> Op: ...

    @classmethod
    def argmax(cls, x: i64Like, i: i64Like) -> Op:
        """Argmax of node ``i`` over the last dim of a ``[1, N]`` tensor."""

    @classmethod
    def other(cls, op: StringLike, i: i64Like) -> Op:
        """Any other graph op (rope, attention, argmax, ...): lowered by one rule family."""

    # --- block ops ----------------------------------------------------------------------
    @classmethod
    def matvec(
        cls, x: i64Like, w: i64Like, w2: i64Like, g: i64Like, eps: f64Like, r: i64Like, rows: i64Like
    ) -> Op:
        """``matvec`` kind: x @ w^T [* silu gate w2] [with RMSNorm(g) prologue] [+ r]."""

    @classmethod
    def matvec_heads(
        cls, x: i64Like, w: i64Like, g: i64Like, eps: f64Like, rows: i64Like, rope: i64Like, append: i64Like
    ) -> Op:
        """``matvec_heads`` kind: a head-split projection; ``rope``/``append`` name the absorbed nodes."""

    @classmethod
    def rope_rows(cls, x: i64Like, g: i64Like, eps: f64Like, rope: i64Like, append: i64Like, tile: i64Like) -> Op:
        """``rope`` kind: RoPE of node ``rope`` read from ``x`` [after a per-row RMSNorm(g)], written
        to its own buffer or, when ``append`` names a ``kv_append`` node, straight into its cache row."""

    @classmethod
    def matvec_argmax(cls, x: i64Like, w: i64Like, g: i64Like, eps: f64Like, rows: i64Like) -> Op:
        """``matvec_argmax`` kind: argmax partials of x @ w^T, the products never stored."""

    @classmethod
    def glu_down(
        cls, x: i64Like, w: i64Like, w2: i64Like, g: i64Like, eps: f64Like, wd: i64Like, r: i64Like, rows: i64Like
    ) -> Op:
        """``glu_down`` + ``acc_residual`` kinds: r + (gated MLP of x) @ wd^T, split over the MLP's rows."""

    @classmethod
    def block(cls, kind: StringLike, i: i64Like, tile: i64Like) -> Op:
        """A single-node block op of ``kind`` for node ``i`` with tile parameter ``tile``."""


@function
def node(i: i64Like) -> Op: ...

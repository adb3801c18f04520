"""The rewrite stage: ``rewrite(graph, cost_model=, dims_hint=, stats=) -> BlockProgram``.

>>> import megaegg as me
>>> from megaegg.rewrite import rewrite
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32)
>>> _ = g.output("y", me.silu(me.linear(x, g.weight("w", [32, 64], me.f32))))
>>> sorted({op.kind for op in rewrite(g).ops})
['elementwise', 'matvec']

Its passes, in the order ``schedule.py`` (the stage's entry, a list of named passes) runs them:

- ``layers.py``: identical layers found, the graph reduced to a few of them (and the choices
  copied back onto every middle layer at the end);
- ``encode.py``: one SSA term per computing node into an egglog e-graph (``terms.py``: the
  ``Op`` sort, its block constructors generated from ``megaegg.blockops.TERMS``);
- ``rules.py``: the ``lowering`` ruleset (block-term alternatives, tile sizes), then ``fusion``
  (fused forms beside the unfused ones);
- ``extract.py``: one alternative per value, by cost (``cost.py``: :class:`CostModel`);
  ``siblings.py`` re-picks the tiles of ops that read the same input;
- ``build.py``: the chosen terms lowered into block ops over buffers and views (``ProgramBuilder``).

``rewrite`` and ``RewriteStats`` are imported on first use: ``terms.py`` builds the ``Op`` sort
from the terms registered when it is first imported, so a block op registered before the first
compile joins it (docs/pipeline.md, "Adding a block op"). ``CostModel`` is imported at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cost import CostModel

if TYPE_CHECKING:
    from .schedule import RewriteStats, rewrite

__all__ = ["CostModel", "RewriteStats", "rewrite"]


def __getattr__(name: str):
    if name in ("rewrite", "RewriteStats"):
        from . import schedule

        return getattr(schedule, name)  # (looked up at each use: a test may patch schedule.rewrite)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

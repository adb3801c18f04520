"""The lowering stage: ``build_queue(program, max_dims) -> WorkQueue``.

>>> import megaegg as me
>>> from megaegg.lowering import build_queue
>>> from megaegg.rewrite import rewrite
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32)
>>> _ = g.output("y", me.silu(me.linear(x, g.weight("w", [32, 64], me.f32))))
>>> queue = build_queue(rewrite(g), {})
>>> len(queue.entries) == len(queue.program.ops)
True

Its modules:

- ``barriers.py``: ``derive_barriers(program) -> BarrierPlan``: from the declared footprints
  alone, which counter each producer instance signals and which counters (and how many
  signals) each consumer instance waits for (docs/barriers.md);
- ``queue.py``: ``build_queue``: the work queue (one entry per block op, launch counts as
  expressions of the runtime dims) and the memory plan (one arena, the counter bank that holds
  the ``accum`` sums, a tensor-parallel peer region); ``upper_bound`` of a Dim at ``max_dims``.
"""

from .barriers import BarrierPlan, derive_barriers
from .queue import MemoryPlan, WorkQueue, build_queue, upper_bound

__all__ = ["BarrierPlan", "MemoryPlan", "WorkQueue", "build_queue", "derive_barriers", "upper_bound"]

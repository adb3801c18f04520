"""The interpreter stage: ``render(queue) -> Rendered`` (CUDA source and entry table), ``compile_cubin``
(NVRTC), ``CudaRunner`` (one persistent-kernel launch per call) and ``Simulation`` (the same queue on
the CPU).

>>> import megaegg as me
>>> from megaegg.interpreter import render
>>> from megaegg.lowering import build_queue
>>> from megaegg.rewrite import rewrite
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32)
>>> _ = g.output("y", me.silu(me.linear(x, g.weight("w", [32, 64], me.f32))))
>>> "megakernel" in render(build_queue(rewrite(g), {})).source
True

Its modules:

- ``render.py``: ``render``: ``cuda/megakernel.cu`` (the persistent interpreter loop) filled with
  one ``case`` per queue entry, each calling its kind's body (``cuda_call``, ``cuda/<kind>.cuh``);
  ``defines()``: the compile-time ``MEGA_*`` defines (``$MEGAEGG_DEFINES``);
- ``nvrtc.py``: ``compile_cubin``: NVRTC, with a cubin cache keyed by source, options and version;
- ``runtime.py``: ``CudaRunner``: the cubin loaded with the driver API, weights bound once, one
  launch per call on torch's current stream; ``check()`` raises ``MegakernelError``;
- ``simulator.py``: ``Simulation``: the queue on the CPU under an :class:`Interleaving` of the SMs
  (random or adversarial), poisoned scratch buffers, every read checked against the barriers
  (``SimulationError``); ``run_launches``: the ranks of a tensor-parallel group together;
- ``trace.py``: ``Trace``: a traced launch's per-SM timeline (``Kernel.trace``).

``megaegg.compiler.Kernel`` is how a program uses them (``kernel(...)``, ``kernel.launcher(...)``).
"""

from .nvrtc import compile_cubin
from .render import Rendered, defines, image_defines, render
from .runtime import CudaRunner, MegakernelError
from .simulator import Interleaving, Simulation, SimulationError, run_launches
from .trace import Trace

__all__ = ["CudaRunner", "Interleaving", "MegakernelError", "Rendered", "Simulation", "SimulationError", "Trace",
           "compile_cubin", "defines", "image_defines", "render", "run_launches"]

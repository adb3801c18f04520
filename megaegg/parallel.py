"""Tensor parallelism over the GPUs of one host: one graph, compiled once, one megakernel per GPU.

Every rank runs the same kernel (``rank`` is a launch argument, not compiled in) on its own shard
of the weights; ``all_reduce`` block ops move partial results between the GPUs inside the kernels,
peer-to-peer over NVLink (docs/parallel.md: the protocol and why it is sound).

>>> import torch, megaegg as me
>>> from megaegg.parallel import ParallelKernel
>>> g = me.Graph(); x = g.input("x", [1, 64], me.f32); w = g.weight("w", [32, 64], me.f32)
>>> _ = g.output("y", me.all_reduce(me.linear(x, w), ranks=2))
>>> shards = [{"w": torch.randn(32, 64)} for _ in range(2)]
>>> k = ParallelKernel(me.compiler.build_artifact(g, compile_cuda=False), shards, backend="sim")
>>> x0 = [torch.randn(1, 64) for _ in range(2)]
>>> ours = k([{"x": x0[0]}, {"x": x0[1]}])
>>> ref = me.run_reference_ranks(g, [{"x": x0[0]}, {"x": x0[1]}], shards)
>>> bool(torch.allclose(ours[1]["y"], ref[1]["y"], atol=1e-5)), bool(torch.equal(ours[0]["y"], ours[1]["y"]))
(True, True)
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping, Sequence

import torch

from .artifact import Artifact
from .compiler import AliasGuard, Kernel, Launcher, check_fits, kernel_memory, resolve_backend
from .graph import GraphError


class ParallelKernel:
    """A tensor-parallel graph bound to every rank's weight shard; ``kernel(inputs, **dims)`` runs all
    ranks once (``inputs[r]``: rank ``r``'s inputs, on its GPU) and returns each rank's outputs."""

    def __init__(self, artifact: Artifact, weights: Sequence[Mapping[str, torch.Tensor]], *,
                 backend: str | None = None, devices: Sequence[torch.device | str | int] | None = None) -> None:
        self.ranks = artifact.queue.program.ranks
        if isinstance(weights, Mapping) or len(weights) != self.ranks:
            raise GraphError(f"the graph spans {self.ranks} ranks (all_reduce, all_gather): give one weights dict per rank "
                             f"(got {'a dict' if isinstance(weights, Mapping) else len(weights)})")
        self.backend = resolve_backend(backend)
        self.interleaving = None  # how the simulator interleaves SMs and ranks (megaegg.interpreter.Interleaving)
        if self.backend == "cuda":
            devices = [torch.device("cuda", r) for r in range(self.ranks)] if devices is None else \
                [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
            if len(devices) != self.ranks or len({d.index for d in devices}) != self.ranks:
                raise GraphError(f"devices: {self.ranks} distinct GPUs wanted, got {list(map(str, devices))}")
            if torch.cuda.device_count() < self.ranks:
                raise GraphError(f"the graph spans {self.ranks} GPUs; this machine has {torch.cuda.device_count()}")
            enable_peer_access([d.index for d in devices])
        else:
            devices = [torch.device("cpu")] * self.ranks
            # every rank's weights, caches and work area share the host: all of them must fit it (each Kernel
            # checks its own rank alone)
            check_fits([(kind, f"rank {r}'s {what}", n) for r in range(self.ranks) for kind, what, n in kernel_memory(artifact)],
                       "cpu", hint=" (compile with smaller max_dims)" if artifact.queue.program.symbols else "")
        self.devices = devices
        self.kernels = []
        for w, d in zip(weights, devices):
            with _on(d):
                self.kernels.append(Kernel(artifact, w, backend=self.backend, device=d))
        # a tensor one rank updates in place must not be another rank's tensor (or weight) too
        k0 = self.kernels[0]
        self._alias = AliasGuard([(f"rank {r}'s {what}", t) for r, k in enumerate(self.kernels)
                                  for what, t in k._alias.bound_named]) if k0._state_ids else None
        self._alias_labels = [f"rank {r}'s {label}" for r in range(self.ranks) for label in k0._state_labels]
        if self.backend == "cuda":
            regions = [k._peer_region().data_ptr() for k in self.kernels]
            for r, k in enumerate(self.kernels):
                k._set_peers(r, regions)

    def __call__(self, inputs: Sequence[Mapping[str, torch.Tensor]], *, check: bool = True,
                 **dims: int) -> list[dict[str, torch.Tensor]]:
        launch = self.launcher(inputs, **dims)
        launch()
        outs = launch.outputs()
        if check:
            self.check()
        return outs

    def launcher(self, inputs: Sequence[Mapping[str, torch.Tensor]], **dims: int) -> "ParallelLauncher":
        """The call ``kernel(inputs, **dims)`` checked once: a :class:`ParallelLauncher` that launches
        every rank again and again without any check (``Kernel.launcher``'s contract, per rank)."""
        if isinstance(inputs, Mapping) or len(inputs) != self.ranks:
            raise GraphError(f"inputs: one dict per rank wanted ({self.ranks})")
        split = [k._split_args({**i, **dims}) for k, i in zip(self.kernels, inputs)]
        self._check_aliasing(split)
        return ParallelLauncher(self, split)

    def check(self) -> None:
        """Wait for every rank; raise the first rank's error, after resetting every rank's peer counters."""
        if self.backend != "cuda":
            return
        for d in self.devices:  # every rank stopped first: none may signal into a region reset below
            torch.cuda.synchronize(d)
        errors = []
        for r, k in enumerate(self.kernels):
            try:
                k.check()
            except Exception as e:  # noqa: BLE001 - reported below, once every rank stopped
                errors.append((r, e))
        if errors:
            for k in self.kernels:  # (the group restarts from launch 1 together)
                k._reset_peers()
            r, e = errors[0]
            raise type(e)(f"rank {r}: {e}") from e

    def simulate(self, interleaving, inputs: Sequence[Mapping[str, torch.Tensor]], **dims: int) -> list[dict]:
        """Run every rank on the CPU simulator together under ``interleaving`` (megaegg.interpreter:
        Interleaving, run_launches)."""
        return self.simulate_launches(interleaving, [(inputs, dims)])[0]

    def simulate_launches(self, interleaving, steps: Sequence[tuple[Sequence[Mapping[str, torch.Tensor]], Mapping[str, int]]],
                          *, halves: int = 2) -> list[list[dict]]:
        """Several launches in a row on the simulator, ``steps[t] = (inputs of every rank, dims)``, each
        rank starting its next launch as soon as its last one ended (others may still run theirs); the
        peer counters carry over and the peer buffers alternate between ``halves`` copies, as on the
        GPU (2; a test passes 1 to see an early overwrite caught). Every launch's outputs, per rank."""
        split = [[k._split_args({**i, **dims}) for k, i in zip(self.kernels, inputs)] for inputs, dims in steps]
        for s in split:
            self._check_aliasing(s)
        return self._run_sim(split, interleaving, halves)

    def _check_aliasing(self, split) -> None:
        """Across the ranks of one launch (each rank's own tensors were checked by its Kernel)."""
        if self._alias is None:
            return
        written, others = [], []
        for r, (k, (tensors, _)) in enumerate(zip(self.kernels, split)):
            written += [tensors[i] for i in k._state_ids]
            others += [(f"rank {r}'s {k._labels[i]}", t) for i, t in tensors.items() if i not in k._written]
        self._alias.check(self._alias_labels, written, others,
                          tuple(tuple(env.values()) for _, env in split) if self.kernels[0]._state_symbolic else ())

    def _run_sim(self, launches, interleaving, halves: int = 2) -> list[list[dict[str, torch.Tensor]]]:
        from .interpreter import Interleaving, Simulation, run_launches
        from .interpreter.simulator import RankState, poison

        peers = [b for b in self.kernels[0].program.buffers if b.kind == "peer"]
        copies = []  # per rank: each peer buffer's halves (static shapes), kept across launches like the GPU's region
        for _ in self.kernels:
            copies.append({b.id: [torch.empty(math.prod(d.value for d in b.shape), dtype=b.dtype.torch)
                                  for _ in range(halves)] for b in peers})
            for t in (t for halves_of in copies[-1].values() for t in halves_of):
                poison(t)
        states = [RankState() for _ in self.kernels]
        sims = []
        for seq, split in enumerate(launches, start=1):
            group = []
            for r, (k, (tensors, env)) in enumerate(zip(self.kernels, split)):
                flat = k._sim_buffers(tensors, env) | {b: c[(seq - 1) % halves] for b, c in copies[r].items()}
                group.append(Simulation(k.queue, flat, env, rank=r, seq=seq, state=states[r], halves=halves))
            sims.append(group)
        run_launches(sims, interleaving or self.interleaving or Interleaving())
        return [[{name: s.view(o, env).clone() for name, o in k.program.outputs.items()}
                 for s, k, (_, env) in zip(group, self.kernels, split)] for group, split in zip(sims, launches)]


class ParallelLauncher:
    """One call of a :class:`ParallelKernel`, checked once by ``kernel.launcher(inputs, **dims)``:
    ``launcher()`` launches every rank (each on its GPU's current stream; the sim backend runs them
    together), ``check()`` waits for all and raises the first rank's error (:meth:`ParallelKernel.check`),
    ``outputs()`` reads each rank's outputs of the last launch. As :class:`~megaegg.compiler.Launcher`,
    it launches on the tensors it was given: update them in place, never rebind them."""

    def __init__(self, kernel: ParallelKernel, split: list) -> None:
        self.kernel, self._split, self._last = kernel, split, None
        self._ranks = [Launcher(k, tensors, env) for k, (tensors, env) in zip(kernel.kernels, split)] \
            if kernel.backend == "cuda" else None

    def __call__(self) -> None:
        if self._ranks is None:
            self._last = self.kernel._run_sim([self._split], self.kernel.interleaving)[0]
            return
        for launch, d in zip(self._ranks, self.kernel.devices):  # every rank's kernel, then wait
            with _on(d):
                launch()

    def check(self) -> None:
        self.kernel.check()

    def outputs(self) -> list[dict[str, torch.Tensor]]:
        """Each rank's outputs by name, as the last launch wrote them (copies)."""
        if self._ranks is None:
            if self._last is None:
                raise GraphError("launcher.outputs(): nothing was launched yet")
            return [dict(o) for o in self._last]
        outs = []
        for launch, d in zip(self._ranks, self.kernel.devices):
            with _on(d):
                outs.append(launch.outputs())
        return outs


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def enable_peer_access(devices: list[int]) -> None:
    """Let every GPU of ``devices`` load and store the others' memory directly (CUDA peer access)."""
    from cuda.bindings import driver

    from .interpreter.runtime import _drv

    for i in devices:
        for j in devices:
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                raise GraphError(f"GPU {i} cannot access GPU {j}'s memory directly (no NVLink or PCIe peer path): "
                                 "tensor parallelism needs peer access")
    for i in devices:
        with torch.cuda.device(i):
            torch.empty(1, device=f"cuda:{i}")  # (torch creates the primary context lazily)
            for j in devices:
                if i == j:
                    continue
                torch.empty(1, device=f"cuda:{j}")
                peer = _drv(driver.cuDevicePrimaryCtxRetain(_drv(driver.cuDeviceGet(j), "cuDeviceGet")),
                            "cuDevicePrimaryCtxRetain")
                (err,) = driver.cuCtxEnablePeerAccess(peer, 0)
                if err not in (driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    _drv((err,), f"cuCtxEnablePeerAccess({i} -> {j})")

"""Greedy generation over any decode-step executor.

A step function is ``step(token, pos) -> (logits, next_token)``: ``token`` is i32[1]
on the executor's device, ``pos`` its position; the executor owns the KV caches and
appends to them. The same :class:`Generator` drives the reference executor
(:func:`reference_step`) and, later, the compiled megakernel.

>>> import megaegg as me
>>> from megaegg.models import ModelConfig, build_decode_graph, random_weights
>>> g, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=32)
>>> gen = Generator(reference_step(g, random_weights(spec, seed=0), spec.new_caches()), max_len=32)
>>> len(gen.generate([1, 2, 3], max_new_tokens=4).tokens)
4
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..graph import Graph, GraphError
from ..reference import run_reference

StepFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Generation:
    """The result of :meth:`Generator.generate`."""

    prompt: list[int]
    tokens: list[int]  # generated tokens (the prompt excluded)
    logits: list[torch.Tensor] | None = None  # if kept: logits[i] is the step at position i, [1, vocab]
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step, prompt steps first
    stop_token: int | None = None  # the stop token that ended generation (the last of ``tokens``), if one did
    finished: bool = False  # it ran to its token budget or a stop token (False: cut short, or still running)


@dataclass(frozen=True)
class StepInfo:
    """What one launch did: given to an ``on_step`` callback (:meth:`Generator.generate`,
    :meth:`~megaegg.models.batch.Batcher.run`) right after it, to report progress."""

    step: int  # launches so far, this one included (1: the first)
    seconds: float  # its wall time (reading its tokens back included)
    rows: int  # token rows it fed
    prefill_rows: int  # of them, prompt tokens (0: a pure decode step)
    tokens: tuple[tuple[int, int], ...] = ()  # (sequence index, token) it generated, in order
    running: int = 0  # sequences in flight after it
    waiting: int = 0  # sequences waiting for a slot: not started yet, or preempted (a paged cache)
    finished: int = 0  # sequences done (token budget or stop token)


class Generator:
    """Greedy decoding: the prompt is fed one token per step (prefill as decode), then the argmax.

    ``vocab``, if given, is the model's vocabulary size: prompt ids outside ``[0, vocab)`` are
    refused up front (an embedding lookup past the table would otherwise read garbage).
    """

    def __init__(self, step: StepFn, *, max_len: int, device="cpu", vocab: int | None = None) -> None:
        self.step = step
        self.max_len = max_len
        self.device = torch.device(device)
        self.vocab = vocab
        self.current: Generation | None = None  # the generation in progress (or the last one)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        stop_tokens: Sequence[int] = (),
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        on_step: Callable[[StepInfo], bool | None] | None = None,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (positions from 0; the caches are overwritten).

        Generation ends early after a token in ``stop_tokens`` (kept in the output). ``on_token``
        is called with each generated token as soon as it is known (to stream it), ``on_step`` with a
        :class:`StepInfo` after each launch; if ``on_step`` returns True, generation stops there and
        the tokens so far are returned (``finished`` False). If a step raises (a failed launch,
        ``KeyboardInterrupt``), :attr:`current` keeps the generation up to the step before.
        """
        prompt = token_ids(prompt, "generate: prompt")
        stop_tokens = token_ids(stop_tokens, "generate: stop_tokens")
        if not prompt:
            raise GraphError("generate: the prompt must hold at least one token")
        if self.vocab is not None:
            check_token_ids(prompt, self.vocab, "generate: prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GraphError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens - 1 > self.max_len:
            raise GraphError(
                f"generate: {len(prompt)} prompt + {max_new_tokens} new tokens need "
                f"{len(prompt) + max_new_tokens - 1} cache rows, the caches hold {self.max_len}"
            )
        out = Generation(prompt=prompt, tokens=[], logits=[] if keep_logits else None)
        self.current = out
        token = prompt[0]
        for pos in range(len(prompt) + max_new_tokens - 1):
            t0 = time.perf_counter()
            logits, next_token = self.step(torch.tensor([token], dtype=torch.int32, device=self.device), pos)
            nxt = int(next_token.reshape(-1)[0])  # syncs with the device
            seconds = time.perf_counter() - t0
            out.step_seconds.append(seconds)
            if keep_logits:
                out.logits.append(logits)
            prefill = pos < len(prompt)
            if pos + 1 < len(prompt):
                token = prompt[pos + 1]
            else:
                out.tokens.append(nxt)
                if nxt in stop_tokens:
                    out.stop_token = nxt
                token = nxt
            done = out.stop_token is not None or len(out.tokens) >= max_new_tokens
            out.finished = done
            if on_token is not None and pos + 1 >= len(prompt):  # after the bookkeeping: whole if it raises
                on_token(nxt)
            stop = on_step is not None and on_step(StepInfo(
                step=pos + 1, seconds=seconds, rows=1, prefill_rows=int(prefill),
                tokens=((0, nxt),) if pos + 1 >= len(prompt) else (), running=int(not done), finished=int(done)))
            if done or stop:
                break
        return out


def token_ids(ids, what: str) -> list[int]:
    """``ids`` (a list, tuple, 1-d tensor or array of ints) as a list of ints; else a GraphError naming ``what``
    (``int()`` of each would read a str char by char and cut a float's fraction silently)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    values = list(values) if isinstance(values, Iterable) and not isinstance(values, (str, bytes)) else None
    if values is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in values):
        got = f"{type(ids).__name__} {ids!r}"
        raise GraphError(f"{what} must be a list of int token ids, got {got if len(got) <= 80 else got[:77] + '...'}")
    return [int(t) for t in values]


def check_token_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    """Every id in ``[0, vocab)``, else a GraphError naming the first bad one."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise GraphError(f"{what} token id {t} (at index {i}) is outside the vocabulary: ids must be in "
                             f"[0, {vocab - 1}] for vocab size {vocab}")


def reference_step(graph: Graph, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor]) -> StepFn:
    """A step function over :func:`megaegg.run_reference`; ``caches`` are updated in place."""

    def step(token: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = run_reference(graph, {"token": token, **caches}, weights, {"pos": pos})
        return out["logits"], out["next_token"]

    return step


def kernel_step(kernel, caches: Mapping[str, torch.Tensor], *, check: bool = True) -> StepFn:
    """A step function over a compiled megakernel (one launch per step); ``caches`` updated in place."""

    def step(token: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = kernel(token=token, pos=pos, check=check, **caches)
        return out.get("logits"), out["next_token"]  # no logits from a logits=False graph

    return step

"""The command line of ``examples/llama.py`` and ``examples/qwen3.py``: load, compile, generate.

stderr gets progress (weights per shard or about every second, the compiler's log; a batch's
steps) and errors; stdout gets the generated text as it is produced (token ids without a
tokenizer; a batch's sequences a line each as they finish), the speed, and with ``--json``
one JSON object as its last line. A bad argument, config or checkpoint is one ``error: ...``
line on stderr and a non-zero exit, no traceback; so is a launch that fails mid-generation
(``error: step N: ...``, status 1, after what was generated before it). Ctrl-C stops the run:
what was generated so far (and the JSON line, ``"interrupted": true``), ``interrupted: ...``
on stderr, exit status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from ..graph import GraphError
from ..interpreter.simulator import SimulationError
from .batch import Batcher, Request, Sampling, kernel_batch_step, lone_decode_kernel, single_sequence_decode
from .config import ModelConfig
from .decoder import build_decode_graph, build_step_graph
from .generate import Generation, Generator, StepInfo, check_token_ids
from .presets import DEFAULT_PRESET, FAMILY, PRESETS, presets_of
from .weights import CheckpointError, eos_token_ids, load_checkpoint, random_weights, read_config

DEFAULT_PROMPT_IDS = [1, 2, 3, 4]  # without --prompt / --prompt-ids
DEFAULT_MAX_LEN = 1024  # KV cache rows, capped by the model's max_position_embeddings
MAX_SLOTS = 64  # sequences decoded together at most (more prompts wait for a free slot)
MAX_STEP_TOKENS = 2048  # token rows of one launch at most (longer prompts prefill over several)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def progress(msg: str, t0: float | None = None) -> float:
    now = time.perf_counter()
    suffix = f" [{now - t0:.2f} s]" if t0 is not None else " ..."
    line(f"  {msg}{suffix}")
    return now


def note(msg: str) -> None:
    line(f"    {msg}")


def line(text: str, out=None) -> None:
    """One whole line in one write (a Ctrl-C cannot cut it between the text and its newline)."""
    out = out or sys.stderr
    out.write(text + "\n")
    out.flush()


class HeldInterrupts:
    """Ctrl-C (SIGINT), held back while output is written: ``with HOLD:`` around a token's bookkeeping and
    printing, so that a Ctrl-C never cuts a line in two nor counts a token it did not print; the
    KeyboardInterrupt comes when the block ends. :func:`main` installs :meth:`handler`."""

    def __init__(self) -> None:
        self.depth, self.pending = 0, False

    def handler(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if not self.depth and self.pending:
            self.pending = False
            if exc[0] is None:
                raise KeyboardInterrupt


HOLD = HeldInterrupts()


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``error: ...`` line (no usage block), exit status 2."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def number_arg(cast, bound: str, ok):
    """An argparse type: ``cast(text)`` within ``bound`` (``ok(value)``), else one clear message."""
    kind = "an int" if cast is int else "a number"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind} {bound}, got {text!r}") from None
        if not ok(value):  # (NaN fails every bound)
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text if cast is float else value}")
        return value

    return parse


positive_int = number_arg(int, ">= 1", lambda v: v >= 1)
non_negative_int = number_arg(int, ">= 0", lambda v: v >= 0)
non_negative_float = number_arg(float, ">= 0", lambda v: v >= 0)
positive_float = number_arg(float, "> 0", lambda v: v > 0)
seed_int = number_arg(int, f"in [{-2**31}, {2**31 - 1}]", lambda v: -2**31 <= v < 2**31)  # Sampling's seed
top_k_int = number_arg(int, f"in [0, {2**31 - 1}]", lambda v: 0 <= v < 2**31)  # (an i32 on the device)
unit_float = number_arg(float, "in (0, 1]", lambda v: 0 < v <= 1)


def parse(arch: str, argv=None) -> argparse.Namespace:
    p = OneLineParser(description=f"Generate text with a {arch} model, one megakernel launch per step: greedy "
                                  "decoding by default, or tokens sampled on the device with --temperature > 0 "
                                  "(--top-k, --top-p, --seed). Ctrl-C stops it and prints what was generated so far "
                                  "(exit status 130).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face checkpoint directory")
    src.add_argument("--preset", choices=presets_of(arch), default=DEFAULT_PRESET[arch],
                     help="a built-in config, run with --random-weights (default: %(default)s)")
    p.add_argument("--random-weights", action="store_true", help="random weights (required without --model)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    prompt.add_argument("--prompt-ids", type=int, nargs="+",
                        help=f"prompt token ids (default: {' '.join(map(str, DEFAULT_PROMPT_IDS))})")
    prompt.add_argument("--prompt-ids-file", type=Path,
                        help="a JSON list of prompts, each a list of token ids: run them as one batch")
    prompt.add_argument("--prompt-file", type=Path,
                        help="a text file of prompts, one a line (needs a tokenizer in --model): run them as one batch")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sample at this temperature (default: %(default)s, greedy)")
    p.add_argument("--top-k", type=top_k_int, default=0,
                   help="sample from the k most likely tokens (default: 0, all; k past the vocabulary: all)")
    p.add_argument("--top-p", type=unit_float, default=1.0,
                   help="sample from the fewest tokens whose probability reaches p (default: %(default)s, all)")
    p.add_argument("--seed", type=seed_int, default=0, help="the sampling seed: the same seed, the same tokens (default: 0)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="(default: %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help=f"KV cache rows (default: min({DEFAULT_MAX_LEN}, the config's max_position_embeddings))")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the EOS token(s) of generation_config.json / config.json or the preset")
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda when a GPU is present")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="default: the checkpoint's (bf16 for presets; f32 for presets on the simulator)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel over this many GPUs, one megakernel each (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    return p.parse_args(argv)


def main(arch: str, argv=None) -> dict:
    import signal

    a = parse(arch, argv)
    session = Session()
    old = None
    try:  # Ctrl-C waits for a line being written to end (HOLD); only where Python's own handler is in place
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            old = signal.signal(signal.SIGINT, HOLD.handler)
    except ValueError:  # not the main thread: no handler of ours
        pass
    try:
        try:
            return run(arch, a, session)
        except GraphError as e:  # a bad config, checkpoint or argument: say what, no traceback
            raise SystemExit(f"error: {one_line(e)}") from None
    except KeyboardInterrupt:  # Ctrl-C: what was generated so far, one line, status 130
        session.interrupted()
        raise SystemExit(130) from None
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return "; ".join(lines) or type(e).__name__


# A launch that fails mid-generation (MegakernelError and CUDA errors are RuntimeErrors; the sampler's NaN
# check and GraphError are ValueErrors; the simulator's SimulationError an AssertionError): one
# "error: step N: ..." line after what was generated so far, exit status 1.
STEP_ERRORS = (ValueError, RuntimeError, SimulationError)


@dataclasses.dataclass
class Session:
    """What a run has got to, for the Ctrl-C handler: the engine once built, the output once generating."""

    engine: object = None
    output: Output | None = None

    def interrupted(self) -> None:
        import signal

        try:  # a second Ctrl-C while the partial results print is ignored (they take milliseconds)
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            old = None
        try:
            out, engine = self.output, self.engine
            if out is None or out.t0 is None or engine is None:
                message = "interrupted: stopped before the first step"
            else:
                steps = engine.launches
                message = f"interrupted: stopped after {steps} step{'s' if steps != 1 else ''}"
                if not out.reported:
                    out.report(engine.partial(), interrupted=True)
            sys.stdout.flush()
            line(message)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)


def run(arch: str, a: argparse.Namespace, session: Session | None = None) -> dict:
    import megaegg as me

    session = session or Session()
    backend = pick_backend(a.backend)  # first: no point loading gigabytes for a GPU that is not there
    device = "cuda" if backend == "cuda" else "cpu"
    cfg, eos = model_config(arch, a)
    max_len = cache_rows(a.max_len, cfg)
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)
    needs_tokenizer = a.prompt is not None or a.prompt_file is not None
    tokenizer = load_tokenizer(a) if needs_tokenizer else None  # prompts are checked before the long steps
    prompts = prompt_lists(a, tokenizer, cfg)
    for i, prompt in enumerate(prompts):
        if len(prompt) + a.max_new_tokens - 1 > max_len:
            which = f"prompt {i}" if len(prompts) > 1 else "a"
            raise GraphError(f"--max-new-tokens {a.max_new_tokens} after {which} {len(prompt)}-token prompt needs "
                             f"{len(prompt) + a.max_new_tokens - 1} cache rows; --max-len is {max_len}")
    if a.dtype:
        cfg = dataclasses.replace(cfg, dtype=me.dtypes.as_dtype(a.dtype))
    elif not a.model and backend == "sim":
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    line(f"{arch}: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, {cfg.dtype}, backend {backend}, "
         f"max_len {max_len}")
    show_compiler_log()
    if a.prompt is None and a.prompt_file is None and a.model:
        tokenizer = load_tokenizer(a)  # optional: to print text, not ids
    if a.tp > 1 and (len(prompts) > 1 or not sampling.greedy):
        raise GraphError(f"--tp {a.tp}: one prompt, greedy decoding (a batch or sampling runs on one GPU so far)")
    engine_cls = ParallelEngine if a.tp > 1 else BatchEngine
    engine = session.engine = engine_cls(cfg, a, backend, device, max_len, len(prompts), sampling)
    out = session.output = Output(a, prompts, tokenizer, backend, engine, eos)
    requests = [Request(p, a.max_new_tokens, eos, sampling, on_token=out.on_token(i)) for i, p in enumerate(prompts)]
    out.start()
    try:
        outs = engine.generate(requests, on_step=out.on_step)
    except STEP_ERRORS as e:  # a failed launch: what came before it, then the error
        message = one_line(e)
        if not re.match(r"step \d+: ", message):  # (NaNError.at_step may have named it)
            message = f"step {engine.launches + 1}: {message}"
        out.report(engine.partial(), error=message)
        raise SystemExit(f"error: {message}") from None
    return out.report(outs)


PROGRESS_EVERY_S = 1.0  # a batch's progress line on stderr: at most this often (and at its first and last step)


class Output:
    """What a generation prints: a lone prompt's tokens on stdout as they come (``generated: ...``); a batch's
    sequences each as one line ``generated[i]: ...`` on stdout when it finishes, and a progress line on stderr
    per step (at most every PROGRESS_EVERY_S); then the speed line and, with ``--json``, the JSON line."""

    def __init__(self, a, prompts, tokenizer, backend, engine, stop_tokens) -> None:
        self.a, self.prompts, self.tokenizer, self.backend, self.engine = a, prompts, tokenizer, backend, engine
        self.stop_tokens = tuple(stop_tokens)
        self.batch = len(prompts) > 1
        self.streams = [BatchPrinter(tokenizer, i, a.max_new_tokens, stop_tokens) if self.batch else TokenPrinter(tokenizer)
                        for i in range(len(prompts))]
        self.first_token: list[float | None] = [None] * len(prompts)  # seconds from the start of generation
        self.t0: float | None = None
        self.tokens = 0
        self.shown = -1.0  # when the last progress line was printed
        self.reported = False

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if not self.batch:
            sys.stdout.write("generated: ")
            sys.stdout.flush()

    def on_token(self, i: int):
        def token(tok: int) -> None:
            with HOLD:
                if self.first_token[i] is None:
                    self.first_token[i] = time.perf_counter() - self.t0
                self.tokens += 1
                self.streams[i](tok)

        return token

    def on_step(self, info: StepInfo) -> None:
        now = time.perf_counter()
        last = info.running == 0 and info.waiting == 0
        if not self.batch or not (info.step == 1 or last or now - self.shown >= PROGRESS_EVERY_S):
            return
        self.shown = now
        rate = self.tokens / (now - self.t0) if now > self.t0 else 0.0
        line(f"  step {info.step}: {info.running} running, {info.waiting} waiting, {info.finished} finished; "
             f"{self.tokens} tokens, {rate:.1f} tokens/s")

    def report(self, outs: list[Generation], *, interrupted: bool = False, error: str | None = None) -> dict:
        """The end of the run (or what it got to): the rest of the token lines, the speed line, the JSON line
        (a Ctrl-C meanwhile waits for it to end)."""
        with HOLD:
            self.reported = True
            return self._report(outs, interrupted, error)

    def _report(self, outs: list[Generation], interrupted: bool, error: str | None) -> dict:
        seconds = time.perf_counter() - self.t0
        for st, out in zip(self.streams, outs):
            for tok in out.tokens[len(st.tokens):]:  # (a token whose callback a Ctrl-C cut off)
                st(tok)
            st.finish()
        steps = self.engine.launches
        ms = self.engine.step_ms()
        generated = sum(len(o.tokens) for o in outs)
        rate = generated / seconds if seconds > 0 else 0.0
        stop = set(self.stop_tokens)  # (from the tokens: right even if a Ctrl-C came between a token and its note)
        stopped = [bool(o.tokens) and o.tokens[-1] in stop for o in outs]
        finished = [o.finished or s or len(o.tokens) >= self.a.max_new_tokens for o, s in zip(outs, stopped)]
        firsts = [t for t in self.first_token if t is not None]
        launches = f"{steps} launch{'es' if steps != 1 else ''}"
        speed = (f"{ms:.3f} ms/step (median wall time of a decode step, {self.backend}; {launches})"
                 if ms is not None else f"no launch finished ({self.backend})")
        speed += f"; {rate:.1f} tokens/s ({generated} tokens in {seconds:.2f} s)"
        if firsts:
            lo, hi = f"{min(firsts):.2f}", f"{max(firsts):.2f}"
            speed += f", first token{'s' if len(firsts) > 1 else ''} after {lo if lo == hi else f'{lo} to {hi}'} s"
        if any(stopped):
            speed += ", stopped at EOS " + " ".join(str(o.tokens[-1]) for o, s in zip(outs, stopped) if s)
        line(speed, sys.stdout)
        result = {"prompt_ids": self.prompts, "generated_ids": [o.tokens for o in outs], "launches": steps,
                  "steps": steps, "generated_tokens": generated, "ms_per_step": ms, "tokens_per_s": rate,
                  "generation_s": seconds, "time_to_first_token_s": self.first_token, "stopped_at_eos": stopped,
                  "finished": finished,
                  "text": [st.text() for st in self.streams] if self.tokenizer else None,
                  "interrupted": interrupted, "error": error}
        if self.a.json:
            line(json.dumps(result), sys.stdout)
        return result


def median_ms(seconds: list[float], prefill: list[bool]) -> float | None:
    """The median wall time (ms) of the pure decode steps (of every step if none was), None before a step."""
    decode = [s for s, p in zip(seconds, prefill) if not p] or seconds
    return 1000 * statistics.median(decode) if decode else None


class Engine:
    """Runs the requests: ``generate(requests, on_step)``, ``partial()`` (what every request generated so far,
    after an interruption), ``launches`` and ``step_ms()`` (the median decode step). Both count from the
    records the generation loops keep as each launch returns, before its tokens are handed out."""


class BatchEngine(Engine):
    """Every prompt through one step graph (:func:`build_step_graph`): a batch of prompts prefills in one
    launch (as many as MAX_STEP_TOKENS rows allow) and decodes together, continuously batched; a lone greedy
    sequence decodes through the batch-1 decode graph (its fused, faster kernel) on its cache slot."""

    def __init__(self, cfg, a, backend, device, max_len, n_prompts, sampling) -> None:
        import megaegg as me

        self.slots = min(n_prompts, MAX_SLOTS)
        t = progress(f"building graphs ({self.slots} sequence slots)")
        graph, spec = build_step_graph(cfg, max_len=max_len, slots=self.slots, sampling=not sampling.greedy)
        weights = load_weights(a, spec, device)
        t = progress("weights loaded", t)
        tokens = min(MAX_STEP_TOKENS, self.slots * max_len)
        step_kernel = me.compile(graph, weights, backend=backend, max_dims={"n": tokens, "r": self.slots, "ctx": max_len},
                                 dims_hint={"n": self.slots, "r": self.slots, "ctx": min(512, max_len)})
        t = progress(f"compiled the step: {len(step_kernel.queue.entries)} queue entries "
                     f"({compile_summary(step_kernel.artifact.timings)})", t)
        self.caches = spec.new_caches(device=device)
        step = kernel_batch_step(step_kernel, self.caches)
        if n_prompts == 1 and sampling.greedy:
            decode_kernel = lone_decode_kernel(cfg, weights, backend=backend, max_len=max_len, sampling=False)
            progress(f"compiled the decode step: {len(decode_kernel.queue.entries)} queue entries "
                     f"({compile_summary(decode_kernel.artifact.timings)})", t)
            step = single_sequence_decode(step, decode_kernel, self.caches, run_ahead=False)  # (ms_per_step: a launch)
        self.batcher = Batcher(step, slots=self.slots, max_len=max_len, max_tokens=tokens, device=device, vocab=cfg.vocab)

    @property
    def launches(self) -> int:
        return self.batcher.launches

    def step_ms(self) -> float | None:
        b = self.batcher
        return median_ms(b.step_seconds, [rows > 0 for rows in b.prefill_rows])

    def generate(self, requests: list[Request], on_step=None) -> list[Generation]:
        return self.batcher.run(requests, on_step=on_step)

    def partial(self) -> list[Generation]:
        return self.batcher.drain()


class SequentialEngine(Engine):
    """One prompt after another through a :class:`Generator` (set by ``_start``), one token a launch: the
    tensor-parallel engine's base (a batch runs on one GPU so far)."""

    def _start(self, gen: Generator) -> None:
        self.gen, self.requests, self.outs = gen, [], []

    @property
    def launches(self) -> int:
        return sum(len(g.step_seconds) for g in self.partial())

    def step_ms(self) -> float | None:
        gens = self.partial()
        return median_ms([s for g in gens for s in g.step_seconds],
                         [j < len(g.prompt) for g in gens for j in range(len(g.step_seconds))])

    def generate(self, requests: list[Request], on_step=None) -> list[Generation]:
        self.requests, self.outs = list(requests), []
        for k, r in enumerate(self.requests):
            def step(info: StepInfo, k=k):  # numbered over the whole run, sequence k of all
                info = dataclasses.replace(info, step=self.launches, tokens=tuple((k, t) for _, t in info.tokens),
                                           waiting=len(self.requests) - k - 1, finished=k + info.finished)
                return on_step(info) if on_step is not None else None

            self.gen.current = None
            out = self.gen.generate(list(r.prompt), r.max_new_tokens, stop_tokens=r.stop_tokens, on_token=r.on_token,
                                    on_step=step)
            self.outs.append(out)
            if not out.finished:  # on_step asked to stop
                break
        return self.partial()

    def partial(self) -> list[Generation]:
        outs = list(self.outs)
        current = self.gen.current
        if len(outs) < len(self.requests) and current is not None and all(current is not o for o in outs):
            outs.append(current)
        return outs + [Generation(prompt=list(r.prompt), tokens=[]) for r in self.requests[len(outs):]]


class ParallelEngine(SequentialEngine):
    """``--tp N``: the batch-1 decode graph of one rank of N (megaegg/parallel.py), a megakernel on each
    GPU, each with its shard of the weights and of the KV cache heads."""

    def __init__(self, cfg, a, backend, device, max_len, n_prompts, sampling) -> None:
        from ..compiler import cached_artifact
        from ..parallel import ParallelKernel
        from .decoder import shard_weights

        if backend == "cuda" and torch.cuda.device_count() < a.tp:
            raise GraphError(f"--tp {a.tp} needs {a.tp} GPUs; this machine has {torch.cuda.device_count()}")
        t = progress(f"building graphs (tensor parallel over {a.tp} {'GPUs' if backend == 'cuda' else 'simulated GPUs'})")
        _, full = build_decode_graph(cfg, max_len=max_len)
        graph, spec = build_decode_graph(cfg, max_len=max_len, logits=False, tp=a.tp)
        weights = load_weights(a, full, device)
        devices = [f"cuda:{r}" if backend == "cuda" else "cpu" for r in range(a.tp)]
        shards = [{n: w.to(d) for n, w in shard_weights(spec, weights, r).items()} for r, d in enumerate(devices)]
        del weights
        t = progress("weights loaded and sharded", t)
        art = cached_artifact(graph, max_dims={"pos": max_len - 1}, dims_hint={"pos": min(512, max_len - 1)},
                              compile_cuda=backend == "cuda")
        kernel = ParallelKernel(art, shards, backend=backend)
        progress(f"compiled: {len(art.queue.entries)} queue entries a rank ({compile_summary(art.timings)})", t)
        caches = [spec.new_caches(device=d) for d in devices]

        def step(token: torch.Tensor, pos: int):
            outs = kernel([{"token": token.to(d), **c} for d, c in zip(devices, caches)], pos=pos)
            return None, outs[0]["next_token"].to(device)

        self._start(Generator(step, max_len=max_len, device=device, vocab=cfg.vocab))


def load_weights(a: argparse.Namespace, spec, device):
    progress(f"weights: {spec.weight_bytes / 1e9:.2f} GB" + (f" from {a.model}" if a.model and not a.random_weights
                                                              else ", random"))
    return (load_checkpoint(a.model, spec, device=device, progress=note) if a.model and not a.random_weights
            else random_weights(spec, seed=0, device=device, progress=note))


def pick_backend(name: str | None) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise GraphError("--backend cuda: no CUDA GPU is available (torch.cuda.is_available() is False); "
                         "use --backend sim for the CPU simulator")
    return name or ("cuda" if torch.cuda.is_available() else "sim")


def model_config(arch: str, a: argparse.Namespace) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model's config and its EOS token ids (none with --ignore-eos)."""
    if a.model:
        if not a.model.is_dir():
            raise CheckpointError(f"--model {a.model}: no such directory")
        cfg = read_config(a.model)
        eos = () if a.ignore_eos else eos_token_ids(a.model)
        where = f"{a.model / 'config.json'} describes"
    else:
        if not a.random_weights:
            raise GraphError(f"give --model DIR (a local checkpoint) or --random-weights (a built-in config: "
                             f"--preset, default {DEFAULT_PRESET[arch]}); no checkpoint is downloaded")
        cfg = ModelConfig.preset(a.preset)
        eos = () if a.ignore_eos else eos_token_ids(PRESETS[a.preset])
        where = f"preset {a.preset!r} is"
    if FAMILY[cfg.arch] != arch:
        raise GraphError(f"this example runs {arch} models; {where} a {cfg.arch} model "
                         f"(use examples/{FAMILY[cfg.arch]}.py)")
    return cfg, eos


def cache_rows(max_len: int | None, cfg: ModelConfig) -> int:
    if max_len is None:
        return min(DEFAULT_MAX_LEN, cfg.max_positions)
    if max_len > cfg.max_positions:
        raise GraphError(f"--max-len {max_len} is above the model's max_position_embeddings ({cfg.max_positions}) or its "
                         "sliding_window, where that is shorter")
    return max_len


def load_tokenizer(a: argparse.Namespace):
    """The checkpoint's tokenizer, or None without one (then tokens print as ids); text prompts need it."""
    flag = "--prompt" if a.prompt is not None else "--prompt-file" if a.prompt_file is not None else None
    if flag and not a.model:
        raise GraphError(f"{flag} needs --model DIR with a tokenizer; with --preset, give --prompt-ids or --prompt-ids-file")
    if not a.model or not any((a.model / f).is_file() for f in TOKENIZER_FILES):
        if flag:
            raise CheckpointError(f"{flag}: {a.model} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                                  "give --prompt-ids or --prompt-ids-file")
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(a.model)
    except Exception as e:  # transformers raises many kinds; say which file and why
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if not flag:  # only needed to print text: go on with ids
            note(f"no tokenizer from {a.model} ({reason}); printing token ids")
            return None
        raise CheckpointError(f"{flag}: cannot load the tokenizer of {a.model} ({reason})") from e


def prompt_lists(a: argparse.Namespace, tokenizer, cfg: ModelConfig) -> list[list[int]]:
    """The prompts as token ids: one from --prompt / --prompt-ids (or the default), or a batch from a file."""
    if a.prompt is not None:
        return [encode(tokenizer, a.prompt, "--prompt", cfg)]
    if a.prompt_file is not None:
        lines = [line for line in read_text(a.prompt_file, "--prompt-file").splitlines() if line.strip()]
        if not lines:
            raise GraphError(f"--prompt-file {a.prompt_file}: no prompts (one a line)")
        return [encode(tokenizer, line, f"--prompt-file {a.prompt_file} line {i + 1}:", cfg) for i, line in enumerate(lines)]
    if a.prompt_ids_file is not None:
        text = read_text(a.prompt_ids_file, "--prompt-ids-file")
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphError(f"--prompt-ids-file {a.prompt_ids_file}: not JSON ({e.msg}, line {e.lineno})") from None
        if (not isinstance(prompts, list) or not prompts or
                not all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                        for p in prompts)):
            raise GraphError(f"--prompt-ids-file {a.prompt_ids_file}: expected a non-empty JSON list of prompts, "
                             "each a non-empty list of token ids, e.g. [[1, 2, 3], [4, 5]]")
        for i, p in enumerate(prompts):
            check_token_ids(p, cfg.vocab, f"--prompt-ids-file {a.prompt_ids_file}: prompt {i}:")
        return prompts
    ids = a.prompt_ids or list(DEFAULT_PROMPT_IDS)
    check_token_ids(ids, cfg.vocab, "--prompt-ids:")
    return [ids]


def encode(tokenizer, text: str, what: str, cfg: ModelConfig) -> list[int]:
    if not text:
        raise GraphError(f"{what} is empty: give some text, or --prompt-ids")
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise GraphError(f"{what} {text!r} tokenizes to no tokens: give some text, or --prompt-ids")
    check_token_ids(ids, cfg.vocab, what if what.endswith(":") else f"{what}:")
    return ids


def read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise GraphError(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GraphError(f"{flag} {path}: cannot be read ({type(e).__name__}: {e})") from None


def compile_summary(timings: dict[str, float]) -> str:
    """A cache hit has only "cache_load" (and "nvrtc" if it had to add the cubin); a build, "rewrite" and more."""
    parts = [f"artifact cache hit, loaded in {timings['cache_load']:.2f} s" if "cache_load" in timings
             else f"rewrite {timings.get('rewrite', 0.0):.2f} s"]
    if "nvrtc" in timings:
        parts.append(f"nvrtc {timings['nvrtc']:.2f} s{' cached' if timings.get('nvrtc_cached') else ''}")
    return ", ".join(parts)


def show_compiler_log() -> None:
    """The compiler's INFO records on logger "megaegg" (rewrite, nvrtc, artifact cache) as stderr progress."""
    log = logging.getLogger("megaegg")
    if not any(getattr(h, "megaegg_cli", False) for h in log.handlers):  # once per process
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("    %(message)s"))
        handler.megaegg_cli = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)


class TokenPrinter:
    """An ``on_token`` callback printing to stdout as tokens come: the new text with a tokenizer, else the ids."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        if self.tokenizer is None:
            self._write(("" if len(self.tokens) == 1 else " ") + str(token))
            return
        text = self.text()
        if not text.endswith("\ufffd"):  # a partial UTF-8 character waits for the next token
            self._show(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def finish(self) -> None:
        if self.tokenizer is not None:
            self._show(self.text())
        self._write("\n")

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):  # decoding may revise earlier text (rarely): only appends are printed
            self._write(text[len(self.shown):])
            self.shown = text

    def _write(self, s: str) -> None:
        self.out.write(s)
        self.out.flush()


class BatchPrinter(TokenPrinter):
    """One sequence of a batch: its line ``generated[i]: ...`` (text, or ids without a tokenizer) goes to stdout
    as soon as it finishes (``max_new_tokens`` or a stop token), or at the end of the run if cut short."""

    def __init__(self, tokenizer, index: int, max_new_tokens: int, stop_tokens=(), out=None) -> None:
        super().__init__(tokenizer, out)
        self.index, self.max_new_tokens, self.stop_tokens = index, max_new_tokens, tuple(stop_tokens)
        self.printed = False

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self.max_new_tokens or token in self.stop_tokens:
            self.finish()

    def finish(self) -> None:
        if not self.printed:
            self.printed = True
            body = self.text() if self.tokenizer is not None else " ".join(map(str, self.tokens))
            self._write(f"generated[{self.index}]: {body.rstrip()}\n")

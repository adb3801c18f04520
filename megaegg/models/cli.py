"""The command line of ``examples/llama.py`` and ``examples/qwen3.py``: load, compile, generate.

stderr gets progress (weights per shard or about every second, the compiler's log) and
errors; stdout gets the generated text as it is produced (token ids without a tokenizer),
the speed, and with ``--json`` one JSON object as its last line. A bad argument, config
or checkpoint is one ``error: ...`` line on stderr and a non-zero exit, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import sys
import time
from pathlib import Path

import torch

from ..graph import GraphError
from .batch import Batcher, Request, Sampling, kernel_batch_step, single_sequence_decode
from .config import ModelConfig
from .decoder import build_decode_graph, build_step_graph
from .generate import Generation, Generator, check_token_ids, kernel_step
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
    print(f"  {msg}{suffix}", file=sys.stderr, flush=True)
    return now


def note(msg: str) -> None:
    print(f"    {msg}", file=sys.stderr, flush=True)


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
unit_float = number_arg(float, "in (0, 1]", lambda v: 0 < v <= 1)


def parse(arch: str, argv=None) -> argparse.Namespace:
    p = OneLineParser(description=f"Greedy decoding of a {arch} model through one megakernel per step")
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
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k most likely tokens (default: 0, all)")
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
    a = parse(arch, argv)
    try:
        return run(arch, a)
    except GraphError as e:  # a bad config, checkpoint or argument: say what, no traceback
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise SystemExit(f"error: {'; '.join(lines)}") from None


def run(arch: str, a: argparse.Namespace) -> dict:
    import megaegg as me

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
    if cfg.moe is not None and not sampling.greedy:
        raise GraphError("--temperature > 0: sampling is not supported for Qwen3-MoE models yet (greedy only)")
    if a.dtype:
        cfg = dataclasses.replace(cfg, dtype=me.dtypes.as_dtype(a.dtype))
    elif not a.model and backend == "sim":
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    print(f"{arch}: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, {cfg.dtype}, backend {backend}, "
          f"max_len {max_len}", file=sys.stderr)
    show_compiler_log()
    if a.prompt is None and a.prompt_file is None and a.model:
        tokenizer = load_tokenizer(a)  # optional: to print text, not ids
    if a.tp > 1 and (len(prompts) > 1 or not sampling.greedy):
        raise GraphError(f"--tp {a.tp}: one prompt, greedy decoding (a batch or sampling runs on one GPU so far)")
    engine_cls = ParallelEngine if a.tp > 1 else SequentialEngine if cfg.moe is not None else BatchEngine
    engine = engine_cls(cfg, a, backend, device, max_len, len(prompts), sampling)
    streams = [Stream(tokenizer) if len(prompts) == 1 else Stream(tokenizer, out=io.StringIO()) for _ in prompts]
    if len(prompts) == 1:  # streamed as it comes; a batch prints each prompt's tokens when done
        print("generated: ", end="", flush=True)
    stop = () if a.ignore_eos else eos
    outs = engine.generate([Request(p, a.max_new_tokens, stop, sampling, on_token=st) for p, st in zip(prompts, streams)])
    for i, (st, out) in enumerate(zip(streams, outs)):
        st.finish()
        if len(prompts) > 1:
            print(f"generated[{i}]: {st.out.getvalue().rstrip()}", flush=True)
    ms = 1000 * engine.decode_seconds()
    stopped = [o.stop_token is not None for o in outs]
    eos_note = ", stopped at EOS " + " ".join(str(o.stop_token) for o in outs if o.stop_token is not None) if any(stopped) else ""
    print(f"{ms:.3f} ms/step (median wall time per decode step, {backend}; {engine.launches} launches){eos_note}")
    result = {"prompt_ids": prompts, "generated_ids": [o.tokens for o in outs], "launches": engine.launches,
              "ms_per_token": ms, "stopped_at_eos": stopped, "text": [st.text() for st in streams] if tokenizer else None}
    if a.json:
        print(json.dumps(result))
    return result


class BatchEngine:
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
            decode_graph, _ = build_decode_graph(cfg, max_len=max_len, logits=False)  # tokens only: LM head + argmax fuse
            decode_kernel = me.compile(decode_graph, weights, backend=backend, max_dims={"pos": max_len - 1},
                                       dims_hint={"pos": min(512, max_len - 1)})
            progress(f"compiled the decode step: {len(decode_kernel.queue.entries)} queue entries "
                     f"({compile_summary(decode_kernel.artifact.timings)})", t)
            step = single_sequence_decode(step, decode_kernel, self.caches)
        self.batcher = Batcher(step, slots=self.slots, max_len=max_len, max_tokens=tokens, device=device, vocab=cfg.vocab)

    @property
    def launches(self) -> int:
        return self.batcher.launches

    def generate(self, requests: list[Request]) -> list[Generation]:
        return self.batcher.run(requests)

    def decode_seconds(self) -> float:
        s = self.batcher.step_seconds
        decode = s[1:] or s  # (the first step prefills)
        return sorted(decode)[len(decode) // 2]


class SequentialEngine:
    """Qwen3-MoE models: the batch-1 decode graph, one token a launch, one prompt after another (the
    routed experts take one row per step so far)."""

    def __init__(self, cfg, a, backend, device, max_len, n_prompts, sampling) -> None:
        import megaegg as me

        t = progress("building graph")
        graph, spec = build_decode_graph(cfg, max_len=max_len, logits=False)  # tokens only: LM head + argmax fuse
        weights = load_weights(a, spec, device)
        t = progress("weights loaded", t)
        kernel = me.compile(graph, weights, backend=backend, max_dims={"pos": max_len - 1},
                            dims_hint={"pos": min(512, max_len - 1)})
        progress(f"compiled: {len(kernel.queue.entries)} queue entries ({compile_summary(kernel.artifact.timings)})", t)
        if n_prompts > 1:
            note("Qwen3-MoE: the prompts run one after another, one token a launch")
        self.gen = Generator(kernel_step(kernel, spec.new_caches(device=device)), max_len=max_len, device=device,
                             vocab=cfg.vocab)
        self.launches, self.seconds = 0, []

    def generate(self, requests: list[Request]) -> list[Generation]:
        outs = []
        for r in requests:
            out = self.gen.generate(list(r.prompt), r.max_new_tokens, stop_tokens=r.stop_tokens, on_token=r.on_token)
            self.launches += len(out.step_seconds)
            self.seconds += out.step_seconds[len(r.prompt):] or out.step_seconds
            outs.append(out)
        return outs

    def decode_seconds(self) -> float:
        return sorted(self.seconds)[len(self.seconds) // 2]


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

        self.gen = Generator(step, max_len=max_len, device=device, vocab=cfg.vocab)
        self.launches, self.seconds = 0, []


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
        raise GraphError(f"--max-len {max_len} is above the model's max_position_embeddings ({cfg.max_positions})")
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


class Stream:
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

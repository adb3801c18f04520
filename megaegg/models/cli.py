"""The command line of ``examples/llama.py`` and ``examples/qwen3.py``: load, compile, generate.

stderr gets progress (weights per shard or about every second, the compiler's log) and
errors; stdout gets the generated text as it is produced (token ids without a tokenizer),
the speed, and with ``--json`` one JSON object as its last line. A bad argument, config
or checkpoint is one ``error: ...`` line on stderr and a non-zero exit, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

from ..graph import GraphError
from .config import ModelConfig
from .decoder import build_decode_graph
from .generate import Generator, check_token_ids, kernel_step
from .presets import DEFAULT_PRESET, FAMILY, PRESETS, presets_of
from .weights import CheckpointError, eos_token_ids, load_checkpoint, random_weights, read_config

DEFAULT_PROMPT_IDS = [1, 2, 3, 4]  # without --prompt / --prompt-ids
DEFAULT_MAX_LEN = 1024  # KV cache rows, capped by the model's max_position_embeddings
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    p.add_argument("--max-new-tokens", type=positive_int, default=16, help="(default: %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help=f"KV cache rows (default: min({DEFAULT_MAX_LEN}, the config's max_position_embeddings))")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the EOS token(s) of generation_config.json / config.json or the preset")
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda when a GPU is present")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="default: the checkpoint's (bf16 for presets; f32 for presets on the simulator)")
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
    tokenizer = load_tokenizer(a) if a.prompt is not None else None  # a prompt is checked before the long steps
    prompt = prompt_ids(a, tokenizer, cfg)
    if len(prompt) + a.max_new_tokens - 1 > max_len:
        raise GraphError(f"--max-new-tokens {a.max_new_tokens} after a {len(prompt)}-token prompt needs "
                         f"{len(prompt) + a.max_new_tokens - 1} cache rows; --max-len is {max_len}")
    if a.dtype:
        cfg = dataclasses.replace(cfg, dtype=me.dtypes.as_dtype(a.dtype))
    elif not a.model and backend == "sim":
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    print(f"{arch}: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, {cfg.dtype}, backend {backend}, "
          f"max_len {max_len}", file=sys.stderr)
    show_compiler_log()
    t = progress("building graph")
    graph, spec = build_decode_graph(cfg, max_len=max_len, logits=False)  # tokens only: LM head + argmax fuse
    t = progress(f"graph: {len(graph.nodes)} nodes", t)
    progress(f"weights: {spec.weight_bytes / 1e9:.2f} GB" + (f" from {a.model}" if a.model and not a.random_weights
                                                              else ", random"))
    weights = (load_checkpoint(a.model, spec, device=device, progress=note) if a.model and not a.random_weights
               else random_weights(spec, seed=0, device=device, progress=note))
    t = progress("weights loaded", t)
    kernel = me.compile(graph, weights, backend=backend, max_dims={"pos": max_len - 1},
                        dims_hint={"pos": min(512, max_len - 1)})
    progress(f"compiled: {len(kernel.queue.entries)} queue entries ({compile_summary(kernel.artifact.timings)})", t)

    if a.prompt is None and a.model:
        tokenizer = load_tokenizer(a)  # optional: to print text, not ids
    gen = Generator(kernel_step(kernel, spec.new_caches(device=device)), max_len=max_len, device=device,
                    vocab=cfg.vocab)
    stream = Stream(tokenizer)
    print("generated: ", end="", flush=True)
    out = gen.generate(prompt, a.max_new_tokens, stop_tokens=() if a.ignore_eos else eos, on_token=stream)
    stream.finish()
    decode = out.step_seconds[len(prompt):] or out.step_seconds
    ms = 1000 * sorted(decode)[len(decode) // 2]
    stop = f", stopped at EOS {out.stop_token}" if out.stop_token is not None else ""
    print(f"{ms:.3f} ms/token (median wall time per decode step, {backend}){stop}")
    result = {"prompt_ids": prompt, "generated_ids": out.tokens, "ms_per_token": ms,
              "stopped_at_eos": out.stop_token is not None, "text": stream.text() if tokenizer else None}
    if a.json:
        print(json.dumps(result))
    return result


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
    """The checkpoint's tokenizer, or None without one (then tokens print as ids); --prompt needs it."""
    if a.prompt is not None and not a.model:
        raise GraphError("--prompt needs --model DIR with a tokenizer; with --preset, give --prompt-ids")
    if not a.model or not any((a.model / f).is_file() for f in TOKENIZER_FILES):
        if a.prompt is not None:
            raise CheckpointError(f"--prompt: {a.model} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                                  "give --prompt-ids")
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(a.model)
    except Exception as e:  # transformers raises many kinds; say which file and why
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        if a.prompt is None:  # only needed to print text: go on with ids
            note(f"no tokenizer from {a.model} ({reason}); printing token ids")
            return None
        raise CheckpointError(f"--prompt: cannot load the tokenizer of {a.model} ({reason})") from e


def prompt_ids(a: argparse.Namespace, tokenizer, cfg: ModelConfig) -> list[int]:
    if a.prompt is not None:
        if not a.prompt:
            raise GraphError("--prompt is empty: give some text, or --prompt-ids")
        ids = list(tokenizer(a.prompt)["input_ids"])
        if not ids:
            raise GraphError(f"--prompt {a.prompt!r} tokenizes to no tokens: give some text, or --prompt-ids")
        check_token_ids(ids, cfg.vocab, "--prompt:")
        return ids
    ids = a.prompt_ids or list(DEFAULT_PROMPT_IDS)
    check_token_ids(ids, cfg.vocab, "--prompt-ids:")
    return ids


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

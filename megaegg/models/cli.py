"""The command line of ``examples/llama.py`` and ``examples/qwen3.py``: load, compile, generate."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from .config import ModelConfig
from .decoder import build_decode_graph
from .generate import Generator, kernel_step
from .presets import PRESETS
from .weights import load_checkpoint, random_weights, read_config


def progress(msg: str, t0: float | None = None) -> float:
    now = time.perf_counter()
    suffix = f" [{now - t0:.2f} s]" if t0 is not None else " ..."
    print(f"  {msg}{suffix}", file=sys.stderr, flush=True)
    return now


def parse(arch: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"Greedy decoding of a {arch} model through one megakernel per step")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="local Hugging Face checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--random-weights", action="store_true", help="random weights (required with --preset)")
    p.add_argument("--prompt", help="prompt text (needs a tokenizer in --model)")
    p.add_argument("--prompt-ids", type=int, nargs="+", help="prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024, help="KV cache rows")
    p.add_argument("--backend", choices=("cuda", "sim"), default=None, help="default: cuda when a GPU is present")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None, help="default: the checkpoint's (bf16 for presets)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args(argv)


def main(arch: str, argv=None) -> dict:
    from ..graph import GraphError

    try:
        return run(arch, parse(arch, argv))
    except GraphError as e:  # a bad config, checkpoint or argument: say what, no traceback
        raise SystemExit(f"error: {e}") from None


def run(arch: str, a: argparse.Namespace) -> dict:
    import megaegg as me

    backend = a.backend or ("cuda" if torch.cuda.is_available() else "sim")
    device = "cuda" if backend == "cuda" else "cpu"
    if a.model:
        cfg = read_config(a.model)
    else:
        if not a.random_weights:
            raise SystemExit("--preset needs --random-weights (no checkpoint is downloaded)")
        cfg = ModelConfig.preset(a.preset)
    if cfg.arch != arch:
        raise SystemExit(f"this example runs {arch} models; the config is {cfg.arch}")
    if a.dtype:
        cfg = dataclasses.replace(cfg, dtype=me.dtypes.as_dtype(a.dtype))
    elif not a.model and backend == "sim":
        cfg = dataclasses.replace(cfg, dtype=me.f32)  # the CPU simulator has no fast bf16 matmul
    print(f"{arch}: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, {cfg.dtype}, backend {backend}", file=sys.stderr)
    t = progress("building graph")
    graph, spec = build_decode_graph(cfg, max_len=a.max_len, logits=False)  # tokens only: LM head + argmax fuse
    t = progress(f"graph: {len(graph.nodes)} nodes", t)
    weights = (load_checkpoint(a.model, spec, device=device) if a.model and not a.random_weights
               else random_weights(spec, seed=0, device=device))
    t = progress(f"weights: {spec.weight_bytes / 1e9:.2f} GB", t)
    kernel = me.compile(graph, weights, backend=backend, max_dims={"pos": a.max_len - 1}, dims_hint={"pos": min(512, a.max_len - 1)})
    tm = kernel.artifact.timings
    progress(f"compiled: {len(kernel.queue.entries)} queue entries (rewrite {tm['rewrite']:.2f} s"
             + (f", nvrtc {tm['nvrtc']:.2f} s{' cached' if tm.get('nvrtc_cached') else ''}" if "nvrtc" in tm else "") + ")", t)

    tokenizer = None
    if a.prompt:
        if not a.model:
            raise SystemExit("--prompt needs --model with a tokenizer; use --prompt-ids with presets")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        prompt = tokenizer(a.prompt)["input_ids"]
    else:
        prompt = a.prompt_ids or [1, 2, 3, 4]
    gen = Generator(kernel_step(kernel, spec.new_caches(device=device)), max_len=a.max_len, device=device)
    out = gen.generate(prompt, a.max_new_tokens)
    decode = out.step_seconds[len(prompt):] or out.step_seconds
    ms = 1000 * sorted(decode)[len(decode) // 2]
    text = tokenizer.decode(out.tokens) if tokenizer else " ".join(map(str, out.tokens))
    print(f"generated: {text}")
    print(f"{ms:.3f} ms/token (median wall time per decode step, {backend})")
    result = {"prompt_ids": prompt, "generated_ids": out.tokens, "ms_per_token": ms}
    if a.json:
        print(json.dumps(result))
    return result

"""The command lines: inspect and the model examples, on the CPU (simulator)."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_checkpoints import save_tiny, save_word_tokenizer

ROOT = Path(__file__).parent.parent


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_inspect_tiny_reports_ops_barriers_and_times():
    out = run("-m", "megaegg", "inspect", "--model", "tiny")
    assert out.returncode == 0, out.stderr
    for needle in ("matvec", "attn_partial", "queue entries", "barrier sets", "waits per launch", "compile time (s)"):
        assert needle in out.stdout


def test_bad_arguments_give_one_line_errors():
    out = run("-m", "megaegg", "inspect", "--model", "tiny", "--context", "5000")
    assert out.returncode != 0 and "error: --context 5000" in out.stderr and "Traceback" not in out.stderr
    out = run("-m", "megaegg", "inspect", "--model", "tiny", "--context", "-1")  # was "-1 must be below ... 2048"
    assert out.returncode == 2 and out.stderr.strip() == "error: argument --context: must be >= 0, got -1"


@pytest.mark.parametrize("args, error", [
    (("--context", "100000"), "--context 100000 must be below tiny's max_position_embeddings (2048)"),  # a traceback
    (("--json", "/nonexistent/dir/out.json"),  # was a traceback after the whole run
     "argument --json: cannot write /nonexistent/dir/out.json: no directory /nonexistent/dir"),
    (("--tp", "0"), "argument --tp: must be >= 1, got 0"),  # was ignored
    (("--bw-reps", "0"), "argument --bw-reps: must be >= 1, got 0"),  # the bandwidth test failed
    (("--bw-gib", "-1"), "argument --bw-gib: must be > 0, got -1"),
    (("--iters", "0"), "argument --iters: must be >= 1, got 0"),  # was "--context must be >= 0, --iters >= 1, ..."
])
def test_bench_dry_run_bad_arguments_are_one_line_errors(args, error):
    out = run("examples/bench_decode.py", "--dry-run", *args)
    assert out.returncode == 2 and out.stderr.strip() == f"error: {error}", out.stderr


def test_bench_hf_dry_run_compares_the_traced_and_the_built_step(tmp_path):
    pytest.importorskip("transformers")
    out = run("examples/bench_hf.py", "--dry-run", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["preset"] == "tiny" and row["traced_ms"] > 0 and row["built_ms"] > 0
    assert row["ratio"] == pytest.approx(row["traced_ms"] / row["built_ms"])
    # both steps run RoPE as `rope` ops (the traced one's recovered by a rule, docs/frontend.md), no elementwise op
    assert row["traced_ops"]["rope"] == row["built_ops"]["rope"] > 0 and "elementwise" not in row["traced_ops"]
    assert "tiny: block ops (built, traced) where they differ" in out.stdout
    bad = run("examples/bench_hf.py", "--preset", "nope")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --preset: unknown preset 'nope'"), bad.stderr
    bad = run("examples/bench_hf.py", "--dry-run", "--json", "/nonexistent/dir/r.json")  # before the run, not after
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "error: argument --json: cannot write /nonexistent/dir/r.json: no directory /nonexistent/dir", bad.stderr


def test_llama_example_json_on_the_simulator():
    out = run("examples/llama.py", "--preset", "tiny", "--random-weights", "--backend", "sim", "--max-len", "32",
              "--prompt-ids", "5", "6", "--max-new-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prompt_ids"] == [[5, 6]] and len(result["generated_ids"][0]) == 3
    assert result["stopped_at_eos"] == [False] and result["text"] is None and result["finished"] == [True]
    assert result["launches"] == result["steps"] == 3  # the prompt in one launch, then a launch a token
    # the speed, named for what it is: a launch's median time, tokens over the run's wall time, the first token's
    assert "ms_per_token" not in result and result["ms_per_step"] > 0 and result["generated_tokens"] == 3
    assert result["tokens_per_s"] == pytest.approx(3 / result["generation_s"])
    ttft = result["time_to_first_token_s"]
    assert len(ttft) == 1 and 0 < ttft[0] <= result["generation_s"]
    assert result["interrupted"] is False and result["error"] is None
    assert "tokens/s (3 tokens in" in out.stdout and "first token after" in out.stdout
    # the ids were streamed to stdout before the JSON line
    assert f"generated: {' '.join(map(str, result['generated_ids'][0]))}" in out.stdout.splitlines()


def test_tensor_parallel_example_gives_the_one_gpu_tokens_on_the_simulator():
    args = ("examples/llama.py", "--preset", "tiny", "--random-weights", "--backend", "sim", "--max-len", "32",
            "--prompt-ids", "5", "6", "--max-new-tokens", "3", "--json")
    one, two = run(*args), run(*args, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "tensor parallel over 2 simulated GPUs" in two.stderr
    tokens = [json.loads(o.stdout.strip().splitlines()[-1])["generated_ids"] for o in (one, two)]
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 3


def test_qwen3_example_runs_its_own_tiny_preset_by_default():
    out = run("examples/qwen3.py", "--random-weights", "--backend", "sim", "--prompt-ids", "3", "--max-new-tokens", "2",
              "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("qwen3: 2 layers, hidden 256") and "max_len 1024" in out.stderr
    assert len(json.loads(out.stdout.splitlines()[-1])["generated_ids"][0]) == 2


def test_qwen3_example_runs_a_moe_preset():
    out = run("examples/qwen3.py", "--random-weights", "--preset", "qwen3-moe-tiny", "--backend", "sim", "--max-len",
              "32", "--prompt-ids", "3", "9", "--max-new-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("qwen3: 2 layers, hidden 256")
    assert len(json.loads(out.stdout.splitlines()[-1])["generated_ids"][0]) == 3


def test_help_offers_the_examples_own_presets_and_says_the_defaults():
    help_text = run("examples/qwen3.py", "--help").stdout
    assert "{qwen3-tiny,qwen3-0.6b,qwen3-1.7b,qwen3-8b,qwen3-moe-tiny,qwen3-30b-a3b}" in help_text
    assert "llama" not in help_text
    words = " ".join(help_text.split())  # sampling works: the help says so, not "Greedy decoding of a ... model"
    assert "Greedy decoding of" not in words and "greedy decoding by default, or tokens sampled" in words
    assert "greedy only" not in words and "Ctrl-C" in words  # (Qwen3-MoE samples as the others do)
    for default in ("default: qwen3-tiny", "min(1024, the config's", "max_position_embeddings", "default: 1 2 3 4"):
        assert default in " ".join(help_text.split()), default


# --- a small checkpoint folder: defaults, tokenizer, streaming, EOS ------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A llama with max_position_embeddings 256, below the default cache length."""
    pytest.importorskip("transformers")
    return save_tiny(tmp_path_factory.mktemp("ckpt") / "llama", max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpt_tok(ckpt, tmp_path_factory):
    """The same with a word-level tokenizer (token i is the word "w{i}")."""
    path = Path(shutil.copytree(ckpt, tmp_path_factory.mktemp("ckpt_tok") / "llama"))
    save_word_tokenizer(path, 97)
    return path


def copy_of(ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path / "model"))


def last_json(out) -> dict:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_checkpoint_with_256_positions_runs_with_default_flags(ckpt):
    out = run("examples/llama.py", "--model", str(ckpt), "--backend", "sim", "--json")
    result = last_json(out)
    assert "max_len 256" in out.stderr  # min(1024, max_position_embeddings)
    assert result["prompt_ids"] == [[1, 2, 3, 4]] and len(result["generated_ids"][0]) == 16  # no EOS in this config
    assert f"generated: {' '.join(map(str, result['generated_ids'][0]))}" in out.stdout.splitlines()  # no tokenizer
    lines = out.stderr.splitlines()
    loaded = next(i for i, line in enumerate(lines) if "weights loaded" in line)
    compiled = next(i for i, line in enumerate(lines) if "compiled" in line)
    assert compiled > loaded + 1  # the compiler's log records (rewrite or cache hit) came through in between


def greedy_tokens(path: Path, prompt: list[int], n: int) -> list[int]:
    """The checkpoint's greedy continuation on the reference executor (the oracle the simulator matches)."""
    from megaegg.models import Generator, build_decode_graph, load_checkpoint, read_config, reference_step

    graph, spec = build_decode_graph(read_config(path), max_len=32)
    step = reference_step(graph, load_checkpoint(path, spec), spec.new_caches())
    return Generator(step, max_len=32).generate(prompt, n).tokens


@pytest.mark.parametrize("where, flags", [("generation_config.json", ()), ("config.json", ()),
                                          ("generation_config.json", ("--ignore-eos",))])
def test_prompt_text_streams_and_stops_at_the_checkpoints_eos(ckpt_tok, tmp_path, where, flags):
    model = copy_of(ckpt_tok, tmp_path)
    want = greedy_tokens(model, [5, 9, 2], 6)
    eos = want[2]
    if where == "config.json":  # no eos_token_id in generation_config.json: config.json's is used
        (model / "generation_config.json").unlink()
    cfg = json.loads((model / where).read_text())
    (model / where).write_text(json.dumps({**cfg, "eos_token_id": [96, eos] if where == "config.json" else eos}))
    out = run("examples/llama.py", "--model", str(model), "--backend", "sim", "--max-len", "32",
              "--prompt", "w5 w9 w2", "--max-new-tokens", "6", "--json", *flags)
    result = last_json(out)
    assert result["prompt_ids"] == [[5, 9, 2]]
    stops = not flags
    assert result["generated_ids"] == [want[: want.index(eos) + 1] if stops else want]
    assert result["stopped_at_eos"] == [stops] and (f"stopped at EOS {eos}" in out.stdout) is stops
    assert result["text"] == [" ".join(f"w{t}" for t in result["generated_ids"][0])]  # the tokenizer's text, streamed:
    assert f"generated: {result['text'][0]}" in out.stdout.splitlines()


# --- every bad input: one "error:" line naming it, a non-zero status, no traceback ------------------------
def assert_one_line_error(out, *needles: str) -> None:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == out.stderr.splitlines()[-1], out.stderr  # one line, the last
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def _truncate(model: Path) -> None:
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])


def _index_to_missing_shard(model: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        weight_map = {name: "model-00002-of-00002.safetensors" for name in f.keys()}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


BROKEN = {  # name: (how to break a copy of the checkpoint, what the error names)
    "truncated_safetensors": (_truncate, ["model/model.safetensors", "truncated"]),
    "empty_safetensors": (lambda m: (m / "model.safetensors").write_bytes(b""), ["model/model.safetensors"]),
    "malformed_config": (lambda m: (m / "config.json").write_text('{\n  "model_type": "llama",,\n}'),
                         ["model/config.json", "invalid JSON at line 2"]),
    "config_not_an_object": (lambda m: (m / "config.json").write_text("[1, 2]"),
                             ["model/config.json", "expected a JSON object, got list"]),
    "index_to_missing_shard": (_index_to_missing_shard,
                               ["model/model.safetensors.index.json", "'model-00002-of-00002.safetensors'"]),
    "corrupt_index": (lambda m: (m / "model.safetensors.index.json").write_bytes(b"\x89PNG\r\n"),
                      ["model/model.safetensors.index.json"]),
    "index_without_weight_map": (lambda m: (m / "model.safetensors.index.json").write_text('{"metadata": {}}'),
                                 ["model/model.safetensors.index.json", "'weight_map'"]),
    "malformed_generation_config": (lambda m: (m / "generation_config.json").write_text("{"),
                                    ["model/generation_config.json", "invalid JSON at line 1"]),
    "config_field_of_wrong_type": (lambda m: _set_config(m, num_key_value_heads="2"),  # was a TypeError
                                   ["model/config.json", "'num_key_value_heads' must be a positive int, got '2'"]),
    "config_bool_as_text": (lambda m: _set_config(m, tie_word_embeddings="false"),  # bool("false") is True
                            ["model/config.json", "'tie_word_embeddings' must be true or false, got 'false'"]),
}


def _set_config(model: Path, **fields) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_checkpoint_is_one_line_error(ckpt, tmp_path, name):
    model = copy_of(ckpt, tmp_path)
    breaks, needles = BROKEN[name]
    breaks(model)
    assert_one_line_error(run("examples/llama.py", "--model", str(model), "--backend", "sim"), *needles)


PRESET = ("examples/llama.py", "--random-weights", "--backend", "sim")


@pytest.mark.parametrize("args, needles", [
    ((*PRESET, "--prompt-ids", "7", "5000"), ["token id 5000", "vocab size 1024"]),
    ((*PRESET, "--prompt-ids", "-1"), ["token id -1", "vocab size 1024"]),
    ((*PRESET, "--max-new-tokens", "-5"), ["--max-new-tokens", ">= 1", "-5"]),
    ((*PRESET, "--max-new-tokens", "0"), ["--max-new-tokens", ">= 1"]),
    ((*PRESET, "--max-len", "0"), ["--max-len", ">= 1"]),
    ((*PRESET, "--max-len", "-3"), ["--max-len", ">= 1", "-3"]),
    ((*PRESET, "--max-len", "100000"), ["--max-len 100000", "max_position_embeddings (2048)"]),
    ((*PRESET, "--max-len", "8"), ["--max-new-tokens 16", "19 cache rows", "--max-len"]),
    ((*PRESET, "--prompt", "hello"), ["--prompt needs --model"]),
    (("examples/llama.py",), ["--model", "--random-weights"]),
    (("examples/qwen3.py", "--random-weights", "--preset", "tiny"), ["--preset", "'tiny'", "qwen3-tiny"]),
    ((*PRESET, "--tp", "3"), ["tp=3 does not divide"]),
    ((*PRESET, "--tp", "0"), ["--tp", ">= 1"]),
    ((*PRESET, "--tp", "2", "--temperature", "0.5"), ["--tp 2", "greedy"]),
    ((*PRESET, "--seed", str(2**40)), ["argument --seed", "must be in [-2147483648, 2147483647]"]),
], ids=["id_above_vocab", "negative_id", "negative_new_tokens", "zero_new_tokens", "zero_max_len",
        "negative_max_len", "max_len_above_positions", "cache_too_short", "prompt_without_tokenizer",
        "no_weights", "preset_of_other_arch", "tp_not_dividing_heads", "tp_zero", "tp_sampling", "seed_above_32_bits"])
def test_bad_argument_is_one_line_error(args, needles):
    assert_one_line_error(run(*args), *needles)


@pytest.mark.parametrize("prompt, needle", [("", "--prompt is empty"), ("   ", "tokenizes to no tokens")])
def test_empty_prompt_is_an_error_not_a_default(ckpt_tok, prompt, needle):
    assert_one_line_error(run("examples/llama.py", "--model", str(ckpt_tok), "--backend", "sim", "--prompt", prompt),
                          needle)


@pytest.mark.parametrize("case", ["no_such_dir", "max_len_above_positions", "other_arch"])
def test_model_argument_errors_name_it(ckpt, tmp_path, case):
    if case == "no_such_dir":
        args, needles = ["--model", str(tmp_path / "nowhere")], ["--model", "nowhere", "no such directory"]
    elif case == "max_len_above_positions":
        args, needles = ["--model", str(ckpt), "--max-len", "300"], ["--max-len 300", "max_position_embeddings (256)"]
    else:
        args, needles = ["--model", str(save_tiny(tmp_path / "qwen", "qwen3"))], ["runs llama models", "qwen3"]
    assert_one_line_error(run("examples/llama.py", "--backend", "sim", *args), *needles)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_backend_without_a_gpu_is_checked_first(ckpt, tmp_path):
    model = copy_of(ckpt, tmp_path)
    _truncate(model)  # the backend is checked before the checkpoint is read
    assert_one_line_error(run("examples/llama.py", "--model", str(model), "--backend", "cuda"),
                          "--backend cuda", "no CUDA GPU", "--backend sim")


# --- in-process pieces: the compile summary and the token stream ---------------------------------------
def test_compile_summary_copes_with_a_cache_hit():
    from megaegg.models.cli import compile_summary

    assert compile_summary({"cache_load": 0.05}) == "artifact cache hit, loaded in 0.05 s"
    assert compile_summary({"cache_load": 0.05, "nvrtc": 3.0}) == "artifact cache hit, loaded in 0.05 s, nvrtc 3.00 s"
    assert compile_summary({"rewrite": 1.5, "nvrtc": 0.2, "nvrtc_cached": 1.0}) == "rewrite 1.50 s, nvrtc 0.20 s cached"


class ByteTokenizer:
    """Token i is byte i of UTF-8; an incomplete character decodes to U+FFFD, as real BPE tokenizers do."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_prints_each_tokens_new_text_as_it_comes():
    from megaegg.models.cli import TokenPrinter

    out = io.StringIO()
    stream = TokenPrinter(ByteTokenizer(), out)
    seen = []
    for b in "hé!".encode():  # é is two bytes: nothing is printed for its first
        stream(b)
        seen.append(out.getvalue())
    stream.finish()
    assert seen == ["h", "h", "hé", "hé!"] and out.getvalue() == "hé!\n"
    ids = TokenPrinter(None, out := io.StringIO())
    for t in (5, 17):
        ids(t)
    ids.finish()
    assert out.getvalue() == "5 17\n"


def test_inspect_timings_table_names_every_stage():
    out = run("-m", "megaegg", "inspect", "--model", "tiny", "--layers", "7", "--timings")
    assert out.returncode == 0, out.stderr
    assert "7 identical blocks" in out.stdout
    for stage in ("graph", "rewrite", "  layers", "  alternatives", "  extract", "barriers+queue", "render", "total"):
        assert f"\n{stage} " in out.stdout, stage


# --- batches of prompts, sampling ------------------------------------------------------------------
def test_a_batch_of_prompts_from_a_file_runs_together(tmp_path):
    """Three prompts through the step graph: one launch prefills them all, then a launch a token for
    all three; each sequence's tokens are what the reference gives its prompt alone."""
    import dataclasses

    import megaegg as me
    from megaegg.models import Generator, ModelConfig, build_decode_graph, random_weights, reference_step

    prompts = [[5, 6], [1, 2, 3, 4, 5], [9]]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out = run("examples/llama.py", "--random-weights", "--backend", "sim", "--max-len", "32",
              "--prompt-ids-file", str(tmp_path / "p.json"), "--max-new-tokens", "3", "--json")
    result = last_json(out)
    assert result["prompt_ids"] == prompts and result["launches"] == 3
    want = random_greedy(prompts, 3, max_len=32)
    assert result["generated_ids"] == want
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("generated[")) == [
        f"generated[{i}]: {' '.join(map(str, t))}" for i, t in enumerate(want)]
    # a progress line a step on stderr (at most one a second; the first and the last always)
    steps = [line.strip() for line in out.stderr.splitlines() if line.strip().startswith("step ")]
    assert steps[0].startswith("step 1: 3 running, 0 waiting, 0 finished; 3 tokens, ")
    assert steps[-1].startswith("step 3: 0 running, 0 waiting, 3 finished; 9 tokens, ") and steps[-1].endswith(" tokens/s")
    assert result["ms_per_step"] > 0 and result["generated_tokens"] == 9 and len(result["time_to_first_token_s"]) == 3


def random_greedy(prompts: list[list[int]], n: int, max_len: int) -> list[list[int]]:
    """Each prompt's greedy continuation on the reference executor with the examples' random weights (tiny, f32)."""
    import dataclasses

    import megaegg as me
    from megaegg.models import Generator, ModelConfig, build_decode_graph, random_weights, reference_step

    graph, spec = build_decode_graph(dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32), max_len=max_len)
    weights = random_weights(spec, seed=0)  # the example's weights (the same names, shapes and seed)
    return [Generator(reference_step(graph, weights, spec.new_caches()), max_len=max_len).generate(p, n).tokens
            for p in prompts]


def test_sampling_flags_are_reproducible(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([[5, 6], [7]]))
    args = ["examples/llama.py", "--random-weights", "--backend", "sim", "--max-len", "16", "--prompt-ids-file",
            str(tmp_path / "p.json"), "--max-new-tokens", "4", "--temperature", "1.5", "--top-k", "200", "--json"]
    first, again, other = (last_json(run(*args, "--seed", s))["generated_ids"] for s in ("3", "3", "4"))
    assert first == again and first != other


@pytest.mark.parametrize("content, message", [
    (None, "--prompt-ids-file .*: no such file"),
    ("[[1, 2], [3", "--prompt-ids-file .*: not JSON"),
    ('[[1, 2], "3"]', "--prompt-ids-file .*: expected a non-empty JSON list of prompts"),
    ("[]", "--prompt-ids-file .*: expected a non-empty JSON list of prompts"),
    ("[[1], [5000]]", "--prompt-ids-file .*: prompt 1: token id 5000 .* is outside the vocabulary"),
])
def test_bad_prompt_files_are_one_line_errors(tmp_path, content, message):
    import re

    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    out = run("examples/llama.py", "--random-weights", "--backend", "sim", "--prompt-ids-file", str(path))
    assert_one_line_error(out)
    assert re.search(message, out.stderr.splitlines()[-1]), out.stderr


def test_a_text_prompt_file_needs_a_tokenizer(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    out = run("examples/llama.py", "--random-weights", "--backend", "sim", "--prompt-file", str(tmp_path / "p.txt"))
    assert_one_line_error(out, "--prompt-file needs --model DIR with a tokenizer")


@pytest.mark.parametrize("flag, value, message", [("--temperature", "-1", "must be >= 0"),
                                                  ("--top-p", "0", r"must be in \(0, 1\]"),
                                                  ("--top-k", "-3", r"must be in \[0, 2147483647\]"),
                                                  ("--top-k", "99999999999", r"must be in \[0, 2147483647\]")])
def test_bad_sampling_flags(flag, value, message):
    import re

    out = run("examples/llama.py", "--random-weights", "--backend", "sim", flag, value)
    assert_one_line_error(out)
    assert re.search(message, out.stderr), out.stderr


def test_text_prompts_from_a_file_with_the_checkpoints_tokenizer(ckpt_tok, tmp_path):
    (tmp_path / "p.txt").write_text("w5 w9 w2\n\nw7\n")  # (blank lines are skipped)
    out = run("examples/llama.py", "--model", str(ckpt_tok), "--backend", "sim", "--max-len", "32",
              "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "4", "--ignore-eos", "--json")
    result = last_json(out)
    assert result["prompt_ids"] == [[5, 9, 2], [7]]
    assert result["generated_ids"] == [greedy_tokens(ckpt_tok, p, 4) for p in ([5, 9, 2], [7])]
    assert result["text"] == [" ".join(f"w{t}" for t in ids) for ids in result["generated_ids"]]


# --- Ctrl-C, a failed step, a batch's sequences as they finish -------------------------------------------
def interrupt_when(args, ready, timeout=240):
    """Run ``args`` and send it SIGINT (Ctrl-C) as soon as ``ready(stdout, stderr)`` (the output so far) holds;
    (exit status, stdout, stderr). Fails if it ends or times out first."""
    import os
    import select
    import signal
    import time

    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    got, watched = {out: b"", err: b""}, {out, err}
    text = lambda fd: got[fd].decode(errors="replace")  # noqa: E731
    sent, deadline = False, time.monotonic() + timeout
    try:
        while watched and time.monotonic() < deadline:
            if not sent and ready(text(out), text(err)):
                proc.send_signal(signal.SIGINT)
                sent = True
            for fd in select.select(list(watched), [], [], 0.5)[0]:
                chunk = os.read(fd, 65536)
                got[fd] += chunk
                if not chunk:  # closed
                    watched.discard(fd)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sent, f"ended (or timed out) before it was ready: {text(err)[-2000:]}"
    return proc.returncode, text(out), text(err)


SIM = ("examples/llama.py", "--random-weights", "--backend", "sim")


def assert_interrupted(rc: int, stdout: str, stderr: str) -> dict:
    """Exit status 130, no traceback, one "interrupted: stopped after N steps" line last, the JSON line last on
    stdout with "interrupted": true and N launches."""
    assert rc == 130 and "Traceback" not in stderr, stderr
    result = json.loads(stdout.splitlines()[-1])
    steps = result["launches"]
    assert result["interrupted"] is True and result["error"] is None and steps >= 1
    assert stderr.splitlines()[-1] == f"interrupted: stopped after {steps} step{'s' if steps != 1 else ''}", stderr
    return result


def test_ctrl_c_while_generating_prints_what_came_and_exits_130():
    rc, stdout, stderr = interrupt_when(
        (*SIM, "--max-len", "256", "--prompt-ids", "5", "6", "--max-new-tokens", "200", "--json"),
        lambda out, err: __import__("re").search(r"generated: \d+", out))
    result = assert_interrupted(rc, stdout, stderr)
    ids = result["generated_ids"][0]
    assert 1 <= len(ids) < 200 and result["finished"] == [False] and result["generated_tokens"] == len(ids)
    assert ids == random_greedy([[5, 6]], len(ids), max_len=256)[0]  # the right tokens, cut short
    assert f"generated: {' '.join(map(str, ids))}" in stdout.splitlines()  # the streamed line, ended
    assert result["time_to_first_token_s"][0] > 0


def test_ctrl_c_stops_a_batch_with_each_sequences_tokens_so_far(tmp_path):
    prompts = [[5, 6], [1, 2, 3, 4, 5], [9]]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    rc, stdout, stderr = interrupt_when(
        (*SIM, "--max-len", "128", "--prompt-ids-file", str(tmp_path / "p.json"), "--max-new-tokens", "100", "--json"),
        lambda out, err: "step 1:" in err)  # the progress line of the first step: every sequence has a token
    result = assert_interrupted(rc, stdout, stderr)
    got = result["generated_ids"]
    assert all(1 <= len(t) < 100 for t in got) and result["finished"] == [False] * 3
    n = max(len(t) for t in got)
    want = random_greedy(prompts, n, max_len=128)
    assert got == [w[: len(t)] for w, t in zip(want, got)]
    assert sorted(line for line in stdout.splitlines() if line.startswith("generated[")) == [
        f"generated[{i}]: {' '.join(map(str, t))}" for i, t in enumerate(got)]


def test_ctrl_c_while_compiling_is_one_line_and_130():
    rc, stdout, stderr = interrupt_when((*SIM, "--max-len", "64", "--json"), lambda out, err: "building graphs" in err)
    assert rc == 130 and "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == "interrupted: stopped before the first step" and stdout == ""


POISON = """
import sys
import megaegg.models.cli as cli
token, argv = int(sys.argv[1]), sys.argv[2:]
draw = cli.random_weights
def poisoned(spec, **kw):  # the embedding row of ``token``: NaN logits at the step that feeds it
    w = draw(spec, **kw)
    w["model.embed_tokens.weight"][token] = float("nan")
    return w
cli.random_weights = poisoned
cli.main("llama", argv)
"""


@pytest.mark.parametrize("prompts", [[[5, 6]], [[5, 6], [9]]], ids=["one_prompt", "batch"])
def test_nan_logits_at_a_step_are_one_error_line_after_what_came(tmp_path, prompts):
    """The first token of prompt 0 has a NaN embedding row: step 2 feeds it, its logits are NaN, and the
    sampler refuses them. The run prints the tokens of step 1, then one line "error: step 2: ...", status 1."""
    first = random_greedy(prompts, 1, max_len=32)
    token = first[0][0]
    assert all(token not in p for p in prompts) and all(f[0] != token for f in first[1:])
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    out = run("-c", POISON, str(token), *SIM[1:], "--max-len", "32", "--prompt-ids-file", str(tmp_path / "p.json"),
              "--max-new-tokens", "5", "--json")
    assert_one_line_error(out, "error: step 2: ", "NaN")
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["generated_ids"] == first and result["error"] == out.stderr.splitlines()[-1][len("error: "):]
    assert result["interrupted"] is False and result["launches"] == 1


def test_a_batch_prints_each_sequence_when_it_finishes(ckpt_tok, tmp_path):
    """Prompt 1 stops at EOS after 2 tokens, prompt 0 runs 6: prompt 1's line comes first, as soon as it is done."""
    late, early = [11, 4], [5, 9, 2]
    eos = greedy_tokens(ckpt_tok, early, 6)[1]
    assert eos not in greedy_tokens(ckpt_tok, late, 6) and eos not in early + late
    model = copy_of(ckpt_tok, tmp_path)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    (tmp_path / "p.json").write_text(json.dumps([late, early]))
    out = run("examples/llama.py", "--model", str(model), "--backend", "sim", "--max-len", "32",
              "--prompt-ids-file", str(tmp_path / "p.json"), "--max-new-tokens", "6", "--json")
    result = last_json(out)
    lines = [line for line in out.stdout.splitlines() if line.startswith("generated[")]
    assert lines == [f"generated[1]: {result['text'][1]}", f"generated[0]: {result['text'][0]}"]
    assert [len(t) for t in result["generated_ids"]] == [6, 2] and result["stopped_at_eos"] == [False, True]
    assert result["finished"] == [True, True] and "stopped at EOS" in out.stdout
    ttft = result["time_to_first_token_s"]
    assert len(ttft) == 2 and all(0 < t <= result["generation_s"] for t in ttft)


# --- inspect: a preset or a checkpoint folder ---------------------------------------------------------------
def test_inspect_reads_a_checkpoint_folder(ckpt):
    out = run("-m", "megaegg", "inspect", "--model", str(ckpt), "--max-len", "64", "--context", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{ckpt}: ") and "barrier sets" in out.stdout


@pytest.mark.parametrize("case", ["no_such_folder", "bad_config", "a_file"])
def test_inspect_bad_model_is_one_line_error(ckpt, tmp_path, case):
    if case == "no_such_folder":
        model, needles = tmp_path / "nowhere", ["nowhere", "no such preset or checkpoint folder", "tiny"]
    elif case == "bad_config":
        model = copy_of(ckpt, tmp_path)
        (model / "config.json").write_text('{"model_type": "llama",,}')
        needles = ["model/config.json", "invalid JSON"]
    else:
        model = tmp_path / "file.txt"
        model.write_text("x")
        needles = ["file.txt", "not a folder"]
    assert_one_line_error(run("-m", "megaegg", "inspect", "--model", str(model)), *needles)


# --- the benches' flags: a flag given is used as given, or refused by name ------------------------------------
def bench_args(module: str, *args: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(module).parse(list(args))
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.mark.parametrize("args, want", [
    (("--dry-run", "--batch", "1,4", "--prefill", "8"),  # was batches 1 and 3, context 8, whatever was asked
     dict(preset="tiny", batch=[1, 4], prefill=[8], context=8, iters=2, warmup=0)),
    (("--dry-run", "--batch", "2,5", "--prefill", "6", "--context", "20", "--iters", "7", "--warmup", "3"),
     dict(batch=[2, 5], prefill=[6], context=20, iters=7, warmup=3)),
    (("--preset", "tiny", "--batch", "4", "--iters", "80", "--warmup", "9"),  # were cut to 50 and 5
     dict(batch=[4], prefill=[512, 2048], context=512, iters=80, warmup=9)),
    (("--dry-run", "--preset", "qwen3-tiny", "--bw-gib", "1", "--iters", "9"),  # were tiny and 0.25 GiB
     dict(preset="qwen3-tiny", bw_gib=1.0, iters=9, context=16, warmup=0, tp=1)),
    (("--dry-run",), dict(preset="tiny", context=16, iters=2, warmup=0, bw_gib=0.25, bw_reps=10, batch=None)),
])
def test_bench_decode_uses_the_flags_given(args, want):
    a = bench_args("bench_decode", *args)
    assert {k: getattr(a, k) for k in want} == want


@pytest.mark.parametrize("args, want", [
    (("--dry-run",), dict(preset="tiny", batch=[1, 3], prefill=[8], context=8, iters=2, warmup=0)),
    (("--dry-run", "--batch", "1,4", "--context", "30", "--iters", "4"), dict(batch=[1, 4], context=30, iters=4)),
    ((), dict(preset="llama-3.2-1b", batch=[1, 4, 16, 64], prefill=[512, 2048], context=512, iters=50, warmup=5)),
])
def test_bench_batch_uses_the_flags_given(args, want):
    a = bench_args("bench_batch", *args)
    assert {k: getattr(a, k) for k in want} == want


@pytest.mark.parametrize("script, args, error", [
    ("bench_decode", ("--dry-run", "--batch", "1", "--tp", "2"),
     "--tp is a flag of the batch-1 bench; --batch runs the batch bench (examples/bench_batch.py), which does not use it"),
    ("bench_decode", ("--preset", "tiny", "--prefill", "8", "--max-autotune"),
     "--max-autotune is a flag of the batch-1 bench; --prefill"),
    ("bench_decode", ("--dry-run", "--batch", "1", "--bw-gib", "1"), "--bw-gib is a flag of the batch-1 bench"),
    ("bench_decode", ("--dry-run", "--batch", "1", "--plain-attention", "gqa"),
     "--plain-attention is a flag of the batch-1"),
    ("bench_decode", ("--dry-run", "--tp-only"), "--tp-only needs --tp N with N >= 2"),
    ("bench_decode", ("--dry-run", "--prefill", "4096"), "--prefill 4096 is above tiny's max_position_embeddings (2048)"),
    ("bench_decode", ("--dry-run", "--batch", "2", "--context", "2048"), "--context 2048 must be below tiny's"),
    ("bench_batch", ("--dry-run", "--iters", "0"), "argument --iters: must be >= 1, got 0"),  # was an IndexError
    ("bench_batch", ("--dry-run", "--warmup", "-1"), "argument --warmup: must be >= 0, got -1"),
    ("bench_batch", ("--dry-run", "--context", "5000"), "--context 5000 must be below tiny's"),
])
def test_bench_flags_that_cannot_apply_are_one_line_errors(script, args, error):
    out = run(f"examples/{script}.py", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith(f"error: {error}"), out.stderr


def test_bench_decode_dry_run_times_the_batches_asked_for():
    out = run("examples/bench_decode.py", "--dry-run", "--batch", "2", "--prefill", "3", "--context", "5", "--iters", "1")
    assert out.returncode == 0, out.stderr
    rows = [line.split(" |")[0] for line in out.stdout.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert rows == ["| decode batch 2", "| prefill 3 tokens"], out.stdout  # (--dry-run alone: batches 1, 3; prefill 8)
    assert "decode at context 5" in out.stdout

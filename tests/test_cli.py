"""The command lines: inspect and the model examples, on the CPU (simulator)."""

import json
import subprocess
import sys
from pathlib import Path

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
    out = run("examples/llama.py", "--preset", "tiny", "--random-weights", "--max-len", "100000")
    assert out.returncode != 0 and "max_len 100000" in out.stderr and "Traceback" not in out.stderr
    out = run("examples/qwen3.py", "--preset", "tiny", "--random-weights")
    assert out.returncode != 0 and "runs qwen3 models" in out.stderr


def test_llama_example_json_on_the_simulator():
    out = run("examples/llama.py", "--preset", "tiny", "--random-weights", "--backend", "sim", "--max-len", "32",
              "--prompt-ids", "5", "6", "--max-new-tokens", "3", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prompt_ids"] == [5, 6] and len(result["generated_ids"]) == 3 and result["ms_per_token"] > 0

"""The OpenAI-compatible server (megaegg/serve.py) on the CPU simulator, through the official `openai` client:
greedy text equal to transformers' for each prompt, streamed and whole, concurrent clients, a client that
goes away, bad requests answered with one error naming the field. Every test is bounded in time; the
server stops at the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

from tiny_checkpoints import save_tiny  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool messages') }}{% endif %}"
                 "{{ m['content'] }} {% endfor %}")  # (refuses a role, as real templates do)
PROMPTS = ["w1 w2 w3", "w5", "w9 w8 w7 w6", "w40 w41", "w3 w3 w3", "w60", "w11 w12 w13 w14 w15", "w2 w90",
           "w70 w71 w72", "w33", "w17 w18", "w50 w51 w52 w53", "w88", "w4 w44 w4", "w95 w1", "w61 w62 w63 w64 w65 w66"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """``app`` served by uvicorn on a free local port (in a thread): yields its URL, stops it after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start in 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serve_tiny(tmp_path_factory, **engine_kw):
    """A tiny llama checkpoint with a word tokenizer (and a chat template), served on the simulator: yields
    what the tests use, stops the server after."""
    from transformers import AutoTokenizer

    from megaegg.models import load_checkpoint, read_config
    from megaegg.serve import build_engine, create_app

    path = save_tiny(tmp_path_factory.mktemp("ckpt"), "llama", seed=3, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    cfg = read_config(path)
    engine = build_engine(cfg, lambda spec: load_checkpoint(path, spec), backend="sim", device="cpu", max_len=48,
                          slots=4, max_tokens=48, max_queue=64, **engine_kw)
    app = create_app(engine, model="tiny-llama", tokenizer=tok, max_len=48)
    try:
        with running(app) as url:
            yield {"url": url, "path": path, "tok": tok, "engine": engine}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def served_paged(tmp_path_factory):
    """The same with a paged KV cache: 30 pages of 4 rows for 4 sequences of up to 48 rows."""
    yield from serve_tiny(tmp_path_factory, page_len=4, pages=30)


@pytest.fixture(scope="module")
def greedy(served):
    """transformers' greedy continuation (4 tokens) of each prompt, as text."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(served["path"]).float().eval()
    tok = served["tok"]
    out = {}
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        out[p] = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return out


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def client(served) -> "openai.OpenAI":
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="none", timeout=120, max_retries=0)


def test_completion_is_transformers_greedy_text(served, greedy):
    r = client(served).completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy[PROMPTS[0]]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 4)


def test_streamed_completion_and_token_id_prompt(served, greedy):
    c = client(served)
    chunks = list(c.completions.create(model="tiny-llama", prompt=PROMPTS[2], max_tokens=4, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == greedy[PROMPTS[2]]
    assert chunks[-1].choices[0].finish_reason == "length"
    ids = served["tok"].encode(PROMPTS[1])
    r = c.completions.create(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy[PROMPTS[1]]


def test_chat_completion_through_the_chat_template(served, greedy):
    c = client(served)
    msg = [{"role": "user", "content": PROMPTS[3]}]
    r = c.chat.completions.create(model="tiny-llama", messages=msg, max_tokens=4, temperature=0)
    want = served["tok"].apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(served["tok"].encode(want))
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].message.content.split()) == 4
    streamed = list(c.chat.completions.create(model="tiny-llama", messages=msg, max_tokens=4, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == r.choices[0].message.content
    # OpenAI's content parts: the text parts joined by newlines, the same prompt as the joined string
    words = PROMPTS[3].split()
    parts = [{"role": "user", "content": [{"type": "text", "text": words[0]}, {"type": "text", "text": " ".join(words[1:])}]}]
    joined = [{"role": "user", "content": words[0] + "\n" + " ".join(words[1:])}]
    got = c.chat.completions.create(model="tiny-llama", messages=parts, max_tokens=4, temperature=0)
    want = c.chat.completions.create(model="tiny-llama", messages=joined, max_tokens=4, temperature=0)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens and got.choices[0].message.content == want.choices[0].message.content


def test_sixteen_concurrent_streaming_clients_each_get_their_greedy_text(served, greedy):
    """16 clients at once on 4 sequence slots: the rest queue, join as slots free up, and each stream is
    transformers' greedy text for its own prompt."""
    def one(p):
        chunks = client(served).completions.create(model="tiny-llama", prompt=p, max_tokens=4, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == [greedy[p] for p in PROMPTS]


def test_stop_string_and_stop_token(served, greedy):
    c = client(served)
    first, second = greedy[PROMPTS[0]].split()[:2]
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=4, temperature=0, stop=[" " + second])
    assert r.choices[0].text == first and r.choices[0].finish_reason == "stop"
    stop_id = served["tok"].convert_tokens_to_ids(first)
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                             extra_body={"stop": [stop_id]})
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fixture", ["served", "served_process"])
def test_a_client_that_goes_away_leaves_the_others_intact(fixture, request, greedy):
    """A streaming client hangs up after its first chunk: another request gets its greedy text, the abandoned
    sequence's slot comes back and its stream leaves the engine's table (the engine in this process, and in a
    process of its own)."""
    served = request.getfixturevalue(fixture)
    url = served["url"]
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/completions", json={"model": "tiny-llama", "prompt": PROMPTS[4],
                                                              "max_tokens": 40, "temperature": 0, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break  # one chunk, then hang up
    r = client(served).completions.create(model="tiny-llama", prompt=PROMPTS[5], max_tokens=4, temperature=0)
    assert r.choices[0].text == greedy[PROMPTS[5]]
    deadline = time.time() + 30
    while _metric(url, "megaegg_running") or served["engine"].streams:
        assert time.time() < deadline, "the abandoned request still runs"
        time.sleep(0.1)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "w1"}, 404, "model"),
    ({"model": "tiny-llama", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "w1", "max_tokens": "four"}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": " ".join(["w1"] * 49)}, 400, "prompt"),
    ({"model": "tiny-llama", "prompt": "w1", "max_tokens": 49}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": [1, 2, 500]}, 400, "prompt"),
    ({"model": "tiny-llama", "prompt": 7}, 400, "prompt"),
    ({"model": "tiny-llama", "prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny-llama", "prompt": "w1", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny-llama", "prompt": "w1", "n": 2}, 400, "n"),
    ({"model": "tiny-llama", "prompt": "w1", "bogus": 1}, 400, "bogus"),
    ({"model": "tiny-llama", "prompt": "w1", "stop": [1.5]}, 400, "stop"),
    ({"model": "tiny-llama", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny-llama", "prompt": "w1", "logprobs": 1}, 400, "logprobs"),
    ({"model": "tiny-llama", "prompt": "w1", "echo": True}, 400, "echo"),
    ({"model": "tiny-llama", "prompt": "w1", "best_of": 0}, 400, "best_of"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": "w1"}], "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny-llama", "messages": [{"role": "tool", "content": "w1"}]}, 400, "messages"),  # (the template's refusal)
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": []}]}, 400, "messages"),
    ({"model": "tiny-llama", "messages": [{"role": "user", "content": None}]}, 400, "messages"),
])
def test_bad_requests_get_one_error_naming_the_field(served, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(served["url"] + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "\n" not in err["message"]


def test_a_body_that_is_not_json_is_a_400(served):
    r = httpx.post(served["url"] + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_health_models_and_metrics(served):
    assert httpx.get(served["url"] + "/health", timeout=30).json() == {"status": "ok"}
    assert [m.id for m in client(served).models.list().data] == ["tiny-llama"]
    text = httpx.get(served["url"] + "/metrics", timeout=30).text
    for name in ("megaegg_requests_total", "megaegg_queue_depth", "megaegg_running", "megaegg_generated_tokens_total",
                 "megaegg_time_to_first_token_seconds_bucket", "megaegg_inter_token_latency_seconds_count"):
        assert name in text
    assert json.loads(json.dumps(text))  # (plain text)


@pytest.mark.parametrize("args, message", [
    ([], "give --model DIR or --random-weights"),
    (["--model", "/no/such/folder"], "--model /no/such/folder: no such directory"),
    (["--random-weights", "--preset", "nope"], "invalid choice"),
    (["--random-weights", "--port", "0"], "--port"),
    (["--random-weights", "--pages", "8"], "--pages goes with --page-len"),
    (["--random-weights", "--page-len", "16", "--pages", "2", "--max-len", "64"], "hold fewer than one sequence's --max-len 64"),
])
def test_serve_flags_are_checked_in_one_line(args, message):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "megaegg", "serve", *args], capture_output=True, text=True, timeout=120,
                       cwd=root)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_failed_launch_ends_its_requests_with_an_error_and_the_loop_goes_on():
    """The engine alone, over a step function that raises once: the request in that launch gets the error,
    the next one its tokens."""
    import asyncio

    from megaegg.models.batch import Batcher, Sampling
    from megaegg.serve import Engine, RequestError, Stream

    calls = []

    def step(rows):
        calls.append(rows)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return torch.full((rows.out.numel(),), 7, dtype=torch.int32)

    engine = Engine(Batcher(step, slots=2, max_len=16), max_queue=4, vocab=10)

    async def run(prompt):
        s = Stream(asyncio.get_running_loop(), asyncio.Queue())
        engine.submit(prompt, 3, Sampling(), [], s)
        out = []
        while True:
            item = await asyncio.wait_for(s.queue.get(), timeout=30)
            if item is None or isinstance(item, Exception):
                return out, item
            out.append(item)

    try:
        tokens, end = asyncio.run(run([1, 2]))
        assert tokens == [] and isinstance(end, RequestError) and "device lost" in str(end) and end.status == 500
        assert asyncio.run(run([3])) == ([7, 7, 7], None)
        assert engine.failed_launches == 1
    finally:
        engine.close()


def test_a_preempted_sequence_does_not_count_toward_the_queue_limit():
    """The engine alone over a paged batcher (a step function with no model): of two sequences of 12 rows in
    a pool of 4 pages of 4, the second is preempted and waits to resume. With --max-queue 1 a new request is
    still accepted (the preempted one was accepted already: only requests not started count), the next one
    gets 429; every request then gets its tokens, each once, the preempted one those of a run with no
    preemption."""
    from megaegg.models.batch import Batcher, Request, Sampling
    from megaegg.models.pages import PagePool
    from megaegg.serve import Engine, RequestError, Stream

    hold, parked, gate = threading.Event(), threading.Event(), threading.Event()

    def step(rows):  # (each next token from its row's token and position)
        if hold.is_set():
            parked.set()
            assert gate.wait(30)
        tok, pos = rows.token.tolist(), rows.host_pos
        return torch.tensor([(tok[i] * 31 + pos[i] * 7 + 3) % 97 for i in rows.out.tolist()], dtype=torch.int32)

    class Now:  # (an event loop that runs a callback at once)
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    class Sink(Stream):  # (a stream whose queue is a list)
        def __init__(self):
            self.items = []
            super().__init__(loop=Now(), queue=SimpleNamespace(put_nowait=self.items.append))

    prompts = [[1, 2, 3], [9, 10, 11]]
    reqs = [Request(p, 10) for p in prompts] + [Request([5], 2)]
    want = [g.tokens for g in Batcher(step, slots=2, max_len=32).run(reqs)]  # (no pages: no preemption)
    streamed = [[], []]
    b = Batcher(step, slots=2, max_len=32, max_tokens=16, pages=PagePool(4, 4, 8, prefix_cache=False))
    for p, out in zip(prompts, streamed):
        b.submit(Request(p, 10, on_token=out.append))
    while not b.preemptions:
        b.step()
    assert (len(b.running), len(b.waiting), b.queued) == (1, 1, 0)
    hold.set()
    engine = Engine(b, max_queue=1, vocab=97)
    try:
        assert parked.wait(30)  # the engine is in a launch; the preempted sequence waits (no pages for it yet)
        assert len(b.waiting) == 1
        accepted = Sink()
        engine.submit([5], 2, Sampling(), [], accepted)
        with pytest.raises(RequestError) as refused:
            engine.submit([6], 2, Sampling(), [], Sink())
        assert refused.value.status == 429
        hold.clear()
        gate.set()
        deadline = time.time() + 30
        while b.busy() or engine.inbox or accepted.items[-1:] != [None]:
            assert time.time() < deadline, "the requests did not finish"
            time.sleep(0.01)
        assert streamed == want[:2] and accepted.items == want[2] + [None]
        assert b.preemptions == 1 and b.queued == 0
    finally:
        gate.set()
        engine.close()


def test_streamed_chunks_carry_each_token_id(served):
    c = client(served)
    whole = c.completions.create(model="tiny-llama", prompt=PROMPTS[6], max_tokens=4, temperature=0)
    chunks = list(c.completions.create(model="tiny-llama", prompt=PROMPTS[6], max_tokens=4, temperature=0, stream=True))
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == whole.choices[0].token_ids
    assert len(whole.choices[0].token_ids) == 4


def test_bench_serve_dry_run_loses_nothing(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, "examples/bench_serve.py", "--dry-run", "--requests", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert (report["completed"], report["lost_or_corrupted"]) == (4, 0) and report["output_tokens_per_s"] > 0
    # the engine's launches after the clients' warm-up requests only: the workload's prompt rows, and each
    # launch in the log no sooner than the start (the clients start together, warm)
    e = report["engine"]
    assert e["prefill_rows"] == sum(n for _, _, _, n in e["launch_log"]) and e["prefill_rows"] >= 4 * 2
    assert all(t >= 0 for t, _, _, _ in e["launch_log"])


@pytest.mark.parametrize("paged", [False, True])
def test_a_qwen3_moe_checkpoint_is_served_in_batches(tmp_path, paged):
    """Qwen3-MoE is batched as a dense model is (the step graph routes every row: moe_route, moe_experts): four
    concurrent streaming clients each get transformers' greedy text, from launches that hold several sequences'
    rows and prompts of several tokens; a sampled request with a seed gives the same tokens twice; with slot
    caches a prompt sharing an earlier one's prefix reuses its rows (with a paged cache, its pages)."""
    import transformers

    from megaegg.models import load_checkpoint, read_config
    from megaegg.serve import build_engine, create_app

    path = save_tiny(tmp_path / "moe", "qwen3_moe", seed=4, tokenizer=True)
    cfg = read_config(path)
    assert cfg.moe is not None
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    prompts = ["w1 w2 w3", "w9 w8", "w40 w41 w42 w43", "w7 w7 w60 w61 w62"]
    want = {}
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        want[p] = tok.decode(out[0, ids.shape[1]:])
    pages = dict(page_len=4, pages=32) if paged else {}
    engine = build_engine(cfg, lambda spec: load_checkpoint(path, spec), backend="sim", device="cpu", max_len=32,
                          slots=4, max_tokens=32, max_queue=16, **pages)
    try:
        with running(create_app(engine, model="tiny-moe", tokenizer=tok, max_len=32)) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="-", timeout=120)

            def stream(p):
                chunks = c.completions.create(model="tiny-moe", prompt=p, max_tokens=4, temperature=0, stream=True)
                return "".join(ch.choices[0].text for ch in chunks)

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = dict(zip(prompts, pool.map(stream, prompts)))
            assert got == want
            assert max(engine.batcher.launch_rows) > 1  # (prompts of several tokens, sequences together)
            assert engine.batcher.launches < sum(len(tok(p).input_ids) + 3 for p in prompts)
            sampled = [c.completions.create(model="tiny-moe", prompt=prompts[0], max_tokens=4, temperature=0.9,
                                            seed=7).choices[0].token_ids for _ in range(2)]
            assert sampled[0] == sampled[1] and len(sampled[0]) == 4
            if paged:
                return

            def hits():
                text = httpx.get(url + "/metrics", timeout=30).text
                return float(next(ln.split()[1] for ln in text.splitlines()
                                  if ln.startswith("megaegg_prefix_cache_hit_tokens_total")))

            before = hits()
            shared = prompts[0] + " w5 w6"
            whole = c.completions.create(model="tiny-moe", prompt=shared, max_tokens=3, temperature=0)
            ids = tok(shared, return_tensors="pt").input_ids
            ref = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert whole.choices[0].token_ids == ref
            assert hits() - before >= 3  # (the last request's prompt was this one's first words)
    finally:
        engine.close()


def test_a_shared_prompt_prefix_is_prefilled_once_per_slot(served, greedy):
    """Two requests one after the other with the same system prefix: the second prefills only its own
    tokens (the metric counts the reused ones), and its text is transformers' greedy text still."""
    import re

    def hits():
        text = httpx.get(served["url"] + "/metrics", timeout=30).text
        return int(re.search(r"^megaegg_prefix_cache_hit_tokens_total (\d+)$", text, re.M).group(1))

    c = client(served)
    system = "w21 w22 w23 w24 w25 w26"
    c.completions.create(model="tiny-llama", prompt=system + " w30", max_tokens=2, temperature=0)
    before = hits()
    r = c.completions.create(model="tiny-llama", prompt=system + " " + PROMPTS[0], max_tokens=4, temperature=0)
    assert hits() - before >= 6  # the six system tokens at least
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(served["path"]).float().eval()
    ids = torch.tensor([served["tok"].encode(system + " " + PROMPTS[0])])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert r.choices[0].token_ids == want


def test_sigterm_lets_a_started_stream_end_cleanly(tmp_path):
    """`python -m megaegg serve` in a process group of its own (its engine's process in it too): SIGTERM to
    the whole group while a response streams, as a service manager sends it; the stream still ends with all
    its tokens and [DONE] (the engine process ignores it and finishes), both processes exit, without a
    traceback."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megaegg", "serve", "--random-weights", "--backend", "reference",
                             "--port", str(port), "--max-len", "64", "--slots", "2"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        lines = []
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) == 2:
                        os.killpg(proc.pid, signal.SIGTERM)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        tokens = [t for line in lines[:-1] for t in json.loads(line[5:])["choices"][0]["token_ids"]]
        assert len(tokens) == 40
        # (uvicorn shuts down gracefully, then re-raises the signal: the exit status says SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()
        deadline = time.time() + 30  # (the engine's process went too: nothing is left in the group)
        while True:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.time() < deadline, "the engine process outlived the server"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_paged_server_gives_each_client_its_greedy_text_and_shares_prefix_pages(served_paged, served, greedy):
    """The paged KV cache behind the server: 16 concurrent streams each get transformers' greedy text; then
    requests sharing a 12-token prefix (three whole pages) read it from the first one's pages (the prefix
    metric counts them) and still give the greedy text."""
    import re

    def one(p):
        chunks = client(served_paged).completions.create(model="tiny-llama", prompt=p, max_tokens=4, temperature=0,
                                                         stream=True)
        return "".join(ch.choices[0].text for ch in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(one, PROMPTS)) == [greedy[p] for p in PROMPTS]

    def hits():
        text = httpx.get(served_paged["url"] + "/metrics", timeout=30).text
        return int(re.search(r"^megaegg_prefix_cache_hit_tokens_total (\d+)$", text, re.M).group(1))

    c = client(served_paged)
    system = " ".join(f"w{i}" for i in range(20, 32))  # 12 tokens (with BOS 13): three whole pages of 4
    c.completions.create(model="tiny-llama", prompt=system + " w40", max_tokens=2, temperature=0)
    before = hits()
    r = c.completions.create(model="tiny-llama", prompt=system + " " + PROMPTS[0], max_tokens=4, temperature=0)
    assert hits() - before >= 12
    want = client(served).completions.create(model="tiny-llama", prompt=system + " " + PROMPTS[0], max_tokens=4,
                                             temperature=0)
    assert r.choices[0].text == want.choices[0].text


def test_a_launchs_tokens_reach_the_event_loop_in_one_wake_up():
    """The engine alone (a step function with no model): three sequences' tokens of a launch are handed to
    their event loop in one call, in order, before the ends of the streams they finish, and only once the
    next launch is queued (the event loop's work on them runs while that launch does)."""
    from megaegg.models.batch import Batcher, QueuedTokens, Sampling
    from megaegg.serve import Engine, Stream

    seen = []  # (wake-ups when a launch is queued, wake-ups when its tokens are waited for)

    def step(rows):
        queued = loop.calls
        tokens = torch.tensor([(t * 7 + 1) % 10 for t in rows.token[rows.out].tolist()], dtype=torch.int32)

        def get():
            seen.append((queued, loop.calls))
            return tokens

        return QueuedTokens(get)

    class Loop:  # (runs a callback at once, counting the wake-ups)
        calls = 0

        def call_soon_threadsafe(self, fn, *args):
            self.calls += 1
            fn(*args)

    loop, items = Loop(), [[], [], []]
    batcher = Batcher(step, slots=3, max_len=16)
    engine = Engine(batcher, max_queue=8, vocab=10)
    try:
        with engine.cond:  # (all three in the engine's inbox before its next launch)
            for out, prompt in zip(items, ([1, 2], [3], [4, 5, 6])):
                engine.submit(prompt, 3, Sampling(), [], Stream(loop, SimpleNamespace(put_nowait=out.append)))
        deadline = time.time() + 30
        while any(out[-1:] != [None] for out in items):
            assert time.time() < deadline, "the requests did not finish"
            time.sleep(0.01)
    finally:
        engine.close()
    assert [out[:-1] for out in items] == [[5, 6, 3], [2, 5, 6], [3, 2, 5]]
    # a wake-up a launch, behind the next launch; the streams' ends with the last launch's tokens
    assert batcher.launches == 3 and loop.calls == 3 and seen == [(0, 0), (0, 1), (1, 2)]


def test_the_tokens_queued_behind_one_come_together_up_to_the_end_or_an_error():
    """The HTTP side reads a stream's items a batch at a time: the first awaited, then those already queued, up
    to the end (None) or an error, so a stream whose event loop fell behind sends one chunk for several tokens."""
    from megaegg.serve import RequestError, _items, _token

    async def batches(items):
        queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        out = []
        while not queue.empty():
            out.append(await _items(SimpleNamespace(queue=queue)))
        return out

    error = RequestError("the launch failed", status=500)
    assert asyncio.run(batches([5, 6, None, 7])) == [[5, 6, None], [7]]
    assert asyncio.run(batches([5, error, 6])) == [[5, error], [6]]
    assert _token(5) == 5 and _token(None) is None
    with pytest.raises(RequestError, match="the launch failed"):
        _token(error)


def _byte_bpe_tokenizer():
    """A byte-level BPE tokenizer (as llama-3's and qwen3's) trained on text with multi-byte characters, so
    single tokens end inside a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = ["héllo wörld ünïcode ✓ 日本語のテキスト emoji 🎉🎉 and plain words", "the quick brown fox — jumps",
            "Hi . x , y ! z ? don ' t"] * 20
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # (clean-up of spaces before punctuation on, as llama-3's config has it: the server's text does without)
    return PreTrainedTokenizerFast(tokenizer_object=t, clean_up_tokenization_spaces=True)


def test_streamed_text_grows_incrementally_to_the_whole_decode():
    """A streamed answer's pieces (text after each token, then the final text) add up to one whole decode of
    its tokens, never hold half a character, and a stop string cuts where a whole decode finds it first:
    checked against whole decodes (no clean-up of spaces) on random token sequences of a byte-level BPE
    tokenizer."""
    import random

    from megaegg.models.batch import Sampling
    from megaegg.serve import Parsed, _Generation

    tok = _byte_bpe_tokenizer()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # noqa: E731
    rng = random.Random(7)
    stops = [2, 5]
    for trial in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        stop_text = [rng.choice(["🎉", "ö", "the", "xyz", "本語", ". x", "t"])] if trial % 2 else []
        p = Parsed([1], len(ids), Sampling(), stops, stop_text, True, False)
        gen, sent = _Generation(p, tok), ""
        for k, t in enumerate(ids):
            gen.take(t)
            piece = gen.text(final=False)
            whole = decode([i for i in ids[:k + 1] if i not in stops])
            assert piece.startswith(sent) and whole.startswith(piece), (ids[:k + 1], sent, piece, whole)
            sent = piece
            if gen.done:
                break
        gen.take(None)
        final = gen.text(final=True)
        taken = [i for i in gen.tokens if i not in stops]
        whole = decode(taken)
        firsts = [whole.find(s) for s in stop_text if whole.find(s) >= 0]
        assert final == (whole[:min(firsts)] if firsts else whole), (ids, stop_text)
        if firsts:  # it stopped at the first token whose text holds a stop string
            before = decode(taken[:-1])
            assert not any(s in before for s in stop_text), (ids, stop_text)
        assert final.startswith(sent)


# --- the engine in a process of its own (megaegg/engine_process.py: what `python -m megaegg serve` runs) ---

@pytest.fixture(scope="module")
def served_process(served):
    """The tiny checkpoint of ``served`` behind an EngineProcess (the simulator in a process of its own)."""
    from megaegg.engine_process import EngineProcess, EngineSpec
    from megaegg.models import read_config
    from megaegg.serve import create_app

    path = served["path"]
    engine = EngineProcess(EngineSpec(read_config(path), "sim", "cpu", 48, 4, 48, checkpoint=str(path)), max_queue=64)
    app = create_app(engine, model="tiny-llama", tokenizer=served["tok"], max_len=48)
    try:
        with running(app) as url:
            yield {"url": url, "tok": served["tok"], "engine": engine}
    finally:
        engine.close()
    assert not engine.process.is_alive()


def test_the_engine_process_gives_concurrent_streams_their_greedy_text(served_process, greedy):
    """16 streaming clients and one whole completion with a stop string, the engine in its own process: each
    gets transformers' greedy text; the engine's metrics come through /metrics."""
    def one(p):
        chunks = client(served_process).completions.create(model="tiny-llama", prompt=p, max_tokens=4, temperature=0,
                                                           stream=True)
        return "".join(ch.choices[0].text for ch in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == [greedy[p] for p in PROMPTS]
    first, second = greedy[PROMPTS[0]].split()[:2]
    r = client(served_process).completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                                  stop=[" " + second])
    assert r.choices[0].text == first and r.choices[0].finish_reason == "stop"
    assert _metric(served_process["url"], "megaegg_requests_total") >= len(PROMPTS) + 1
    assert _metric(served_process["url"], "megaegg_generated_tokens_total") >= 4 * len(PROMPTS)


def test_a_call_that_cannot_cross_fails_its_caller_not_the_engine(served_process):
    """EngineProcess.call: a function that does not pickle fails here, a result that does not pickle fails
    in the engine process and comes back as the caller's error; the engine goes on."""
    import operator

    engine = served_process["engine"]
    with pytest.raises(Exception):
        engine.call(lambda e: e.vocab)
    with pytest.raises(Exception, match="(?i)pickle"):
        engine.call(getattr, "cond")  # (a threading.Condition)
    assert engine.call(operator.attrgetter("vocab")) == engine.vocab
    r = client(served_process).completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=2, temperature=0)
    assert len(r.choices[0].token_ids) == 2 and not engine.closed


def _reference_engine_spec(**kw):
    import dataclasses

    import megaegg as me
    from megaegg.engine_process import EngineSpec
    from megaegg.models import ModelConfig

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    return EngineSpec(cfg, "reference", "cpu", 256, 1, 256, **kw)


def test_the_engine_process_refuses_past_its_queue_and_ends_streams_when_it_dies():
    """One slot, --max-queue 1: a request runs, a second waits, a third is refused (429) at once. Then the
    engine process is killed: both streams end with a 503 naming it, /health answers 503, a new request too."""
    from fastapi.testclient import TestClient

    from megaegg.engine_process import EngineProcess
    from megaegg.models.batch import Sampling
    from megaegg.serve import RequestError, Stream, create_app

    engine = EngineProcess(_reference_engine_spec(), max_queue=1)
    try:
        async def run():
            loop = asyncio.get_running_loop()
            running, waiting = (Stream(loop, asyncio.Queue()) for _ in range(2))
            engine.submit([1, 2, 3], 250, Sampling(), [], running)
            assert isinstance(await asyncio.wait_for(running.queue.get(), 60), int)  # (it runs)
            engine.submit([4, 5], 4, Sampling(), [], waiting)
            with pytest.raises(RequestError) as refused:
                engine.submit([6], 4, Sampling(), [], Stream(loop, asyncio.Queue()))
            assert refused.value.status == 429
            engine.process.kill()
            ends = []
            for s in (running, waiting):
                while isinstance(item := await asyncio.wait_for(s.queue.get(), 60), int):
                    pass
                ends.append(item)
            return ends

        for end in asyncio.run(run()):
            assert isinstance(end, RequestError) and end.status == 503 and "engine process exited" in str(end)
        assert engine.dead and engine.closed
        with TestClient(create_app(engine, model="tiny", max_len=256)) as http:
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
    finally:
        engine.close()


def test_an_engine_process_that_cannot_build_says_why():
    from megaegg.engine_process import EngineProcess
    from megaegg.graph import GraphError

    with pytest.raises(GraphError, match="no-such-checkpoint"):
        EngineProcess(_reference_engine_spec(checkpoint="/tmp/no-such-checkpoint"))

"""An OpenAI-compatible HTTP server over the continuous batcher: ``python -m megaegg serve``.

    python -m megaegg serve --model DIR                      # a checkpoint (its tokenizer, if saved beside it)
    python -m megaegg serve --random-weights --preset tiny   # the simulator when there is no GPU

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (whole or streamed as server-sent events;
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` as strings or token ids,
``usage``; prompts as text or token ids), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text).
One engine thread owns the :class:`~megaegg.models.batch.Batcher` (the server runs it in a process of its own,
``megaegg.engine_process``, so the HTTP side's Python does not wait for its lock): requests join and leave the running
batch between launches, a prompt prefills in chunks of the step's token budget beside the decoding
sequences, and a client that disconnects frees its sequence before the next launch. A full queue
(``--max-queue`` requests not started yet; preempted sequences waiting to resume do not count) answers
429; a bad request 400 with an OpenAI-style error naming the field; a failed launch ends the requests it
carried with an error and the loop goes on.

Prefix caching by slot: a finished sequence's slot keeps its K/V rows, and a new request goes to the
free slot sharing the longest prefix with its prompt, prefilling only the rest (a repeated system
prompt is prefilled once per slot). With ``--page-len`` the caches are a pool of ``--pages`` pages
(``megaegg.models.pages``): a sequence holds the pages its rows need, so memory follows the tokens in use,
and prompts share the whole pages of a prefix that any sequence wrote, running or finished.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .graph import GraphError
from .models.batch import (
    Batcher, Request, Sampling, kernel_batch_step, lone_decode_kernel, reference_batch_step, single_sequence_decode,
)
from .models.pages import PagePool

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400, 404, 429, 503), the field it names (``param``)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


# --- the engine: one thread, one batcher ------------------------------------------------------------------
@dataclass
class Stream:
    """One request's tokens as the engine produces them, for the HTTP side (an asyncio queue fed from the
    engine thread). ``None`` ends it; an ``Exception`` ends it with an error."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = -1
    submitted: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _deliver(items: list[tuple[Stream, Any]]) -> None:
    """(event loop) A launch's tokens into their streams' queues."""
    for s, item in items:
        s.queue.put_nowait(item)


class Histogram:
    def __init__(self, buckets) -> None:
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum, self.n = self.sum + v, self.n + 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def text(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum}", f"{name}_count {self.n}"]


class Engine:
    """Runs a :class:`Batcher` in its own thread; :meth:`submit` a request, :meth:`cancel` one, :meth:`close`.

    Only the engine thread touches the batcher: submissions and cancellations wait in small lists (the
    HTTP side never blocks on a launch) and are applied between launches."""

    def __init__(self, batcher: Batcher, *, max_queue: int = 256, vocab: int, decode_kernel=None, caches=None) -> None:
        self.batcher, self.max_queue, self.vocab = batcher, max_queue, vocab
        # the batch-1 decode graph's kernel a lone sequence runs (if any), and the caches of slots it runs on
        self.decode_kernel, self.caches = decode_kernel, caches
        self.streams: dict[int, Stream] = {}  # (engine thread)
        self.inbox: list[tuple[Request, Stream]] = []
        self.cancels: list[Stream] = []
        self.cond = threading.Condition()
        self.closed = False
        self.requests_total = self.tokens_total = self.failed_launches = 0
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.outbox: list[tuple[Stream, int]] = []  # (engine thread) a launch's tokens, handed over at once
        self.thread = threading.Thread(target=self._loop, name="megaegg-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: list[int], max_tokens: int, sampling: Sampling, stop_ids: list[int], stream: Stream) -> None:
        request = Request(prompt, max_tokens, tuple(stop_ids), sampling, on_token=lambda t, s=stream: self._token(s, t))
        with self.cond:
            if self.closed:
                raise RequestError("the server is shutting down", status=503, kind="server_error")
            # (requests not started yet: a preempted sequence waiting to resume was accepted already)
            if len(self.inbox) + self.batcher.queued >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting): retry later", status=429,
                                   kind="rate_limit_error")
            self.inbox.append((request, stream))
            self.requests_total += 1
            self.cond.notify()

    def cancel(self, stream: Stream) -> None:
        """Free the request's sequence before the next launch (its client went away, or a stop string ended it)."""
        with self.cond:
            self.cancels.append(stream)
            self.cond.notify()

    def close(self) -> None:
        """Stop the loop after the launch in flight; every request not finished ends with an error."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=60)

    # (engine thread)
    def _token(self, s: Stream, tok: int) -> None:
        now = time.perf_counter()
        (self.ttft if s.last is None else self.itl).observe(now - (s.submitted if s.last is None else s.last))
        s.last = now
        self.tokens_total += 1
        self.outbox.append((s, tok))

    def _flush(self) -> None:
        """Hand a launch's tokens (and the ends of the streams it finished) over in one :meth:`deliver` call.
        Called once the next launch is queued (``Batcher.step``'s ``launched``), or when none follows: the
        event loop's work on them (tens of us a token) then runs while the device does, and it does not hold
        the interpreter lock that the next launch's host work needs (every torch call lets it in: measured
        on an H200, a 64-row decode launch went from ~3 to ~7 ms with the tokens handed over first)."""
        items, self.outbox = self.outbox, []
        self.deliver(items)  # (an empty hand-over too: the engine process reports its queue with it)

    @staticmethod
    def deliver(items: list[tuple[Stream, Any]]) -> None:
        """A launch's stream items to their event loops, one wake-up a loop (a wake-up a token: one system
        call and one loop iteration each, 64 a launch at 64 sequences). The engine process's streams
        replace it (``megaegg.engine_process``)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for s, item in items:
            by_loop.setdefault(s.loop, []).append((s, item))
        for loop, mine in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, mine)
            except RuntimeError:  # (its event loop is closed: nobody is listening, and the engine goes on)
                pass

    def _intake(self) -> None:
        """Apply the submissions and cancellations that arrived (under the lock)."""
        for request, stream in self.inbox:
            try:
                stream.index = self.batcher.submit(request)
                self.streams[stream.index] = stream
            except GraphError as e:  # (parse() checked what it could; the batcher's own checks)
                stream.put(RequestError(str(e), param="prompt"))
        self.inbox = []
        for stream in self.cancels:
            if self.streams.pop(stream.index, None) is not None:
                self.batcher.cancel(stream.index)
        self.cancels = []

    def _fail_all(self, error: RequestError) -> None:
        for s in self.streams.values():
            s.put(error)
        for _, s in self.inbox:
            s.put(error)
        self.streams.clear()
        self.inbox = []
        self.batcher.drain()

    def _loop(self) -> None:
        while True:
            with self.cond:
                self._intake()
                if not self.batcher.busy():  # (no launch to hand the last one's tokens over behind)
                    self._flush()
                while not self.closed and not self.batcher.busy() and not self.inbox and not self.cancels:
                    self.cond.wait()
                if self.closed:
                    self._flush()
                    self._fail_all(RequestError("the server shut down before this request finished", status=503,
                                                kind="server_error"))
                    return
                self._intake()
                if not self.batcher.busy():
                    continue
            try:  # (outside the lock: submissions and cancellations queue up meanwhile)
                self.batcher.step(launched=self._flush)
            except Exception as e:  # a failed launch: the requests it carried end with the error, the loop goes on
                self._flush()
                error = RequestError(f"the launch failed: {type(e).__name__}: {e}", status=500, kind="server_error")
                with self.cond:
                    self.failed_launches += 1
                    for run in list(self.batcher.running):
                        s = self.streams.pop(run.index, None)
                        if s is not None:
                            s.put(error)
                        self.batcher.cancel(run.index)
                    self.batcher.cached = [[] for _ in self.batcher.cached]  # (its rows may be half written)
                continue
            for run in self.batcher.done:  # finished: their streams end behind their tokens (at the next flush)
                s = self.streams.pop(run.index, None)
                if s is not None:
                    self.outbox.append((s, None))
            self.batcher.done = []

    def metrics(self) -> str:
        b = self.batcher
        lines = [
            "# HELP megaegg_requests_total Requests accepted.", "# TYPE megaegg_requests_total counter",
            f"megaegg_requests_total {self.requests_total}",
            "# HELP megaegg_queue_depth Requests waiting to start (what --max-queue limits).",
            "# TYPE megaegg_queue_depth gauge",
            f"megaegg_queue_depth {b.queued}",
            "# HELP megaegg_preempted_waiting Preempted sequences waiting to resume (a paged cache).",
            "# TYPE megaegg_preempted_waiting gauge",
            f"megaegg_preempted_waiting {max(0, len(b.waiting) - b.queued)}",
            "# HELP megaegg_running Sequences in the running batch.", "# TYPE megaegg_running gauge",
            f"megaegg_running {len(b.running)}",
            "# HELP megaegg_generated_tokens_total Tokens generated.", "# TYPE megaegg_generated_tokens_total counter",
            f"megaegg_generated_tokens_total {self.tokens_total}",
            "# HELP megaegg_launches_total Kernel launches.", "# TYPE megaegg_launches_total counter",
            f"megaegg_launches_total {b.launches}",
            "# HELP megaegg_failed_launches_total Launches that raised.", "# TYPE megaegg_failed_launches_total counter",
            f"megaegg_failed_launches_total {self.failed_launches}",
            "# HELP megaegg_prefix_cache_hit_tokens_total Prompt tokens not prefilled: a free slot or shared pages "
            "held their rows.",
            "# TYPE megaegg_prefix_cache_hit_tokens_total counter",
            f"megaegg_prefix_cache_hit_tokens_total {b.prefix_hits}",
            "# HELP megaegg_preemptions_total Sequences whose pages went back to let others grow (a paged cache).",
            "# TYPE megaegg_preemptions_total counter",
            f"megaegg_preemptions_total {b.preemptions}",
        ]
        lines += self.ttft.text("megaegg_time_to_first_token_seconds", "Time from a request to its first token.")
        lines += self.itl.text("megaegg_inter_token_latency_seconds", "Time between a request's tokens.")
        return "\n".join(lines) + "\n"


# --- requests -------------------------------------------------------------------------------------------
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                     "n", "user", "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "echo",
                     "logprobs", "best_of", "suffix"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "best_of", "suffix", "logprobs"}) | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs"}


@dataclass
class Parsed:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: list[int]
    stop_text: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not ((lo < v) if lo_open else (lo <= v)) or not v <= hi:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' must be {kind} in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", param=name)
    return v


def parse(body: Any, *, chat: bool, tokenizer, vocab: int, max_len: int) -> Parsed:
    """A request body as the engine takes it, or a RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise RequestError("'n' must be 1", param="n")
    unset = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
             "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
             "best_of": (None, 1)}
    for name, off in unset.items():  # (accepted only when they ask for nothing)
        v = body.get(name)
        if not any(v is o or (type(v) is type(o) and v == o) for o in off):
            raise RequestError(f"'{name}' is not supported (got {v!r})", param=name)
    if chat:
        prompt = _chat_prompt(body.get("messages"), tokenizer)
    else:
        prompt = _prompt(body.get("prompt"), tokenizer, vocab)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_len - len(prompt) + 1
    if room < 1:
        raise RequestError(f"the prompt has {len(prompt)} tokens; the context holds {max_len}", param="prompt")
    max_tokens = _number(body, name, min(16 if not chat else room, room), 1, 2**31 - 1, integer=True)
    if max_tokens > room:
        raise RequestError(f"'{name}' {max_tokens} and the prompt's {len(prompt)} tokens need {len(prompt) + max_tokens - 1} "
                           f"cache rows; the context holds {max_len}", param=name)
    sampling = Sampling(temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                        top_k=_number(body, "top_k", 0, 0, 2**31 - 1, integer=True),
                        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
                        seed=_number(body, "seed", secrets.randbits(31), -2**31, 2**31 - 1, integer=True))
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in stop):
        raise RequestError("'stop' must be a string, a token id, or a list of at most 4 of them", param="stop")
    stop_ids = [x for x in stop if isinstance(x, int)]
    if any(not 0 <= x < vocab for x in stop_ids):
        raise RequestError(f"'stop' token ids must be in [0, {vocab})", param="stop")
    stop_text = [x for x in stop if isinstance(x, str) and x]
    if stop_text and tokenizer is None:
        raise RequestError("this model has no tokenizer: give 'stop' as token ids", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    return Parsed(prompt, max_tokens, sampling, stop_ids, stop_text, stream, bool(opts.get("include_usage")))


def _prompt(p, tokenizer, vocab: int) -> list[int]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # (a batch of one)
    if isinstance(p, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: give 'prompt' as a list of token ids", param="prompt")
        ids = tokenizer.encode(p, add_special_tokens=True)
    elif isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        ids = list(p)
    else:
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt a request)", param="prompt")
    if not ids:
        raise RequestError("'prompt' is empty", param="prompt")
    bad = [x for x in ids if not 0 <= x < vocab]
    if bad:
        raise RequestError(f"'prompt' token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return ids


def _chat_prompt(messages, tokenizer) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: use /v1/completions", param="messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    turns = [{"role": m["role"], "content": _message_text(m.get("content"), i)} for i, m in enumerate(messages)]
    from jinja2 import TemplateError  # (transformers renders chat templates with jinja2)

    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError) as e:  # (a template refuses what it does not take, by raise_exception:
        # roles out of order, a system message, ...: the client's messages, a 400, not the server's 500)
        raise RequestError(f"the chat template refused these messages: {type(e).__name__}: {e}",
                           param="messages") from e
    return list(tokenizer.encode(text, add_special_tokens=False))  # (the template wrote the special tokens)


def _message_text(content, i: int) -> str:
    """A message's content as the chat template takes it: a string, or OpenAI's list of content parts, whose
    text parts are joined by newlines (as vLLM joins them); a part of another type (an image, audio) is refused,
    naming it: this server runs text models."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestError(f"'messages[{i}].content' must be a string or a non-empty list of content parts",
                           param="messages")
    texts = []
    for j, part in enumerate(content):
        where, kind = f"'messages[{i}].content[{j}]'", part.get("type") if isinstance(part, dict) else None
        if kind not in (None, "text"):
            raise RequestError(f"{where} has type {kind!r}: this model takes text parts only", param="messages")
        if kind is None or not isinstance(part.get("text"), str):
            raise RequestError(f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}}", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


# --- the HTTP app ---------------------------------------------------------------------------------------
def error_body(message: str, kind: str, param: str | None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(engine, *, model: str, tokenizer=None, max_len: int, eos=()):
    """The ASGI app (FastAPI) over ``engine`` (an :class:`Engine`, or the ``python -m megaegg serve``'s
    :class:`~megaegg.engine_process.EngineProcess`: the same surface), serving ``model`` (a sequence also stops at ``eos``)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="megaegg", description=__doc__.split("\n")[0])
    created = int(time.time())

    def refuse(e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.kind, e.param), status_code=e.status)

    @app.exception_handler(Exception)
    async def unexpected(request, exc):  # (never a bare 500 page: one JSON error)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None), status_code=500)

    @app.get("/health")
    async def health():
        dead = getattr(engine, "dead", None)  # (an EngineProcess whose process ended)
        if dead:
            return JSONResponse({"status": "engine down", "detail": dead}, status_code=503)
        return {"status": "ok" if not engine.closed else "shutting down"}

    @app.get("/metrics")
    async def metrics():
        text = engine.metrics()
        if isinstance(text, Future):  # (an EngineProcess: its process answers)
            try:
                text = await asyncio.wrap_future(text)
            except RuntimeError as e:
                return JSONResponse(error_body(str(e), "server_error", None), status_code=503)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "megaegg"}]}

    async def complete(request, chat: bool):
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            return refuse(RequestError(f"the request body is not JSON ({e})"))
        try:
            if isinstance(body, dict) and body.get("model") not in (None, model):
                raise RequestError(f"the model '{body.get('model')}' does not exist; this server serves '{model}'",
                                   param="model", status=404)
            p = parse(body, chat=chat, tokenizer=tokenizer, vocab=engine.vocab, max_len=max_len)
            p.stop_ids = p.stop_ids + [t for t in eos if t not in p.stop_ids]
            stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
            engine.submit(p.prompt, p.max_tokens, p.sampling, p.stop_ids, stream)
        except RequestError as e:
            return refuse(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        gen = _Generation(p, tokenizer)
        watch = asyncio.ensure_future(_watch(stream, request))
        if not p.stream:
            try:
                while not gen.done:
                    for item in await _items(stream):
                        gen.take(_token(item))
                        if gen.done:
                            break
            except RequestError as e:
                engine.cancel(stream)
                return refuse(e)
            except _Disconnected:
                engine.cancel(stream)
                return JSONResponse({}, status_code=499)
            finally:
                watch.cancel()
                if gen.done:
                    engine.cancel(stream)  # (a stop string ended it early: free the slot)
            choice = {"index": 0, "finish_reason": gen.reason, "token_ids": gen.tokens}
            if chat:
                choice["message"] = {"role": "assistant", "content": gen.text()}
            else:
                choice.update(text=gen.text(), logprobs=None)
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model,
                                 "choices": [choice], "usage": gen.usage()})

        async def events():
            sent = ""
            try:
                if chat:
                    yield _sse(_chunk(rid, model, chat, {"role": "assistant", "content": ""}, None))
                while not gen.done:
                    # the tokens that came since the last chunk go in one (one a launch while the event loop
                    # keeps up; more when it falls behind, which so costs it less a token)
                    ids, error = [], None
                    for item in await _items(stream):
                        try:
                            gen.take(_token(item))
                        except RequestError as e:
                            error = e
                            break
                        if item is not None and not gen.done_by_text:
                            ids.append(item)
                        if gen.done:
                            break
                    if ids or gen.done:
                        text = gen.text(final=gen.done)
                        delta = ""
                        if text.startswith(sent):  # (else: held-back text was decoded otherwise; it comes at the end)
                            delta, sent = text[len(sent):], text
                        elif gen.done:
                            delta, sent = text[len(sent):] if len(text) > len(sent) else "", text
                        payload = {"content": delta} if chat else delta  # (the tokens' ids ride along)
                        yield _sse(_chunk(rid, model, chat, payload, gen.reason if gen.done else None, ids))
                    if error is not None:
                        yield _sse(error_body(str(error), error.kind, error.param))
                        return
                if p.include_usage:
                    yield _sse({"id": rid, "object": obj + ".chunk" if chat else obj, "created": int(time.time()),
                                "model": model, "choices": [], "usage": gen.usage()})
                yield "data: [DONE]\n\n"
            except (_Disconnected, asyncio.CancelledError):
                pass
            finally:
                watch.cancel()
                engine.cancel(stream)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    # (plain routes: the handler reads the raw body, so every field error is this module's one message)
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


class _Disconnected(Exception):
    pass


async def _watch(stream: Stream, request) -> None:
    """(a task a request) Ends the stream with :class:`_Disconnected` once its client is gone, checked every
    0.5 s whether or not tokens come (a request still queued sends nothing whose failure would tell)."""
    while True:
        await asyncio.sleep(0.5)
        if await request.is_disconnected():
            stream.queue.put_nowait(_Disconnected())
            return


async def _items(stream: Stream) -> list:
    """The stream's next items: the first awaited, then those queued behind it, up to its end (None) or an
    error (a RequestError, or _Disconnected); :func:`_token` reads each."""
    items = [await stream.queue.get()]
    while isinstance(items[-1], int) and not stream.queue.empty():
        items.append(stream.queue.get_nowait())
    return items


def _token(item) -> int | None:
    """A stream item as a token (None: the end), raising it if it is an error."""
    if isinstance(item, Exception):
        raise item
    return item


class _Generation:
    """A request's tokens and text so far; where it ended and why.

    The text grows incrementally (a window of the tokens since the last whole character, decoded beside the
    same window less its new tokens: a sentencepiece word's leading space or a multi-byte character comes
    out right, as a whole decode would give it), so a chunk or a stop-string check costs the new tokens, not
    the whole answer (a whole decode every chunk: quadratic in the answer's length). The final text is
    one whole decode. Decodes skip special tokens and do not clean up spaces before punctuation."""

    def __init__(self, p: Parsed, tokenizer) -> None:
        self.p, self.tokenizer = p, tokenizer
        self.tokens: list[int] = []
        self.done, self.reason, self.cut = False, None, None
        self.done_by_text = False  # a stop string ended it (its last token is not part of the answer)
        self._ids: list[int] = []  # the tokens that are text (stop tokens are not)
        self._text = ""  # the text of _ids[:_read] (whole characters)
        self._prefix = self._read = 0  # _ids[_prefix:_read]: the window decoded before the new tokens
        self._searched = 0  # stop strings were looked for in _text[:_searched]
        self._hold = max((len(s) for s in p.stop_text), default=1) - 1

    def take(self, item: int | None) -> None:
        if item is None:  # the engine ended it: a stop token or max_tokens
            self.done = True
            self.reason = "stop" if self.tokens and self.tokens[-1] in self.p.stop_ids else "length"
            return
        self.tokens.append(item)
        if item not in self.p.stop_ids:
            self._ids.append(item)
        if self.p.stop_text and self.tokenizer is not None:
            self._advance()
            text, start = self._text, max(0, self._searched - self._hold)
            at = min((i for i in (text.find(s, start) for s in self.p.stop_text) if i >= 0), default=-1)
            self._searched = len(text)
            if at >= 0:
                self.done, self.reason, self.cut, self.done_by_text = True, "stop", at, True

    def _advance(self) -> None:
        """Decode the tokens past ``_read`` into ``_text`` (not while they end inside a character, or in a
        U+FFFD of bytes that are no character: the final text has those)."""
        if self._read == len(self._ids):
            return
        head = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if len(window) > len(head) and not window.endswith("\ufffd"):
            self._text += window[len(head):]
            self._prefix, self._read = self._read, len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        # (no clean-up of spaces before punctuation: it depends on what precedes a window, so a streamed
        # text would not be the final text's prefix; vLLM's text is the same)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def text(self, final: bool = True) -> str:
        """The answer's text: ``final``, the whole decode (cut at a stop string); else the text of the whole
        characters so far less what may begin a stop string."""
        if self.tokenizer is None:
            return ""
        if final:
            text = self._decode(self._ids)
            return text if self.cut is None else text[:self.cut]
        self._advance()
        text = self._text if self.cut is None else self._text[:self.cut]
        return text[:max(0, len(text) - self._hold)] if self.p.stop_text else text

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.p.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.p.prompt) + len(self.tokens)}


def _chunk(rid: str, model: str, chat: bool, payload, reason, token_ids=()) -> dict:
    choice = {"index": 0, "finish_reason": reason, "token_ids": list(token_ids)}
    if chat:
        choice["delta"] = payload
    else:
        choice.update(text=payload, logprobs=None)
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# --- building it from a model ---------------------------------------------------------------------------
def warm_up(step, *, slots: int, max_len: int, max_tokens: int, vocab: int, device, pool=None) -> list[int]:
    """Run a server's launch paths once before it takes requests, so that what a process's first use of
    each costs (on a GPU: loading torch's kernels for the host-side row work) is not paid by the first
    requests: a lone sequence decoding (the batch-1 decode graph, run ahead) and two decoding at once (a
    launch queued ahead, its rows' tokens copied on the device from the launch before). The first 64-client
    burst's second launch took 60-91 ms for ~5 ms of GPU work on an H200 (docs/perf-notes.md #107). The
    launches go through a batcher of their own over ``step``: their rows land in slot caches, or with
    ``pool`` (the server's page pool: its size and page length) pages, that no sequence holds, and a later
    sequence writes them before it reads them. Returns each launch's rows."""
    if max_len < 4:  # (two prompt tokens and three drawn)
        return []
    pages = None if pool is None else PagePool(pool.count, pool.page_len, pool.per_seq, prefix_cache=False)
    warm = Batcher(step, slots=slots, max_len=max_len, max_tokens=max_tokens, device=device, pages=pages,
                   run_ahead=True)
    prompt = lambda i: [(1 + 2 * i) % vocab, (2 + 2 * i) % vocab]  # noqa: E731
    warm.run([Request(prompt(0), 3)])
    if slots >= 2 and (pool is None or pool.count >= 2):
        warm.run([Request(prompt(1), 3), Request(prompt(2), 3)])
    return warm.launch_rows


def build_engine(cfg, weights_for, *, backend: str, device, max_len: int, slots: int, max_tokens: int,
                 max_queue: int, page_len: int | None = None, pages: int | None = None,
                 decode_graph: bool = True) -> Engine:
    """The step graph of ``cfg`` (sampling on the device) with ``weights_for(spec)``, compiled (``backend``
    "cuda" or "sim"; "reference": the reference executor), behind a batcher and its engine thread; a launch of
    one decoding row runs the batch-1 decode graph (with sampling) on its slot (``decode_graph``; its fused MLP
    holds a transposed copy of each down projection: llama-3.2-1b 0.5 GB, an 8B model 3.8 GB). With
    ``page_len``, paged caches: a pool of ``pages`` pages (default: as many rows as ``slots`` caches), every
    launch the step graph's. On the cuda backend its launch paths are run once first (:func:`warm_up`)."""
    import megaegg as me
    from .models import build_step_graph

    if pages is not None and page_len is None:
        raise GraphError("build_engine: pages goes with page_len (a paged KV cache)")
    per_seq = -(-max_len // page_len) if page_len else 0
    pages = pages or slots * per_seq
    graph, spec = build_step_graph(cfg, max_len=max_len, slots=slots, sampling=True, page_len=page_len,
                                   pages=pages if page_len else None)
    weights = weights_for(spec)
    caches = spec.new_caches(device=device)
    decode = None
    if backend == "reference":
        step = reference_batch_step(graph, weights, caches)
    else:
        kernel = me.compile(graph, weights, backend=backend, max_dims={"n": max_tokens, "r": slots, "ctx": max_len},
                            dims_hint={"n": slots, "r": slots, "ctx": min(512, max_len)})
        step = kernel_batch_step(kernel, caches)
        if decode_graph and not page_len:  # a lone decoding sequence: the batch-1 decode graph's fused kernel, on its slot
            decode = lone_decode_kernel(cfg, weights, backend=backend, max_len=max_len, sampling=True)
            step = single_sequence_decode(step, decode, caches)
    pool = PagePool(pages, page_len, per_seq) if page_len else None
    if backend == "cuda":
        warm_up(step, slots=slots, max_len=max_len, max_tokens=max_tokens, vocab=cfg.vocab, device=device, pool=pool)
    batcher = Batcher(step, slots=slots, max_len=max_len, max_tokens=max_tokens, device=device, vocab=cfg.vocab,
                      prefix_cache=pool is None, pages=pool, run_ahead=backend != "reference")
    return Engine(batcher, max_queue=max_queue, vocab=cfg.vocab, decode_kernel=decode, caches=caches)


def main(argv=None) -> int:
    """``python -m megaegg serve``: parse the flags, build the engine, run uvicorn until SIGTERM / Ctrl-C."""
    from pathlib import Path

    from .models import PRESETS, ModelConfig, eos_token_ids, read_config
    from .models.cli import OneLineParser, positive_int

    ap = OneLineParser(prog="python -m megaegg serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a checkpoint folder (config.json, safetensors; its tokenizer if saved beside it)")
    ap.add_argument("--random-weights", action="store_true", help="random weights for --preset instead of a checkpoint")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="the model preset of --random-weights (default tiny)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    ap.add_argument("--backend", choices=("cuda", "sim", "reference"), default=None,
                    help="cuda (the default on a GPU), sim (the CPU simulator) or reference (plain torch ops)")
    ap.add_argument("--max-len", type=positive_int, default=None,
                    help="cache rows a sequence holds (default 2048, at most the model's context)")
    ap.add_argument("--slots", type=positive_int, default=8, help="sequences decoding at once (default 8)")
    ap.add_argument("--max-step-tokens", type=positive_int, default=None,
                    help="rows of one launch: decoding tokens plus a prompt chunk (default 512)")
    ap.add_argument("--max-queue", type=positive_int, default=256, help="requests waiting before 429 (default 256)")
    ap.add_argument("--page-len", type=positive_int, default=None,
                    help="a paged KV cache of pages of this many rows (default: a cache of --max-len rows a slot)")
    ap.add_argument("--pages", type=positive_int, default=None,
                    help="pages in the pool, with --page-len (default: --slots x --max-len rows' worth)")
    ap.add_argument("--no-decode-graph", action="store_true",
                    help="a lone sequence decodes with the step graph too (saves the batch-1 decode graph's memory: "
                         "its fused MLP keeps a transposed copy of every down projection)")
    a = ap.parse_args(argv)
    if a.pages and not a.page_len:
        ap.error("--pages goes with --page-len (a paged KV cache)")
    if bool(a.model) == bool(a.random_weights):
        ap.error("give --model DIR or --random-weights [--preset NAME]")
    if a.preset and not a.random_weights:
        ap.error("--preset goes with --random-weights (a checkpoint's config.json names its model)")
    if a.backend == "cuda" and not torch.cuda.is_available():
        ap.error("--backend cuda: no CUDA GPU is available; use --backend sim")
    backend = a.backend or ("cuda" if torch.cuda.is_available() else "sim")
    device = "cuda" if backend == "cuda" else "cpu"
    if a.model:
        if not Path(a.model).is_dir():
            ap.error(f"--model {a.model}: no such directory")
        cfg, name, eos = read_config(a.model), Path(a.model).name, eos_token_ids(a.model)
        tokenizer = load_tokenizer(a.model)
    else:
        name = a.preset or "tiny"
        cfg, eos, tokenizer = ModelConfig.preset(name), (), None
    max_len = min(a.max_len or 2048, cfg.max_positions)
    tokens = max(a.slots, min(a.max_step_tokens or 512, a.slots * max_len))
    if a.page_len and a.pages and a.pages * a.page_len < max_len:
        ap.error(f"--pages {a.pages} of --page-len {a.page_len} rows hold fewer than one sequence's --max-len {max_len}")
    from .engine_process import EngineProcess, EngineSpec

    spec = EngineSpec(cfg, backend, device, max_len, a.slots, tokens, checkpoint=a.model, page_len=a.page_len,
                      pages=a.pages, decode_graph=not a.no_decode_graph)
    engine = EngineProcess(spec, max_queue=a.max_queue)
    import uvicorn

    app = create_app(engine, model=name, tokenizer=tokenizer, max_len=max_len, eos=eos)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    finally:
        engine.close()
    return 0


def load_tokenizer(path: str):
    """The tokenizer saved beside a checkpoint (transformers), or None."""
    from pathlib import Path

    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(p)

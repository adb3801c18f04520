"""The server's engine in a process of its own: :class:`EngineProcess` (the HTTP side's handle) and the
process's loop (:func:`_run`).

Why: the engine thread's host work for a launch (planning rows, torch calls, the launch) and the event
loop's work on the tokens (a chunk a stream: its JSON, the ASGI send, the socket write) need the one
interpreter lock of their process. At 64 streams the two together take longer than a launch on the GPU
(H200, llama-3.2-1b: a 64-row decode launch runs 2.6 ms on the device and took 3.9 ms in the server), so
the GPU waited for Python. In two processes each has a lock: the engine keeps the GPU's pace, and the
event loop, when it falls behind, sends the tokens that queued up in one chunk (``serve._items``).

The wire, one pipe both ways (``multiprocessing`` pickles; messages are tuples):
  to the engine:   ("submit", rid, prompt, max_tokens, sampling, stop_ids, submitted) | ("cancel", rid)
                   | ("call", req, pickled (fn, args)) | ("close",)
  from the engine: ("ready", info) | ("failed", message) | ("reply", req, ok, pickled result or exception)
                   | ("items", [(rid, token | None | error tuple)], waiting, received)
A launch's tokens are one "items" message (sent when the next launch is queued, as the in-process
engine hands them to its event loops); ``waiting`` and ``received`` let the HTTP side count the
requests not started yet for its queue limit without asking. A call's function and answer cross as bytes
pickled and unpickled where a failure is the caller's, never the pipe's. Neither side's reader waits for
a lock that is held while sending, so a full pipe always drains.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from .graph import GraphError
from .serve import Engine, RequestError, Stream, build_engine

log = logging.getLogger("megaegg.serve")


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds (it crosses to the process: plain values). ``checkpoint``: a
    checkpoint folder's weights; None: random weights of ``cfg`` from ``seed``. The rest as
    :func:`megaegg.serve.build_engine` takes them."""

    cfg: Any  # a ModelConfig
    backend: str
    device: str
    max_len: int
    slots: int
    max_tokens: int
    checkpoint: str | None = None
    seed: int = 0
    page_len: int | None = None
    pages: int | None = None
    decode_graph: bool = True

    def __call__(self) -> Engine:
        from .models import load_checkpoint, random_weights

        if self.checkpoint is not None:
            weights_for = lambda spec: load_checkpoint(self.checkpoint, spec, device=self.device)  # noqa: E731
        else:
            weights_for = lambda spec: random_weights(spec, seed=self.seed, device=self.device)  # noqa: E731
        # (no queue limit here: the HTTP side's EngineProcess answers 429 before a request crosses)
        return build_engine(self.cfg, weights_for, backend=self.backend, device=self.device, max_len=self.max_len,
                            slots=self.slots, max_tokens=self.max_tokens, max_queue=1 << 62,
                            page_len=self.page_len, pages=self.pages, decode_graph=self.decode_graph)


class EngineProcess:
    """An :class:`~megaegg.serve.Engine` built by ``build()`` in a process of its own (``build``: an
    :class:`EngineSpec`, or any function that pickles by name: a module's), with the surface
    ``create_app`` uses: :meth:`submit`, :meth:`cancel`, :meth:`metrics`, :meth:`close`, ``vocab``,
    ``closed``. Construction waits until the engine is built (a failure raises its message here).
    ``max_queue``: requests not started yet before :meth:`submit` answers 429. If the process dies, every
    stream ends with an error and ``closed`` and ``dead`` say so."""

    def __init__(self, build: Callable[[], Engine], *, max_queue: int = 256) -> None:
        ctx = multiprocessing.get_context("spawn")  # (a fresh interpreter: CUDA cannot cross a fork)
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_run, args=(build, theirs), name="megaegg-engine", daemon=True)
        self.process.start()
        theirs.close()
        self._closing = False
        # (the process ignores SIGINT and SIGTERM, so that a signal to the whole group lets this side finish its
        # streams: at exit it is killed here, before multiprocessing's own exit handler would terminate it and
        # wait forever)
        atexit.register(self._kill)
        try:
            msg = self._built()
        except BaseException:  # (a failure, or Ctrl-C while it compiles: it goes too)
            self._kill()
            raise
        if msg[0] == "failed":
            self._kill()
            raise GraphError(msg[1])
        self.vocab: int = msg[1]["vocab"]
        self.max_queue = max_queue
        self.streams: dict[int, Stream] = {}  # rid -> its stream, until its end arrives
        self.closed = False
        self.dead: str | None = None  # why the process ended unasked
        self._lock = threading.Lock()  # (the state below; never held while sending or waiting)
        self._send_lock = threading.Lock()  # (the pipe's sending end)
        self._next = 0  # the next request id (rid)
        self._sent = self._received = self._waiting = 0  # submits sent; as of the last report: received, waiting
        self._replies: dict[int, Future] = {}
        self._reader = threading.Thread(target=self._read, name="megaegg-engine-reader", daemon=True)
        self._reader.start()

    def _built(self):
        """The process's first message ("ready" or "failed"), waiting while it builds."""
        while not self._conn.poll(0.2):
            if not self.process.is_alive():
                raise GraphError(f"the engine process exited (code {self.process.exitcode}) before it was built")
        try:
            return self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise GraphError(f"the engine process exited (code {self.process.exitcode}) before it was built") from None

    # (the HTTP side's threads)
    def submit(self, prompt: list[int], max_tokens: int, sampling, stop_ids: list[int], stream: Stream) -> None:
        with self._lock:
            if self.closed:
                raise RequestError(self.dead or "the server is shutting down", status=503, kind="server_error")
            if self._waiting + self._sent - self._received >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting): retry later", status=429,
                                   kind="rate_limit_error")
            rid, self._next = self._next, self._next + 1
            stream.index = rid
            self.streams[rid] = stream  # (before it is sent: its first token may come back at once)
            self._sent += 1
        # (``submitted``: when the HTTP side took it, on a clock both processes share, so the engine's
        # time-to-first-token histogram counts the way over)
        if not self._send(("submit", rid, prompt, max_tokens, sampling, stop_ids, stream.submitted)):
            with self._lock:
                self.streams.pop(rid, None)
                self._sent -= 1
            raise RequestError(self.dead or "the engine process is gone", status=503, kind="server_error")

    def cancel(self, stream: Stream) -> None:
        """Free the request's sequence; its stream gets nothing more."""
        with self._lock:
            known = self.streams.pop(stream.index, None) is not None and not self.closed
        if known:
            self._send(("cancel", stream.index))

    def metrics(self) -> Future:
        """The engine's Prometheus text (a Future: the engine process answers)."""
        return self._ask(_metrics)

    def call(self, fn: Callable[..., Any], *args, timeout: float | None = 600.0) -> Any:
        """``fn(engine, *args)`` run in the engine process (``fn``, its arguments and its result cross by
        pickle: a module's function), its result or its exception."""
        return self._ask(fn, *args).result(timeout)

    def close(self) -> None:
        """Stop the engine after the launch in flight: every request not finished ends with an error. Gives
        up on an engine that does not stop within ~2 minutes: its process is killed."""
        with self._lock:
            self.closed = self._closing = True
        sender = threading.Thread(target=self._send, args=(("close",),), daemon=True)  # (a send can block)
        sender.start()
        sender.join(timeout=10)
        self._reader.join(timeout=90)
        self._kill()
        self._reader.join(timeout=10)

    def _kill(self) -> None:
        """(close, a failed start, exit) Wait for the process a little if it was asked to close, else kill it."""
        self.process.join(timeout=10 if self._closing else 0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)

    def _ask(self, fn, *args) -> Future:
        blob = pickle.dumps((fn, args))  # (here: a function that cannot cross fails its caller, not the engine)
        fut: Future = Future()
        with self._lock:
            if self.closed:
                fut.set_exception(RuntimeError(self.dead or "the engine is closed"))
                return fut
            req, self._next = self._next, self._next + 1
            self._replies[req] = fut
        if not self._send(("call", req, blob)):
            with self._lock:
                self._replies.pop(req, None)
            fut.set_exception(RuntimeError(self.dead or "the engine process is gone"))
        return fut

    def _send(self, msg) -> bool:
        with self._send_lock:
            try:
                self._conn.send(msg)
                return True
            except (OSError, ValueError):  # (the process is gone: the reader ends the streams)
                return False

    # (the reader thread: never waits for anything but the pipe, so the engine's sends always drain)
    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                try:
                    self._take(msg)
                except Exception:  # (one message's failure must not stop every stream's tokens)
                    log.exception("the engine process's message %r", msg[0])
        finally:
            self.process.join(timeout=10)
            with self._lock:
                if not self._closing:
                    self.dead = f"the engine process exited (code {self.process.exitcode})"
                self.closed = True
                error = RequestError(self.dead or "the server shut down before this request finished", status=503,
                                     kind="server_error")
                ended, self.streams = list(self.streams.values()), {}
                replies, self._replies = list(self._replies.values()), {}
            Engine.deliver([(s, error) for s in ended])
            for fut in replies:
                if not fut.done():
                    fut.set_exception(RuntimeError(error.args[0]))

    def _take(self, msg) -> None:
        if msg[0] == "items":
            _, items, waiting, received = msg
            with self._lock:
                self._waiting, self._received = waiting, received
                mine = [(s, item) for s, item in ((self._stream(rid, item), _item(item)) for rid, item in items)
                        if s is not None]
            Engine.deliver(mine)
        elif msg[0] == "reply":
            _, req, ok, blob = msg
            with self._lock:
                fut = self._replies.pop(req, None)
            if fut is None or fut.done():  # (a caller that stopped waiting cancelled it)
                return
            try:
                value = pickle.loads(blob)
            except Exception as e:  # noqa: BLE001
                fut.set_exception(RuntimeError(f"the engine's answer does not unpickle here: {type(e).__name__}: {e}"))
                return
            fut.set_result(value) if ok else fut.set_exception(value)

    def _stream(self, rid: int, item) -> Stream | None:  # (under the lock)
        return self.streams.pop(rid, None) if item is None or isinstance(item, tuple) else self.streams.get(rid)


def _item(item):
    """A wire item as a stream item: a token, None (the end) or a RequestError."""
    if isinstance(item, tuple):
        message, param, status, kind = item
        return RequestError(message, param=param, status=status, kind=kind)
    return item


def _wire(item):
    """A stream item as it crosses: a RequestError as a tuple (an exception with keyword fields does not
    pickle back)."""
    if isinstance(item, RequestError):
        return (str(item), item.param, item.status, item.kind)
    if isinstance(item, Exception):
        return (f"{type(item).__name__}: {item}", None, 500, "server_error")
    return item


def _metrics(engine: Engine) -> str:
    return engine.metrics()


@dataclass(eq=False)
class _RemoteStream:
    """(engine process) A request's stream as the engine sees it: its items go down the pipe."""

    rid: int
    send: Callable[[list], None]
    index: int = -1  # (the batcher's index, set by the engine)
    submitted: float = 0.0
    last: float | None = None

    def put(self, item) -> None:
        self.send([(self, item)])


def _run(build: Callable[[], Engine], conn) -> None:
    """The engine process: build the engine, then apply the HTTP side's messages until "close" or until
    the pipe closes (the HTTP side exited)."""
    # (Ctrl-C or a SIGTERM to the whole group reaches us too: the HTTP side finishes its streams, then stops us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build()
    except BaseException as e:  # noqa: BLE001 (whatever it was, its message goes back)
        conn.send(("failed", str(e) if isinstance(e, GraphError) else f"{type(e).__name__}: {e}"))
        return
    lock = threading.Lock()  # (the pipe's sending end: the engine thread and this one send)
    streams: dict[int, _RemoteStream] = {}
    received = 0  # (submits taken; read by the engine thread)

    def post(msg) -> None:
        with lock:
            try:
                conn.send(msg)
            except (OSError, ValueError):  # (the HTTP side is gone: the loop below ends at the closed pipe)
                pass

    def send(items: list) -> None:
        wire = []
        for s, item in items:
            if item is None or isinstance(item, Exception):
                streams.pop(s.rid, None)
            wire.append((s.rid, _wire(item)))
        # (sent after every launch, tokens or not, and before the engine waits idle: the HTTP side's count
        # of requests not started stays current)
        post(("items", wire, engine.batcher.queued + len(engine.inbox), received))

    engine.deliver = send
    conn.send(("ready", {"vocab": engine.vocab}))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "submit":
                _, rid, prompt, max_tokens, sampling, stop_ids, submitted = msg
                stream = streams[rid] = _RemoteStream(rid, send, submitted=submitted)
                received += 1
                try:
                    engine.submit(prompt, max_tokens, sampling, stop_ids, stream)
                except RequestError as e:
                    stream.put(e)
            elif msg[0] == "cancel":
                stream = streams.pop(msg[1], None)
                if stream is not None:
                    engine.cancel(stream)
            elif msg[0] == "call":
                post(("reply", msg[1], *_answer(engine, msg[2])))
            elif msg[0] == "close":
                break
    finally:
        engine.close()
        conn.close()


def _answer(engine: Engine, blob: bytes) -> tuple[bool, bytes]:
    """(engine process) A call's (ok, pickled result or exception); whatever fails, an answer."""
    try:
        fn, args = pickle.loads(blob)
        return True, pickle.dumps(fn(engine, *args))
    except Exception as e:  # noqa: BLE001 (the caller's exception)
        try:
            return False, pickle.dumps(e)
        except Exception:  # noqa: BLE001
            return False, pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))

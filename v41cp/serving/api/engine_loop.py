"""One engine loop for many concurrent callers: the `Engine` runs in its own thread, asyncio code talks to it.

`EngineLoop(engine)` owns the engine: only its thread calls `Engine.submit / step / cancel / release`, so
requests that arrive from any number of HTTP connections are batched together by the engine's continuous
batching (a request's tokens do not depend on the others in its batch: every row of the decode step and
every prefill is computed on its own). Callers, from an asyncio event loop:

* ``handle = await loop.submit(prompt_ids, sampling)`` — validated by the engine in its thread; raises the
  engine's `RequestError` (or `EngineFull`) with nothing else touched, or `LoopClosed` after shutdown;
* ``async for event in handle`` — `TokenEvent`s: the new output ids of each engine step, then one with a
  ``finish_reason`` (``eos`` | ``length`` | ``cancelled``) or an ``error`` (the loop stopped, a step failed);
* ``loop.cancel(rid)`` — from any thread: the request is cancelled and its pages freed before the next step;
* ``loop.load()`` — waiting / running requests and free blocks, as of the last step; ``loop.counters()`` — the
  same with the preemption, prefix-cache and speculative counters (the server's ``/metrics``);
* ``loop.shutdown()`` — every request in flight ends with an error event (never a hang), the thread exits.

Finished requests are released from the engine at once, so a long-running server keeps no history.

Across processes (``control``: a `ControlPlane`, on rank 0), each iteration's submits, cancels and shutdown are
broadcast before the step, and the other ranks apply them in `control_plane.follow`. A follower that dies makes
the exchange or the step (collectives) fail at once; one that stops answering leaves the exchange waiting, which a
watchdog ends after ``follower_timeout`` seconds. Either way the loop is lost (the processes cannot step apart):
every request in flight gets an error event naming the cause and ``on_fatal(message)`` is called (the server exits
non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass

from v41cp.serving.engine import EngineLike, SamplingParams
from v41cp.serving.multihost.control_plane import Commands, ControlPlane, drop

__all__ = ["EngineLoop", "FollowerLost", "LoopClosed", "RequestHandle", "TokenEvent"]


class LoopClosed(RuntimeError):
    """The engine loop is shutting down or has stopped; no new request is taken."""


class FollowerLost(RuntimeError):
    """A follower process died or stopped answering: the processes can no longer step together."""


@dataclass(frozen=True)
class TokenEvent:
    ids: tuple[int, ...]                 # output token ids new since the previous event
    finish_reason: str | None = None     # eos | length | cancelled, on the request's last event
    error: str | None = None             # set when the request ended abnormally (shutdown, failed step)
    cached_tokens: int = 0               # prompt tokens the request reused from the prefix cache
    logprobs: tuple | None = None        # with sampling.logprobs: one (logprob, ((id, logprob), …)) per id of ``ids``
    prompt_logprobs: tuple | None = None  # with sampling.prompt_logprobs, on the first event: None, then an entry per
    #                                       prompt token after the first

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestHandle:
    """An accepted request: its engine id, prompt, and the asynchronous stream of its `TokenEvent`s."""

    def __init__(self, rid, prompt_ids: list[int], events: "asyncio.Queue[TokenEvent]", loop: "EngineLoop"):
        self.rid, self.prompt_ids, self._events, self._loop = rid, prompt_ids, events, loop
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        if self.done:
            raise StopAsyncIteration
        event = await self._events.get()
        self.done = event.final
        return event

    def cancel(self) -> None:
        """Cancel the request if it is still running (idempotent)."""
        if not self.done:
            self.done = True
            self._loop.cancel(self.rid)


class _Stream:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        self.aio_loop, self.events, self.sent = aio_loop, events, 0
        self.prompt_sent = False

    def emit(self, event: TokenEvent) -> None:
        try:
            self.aio_loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:             # the caller's event loop is closed: nobody is listening
            pass


class EngineLoop:
    """See the module docstring. ``idle_wait``: seconds the thread sleeps waiting for work when idle; ``control``:
    the control plane to the follower processes (None: one process); ``follower_timeout``: seconds an exchange may
    wait for the followers; ``on_fatal(message)``: called once when the loop is lost to a follower."""

    def __init__(self, engine: EngineLike, idle_wait: float = 0.05, control: ControlPlane | None = None,
                 follower_timeout: float = 60.0, on_fatal=None):
        if follower_timeout <= 0:
            raise ValueError(f"follower_timeout must be positive, got {follower_timeout}")
        self.engine, self.idle_wait, self.control = engine, idle_wait, control
        self.follower_timeout, self.on_fatal = follower_timeout, on_fatal
        self._fatal_once = threading.Lock()
        self._exchange_since: float | None = None       # when the exchange in progress began (the watchdog's clock)
        self._ops = Commands()
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._streams: dict[object, _Stream] = {}
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._load = engine.load()
        self._counters = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="v41cp-engine-loop", daemon=True)
        self.steps = 0

    # ------------------------------------------------------------------ caller side (any thread / asyncio)
    def start(self) -> "EngineLoop":
        self._thread.start()
        if self.control is not None:
            threading.Thread(target=self._watch, name="v41cp-follower-watchdog", daemon=True).start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing.is_set()

    def load(self) -> dict:
        return dict(self._load, in_flight=len(self._streams), steps=self.steps)

    def counters(self) -> dict:
        """``load()``'s requests and blocks with the engine's cumulative counters, as of the last step:
        ``preemptions``, ``prefix_cache`` (the prefix cache's lookups, or None without one) and ``speculative``
        (`speculative_stats`, or None)."""
        return dict(self._counters)

    def _snapshot(self) -> dict:
        eng, load = self.engine, self._load
        decode = load.get("decode", {})
        prefix = getattr(eng, "prefix", None)
        return {"waiting": load["waiting"], "running": load["running"], "free_blocks": load["free_blocks"],
                "total_blocks": load["total_blocks"],
                "preemptions": load.get("preemptions", decode.get("preemptions", 0)),
                "prefix_cache": dict(prefix.stats) if prefix is not None else None,
                "speculative": eng.speculative_stats() if getattr(eng, "speculative", None) is not None else None}

    async def submit(self, prompt_ids, sampling: SamplingParams, rid=None) -> RequestHandle:
        if self._closing.is_set():
            raise LoopClosed("the server is shutting down")
        rid = f"r{next(self._ids)}" if rid is None else rid
        aio_loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        prompt = [int(t) for t in prompt_ids]
        self._inbox.put(("submit", rid, prompt, sampling, _Stream(aio_loop, events), fut))
        wrapped = asyncio.wrap_future(fut)
        while not (await asyncio.wait({wrapped}, timeout=0.5))[0]:
            if not self._thread.is_alive():     # the thread exited after this was queued: answer it here
                self._drain_submissions()
        wrapped.result()
        return RequestHandle(rid, prompt, events, self)

    def cancel(self, rid) -> None:
        self._inbox.put(("cancel", rid))

    def shutdown(self, reason: str = "the server is shutting down", join: bool = False) -> None:
        """Stop taking requests; every request in flight gets an error event; the thread exits."""
        self._closing.set()
        self._reason = reason
        self._inbox.put(("wake",))
        if join and self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except FollowerLost as e:
            self._lost(str(e))
        except BaseException as e:       # never leave a caller waiting on a dead thread
            traceback.print_exc()
            message = f"the engine loop stopped: {type(e).__name__}: {e}"
            self._closing.set()
            self._fail_all(message)
            self._drain_submissions()
            if self.control is not None and self.on_fatal is not None and self._fatal_once.acquire(blocking=False):
                self.on_fatal(message)       # the followers wait in the next exchange: the server must exit
            raise

    def _lost(self, message: str) -> None:
        """The loop is lost to a follower (from the loop thread, or the watchdog's while the loop thread waits in a
        collective): every request in flight ends with ``message``, then ``on_fatal``. Once."""
        if not self._fatal_once.acquire(blocking=False):
            return
        self._closing.set()
        self._reason = message
        for stream in list(self._streams.values()):          # no engine call: a collective may hold the engine
            stream.emit(TokenEvent((), error=message))
        self._streams.clear()
        self._drain_submissions()
        if self.on_fatal is not None:
            self.on_fatal(message)

    def _exchange(self, ops: Commands) -> None:
        """Broadcast this iteration's commands; a failure (or, seen by `_watch`, a wait past ``follower_timeout``)
        loses the loop."""
        self._exchange_since = time.monotonic()
        try:
            self.control.exchange(ops)
        except Exception as e:
            raise FollowerLost(f"a follower process is gone: the control-plane exchange failed "
                               f"({type(e).__name__}: {str(e)[:200]})") from e
        finally:
            self._exchange_since = None

    def _watch(self) -> None:
        """The watchdog thread: an exchange still waiting after ``follower_timeout`` loses the loop."""
        tick = min(1.0, self.follower_timeout / 4)
        while not self._closing.wait(tick):
            since = self._exchange_since
            if since is not None and time.monotonic() - since > self.follower_timeout:
                self._lost(f"a follower process stopped answering: no exchange within {self.follower_timeout:g} s")
                return

    def _serve(self) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._inbox.get(timeout=self.idle_wait) if not eng.pending else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._execute(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            closing = self._closing.is_set()  # read once: the followers must stop exactly when this loop does
            if self.control is not None:     # the followers apply this iteration's commands, then step with us
                ops, self._ops = self._ops, Commands()
                ops.close = closing
                self._exchange(ops)
            if closing:
                self._fail_all(getattr(self, "_reason", "the server is shutting down"))
                self._drain_submissions()
                return
            if eng.pending:
                try:
                    eng.step()
                    self.steps += 1
                except Exception as e:  # a failed step ends the requests in it, the loop keeps serving
                    traceback.print_exc()
                    if self.control is not None:     # a collective across processes failed: they cannot go on
                        raise FollowerLost(f"a follower process is gone: the engine step failed "
                                           f"({type(e).__name__}: {str(e)[:200]})") from e
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                self._publish()
            self._load = eng.load()
            self._counters = self._snapshot()

    def _execute(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "submit":
            _, rid, prompt, sampling, stream, fut = cmd
            if not fut.set_running_or_notify_cancel():         # the caller gave up before we got here
                return
            if self._closing.is_set():
                fut.set_exception(LoopClosed("the server is shutting down"))
                return
            try:
                eng.submit(rid, prompt, sampling)
            except Exception as e:   # RequestError / EngineFull: nothing was changed
                fut.set_exception(e)
                return
            self._ops.submit(rid, prompt, sampling)
            self._streams[rid] = stream
            fut.set_result(rid)
        elif cmd[0] == "cancel":
            rid = cmd[1]
            stream = self._streams.pop(rid, None)
            self._ops.cancel(rid)
            self._drop(rid)
            if stream is not None:
                stream.emit(TokenEvent((), finish_reason="cancelled"))

    def _publish(self) -> None:
        eng = self.engine
        for rid in list(self._streams):
            stream, req = self._streams[rid], eng.requests[rid]
            new = tuple(req.output[stream.sent:])
            logprobs = None if req.logprobs is None else tuple(req.logprobs[stream.sent:stream.sent + len(new)])
            stream.sent += len(new)
            finished = req.status in ("done", "cancelled")
            if new or finished:
                scored = req.prompt_logprobs
                first = scored is not None and not stream.prompt_sent
                stream.prompt_sent = stream.prompt_sent or first
                stream.emit(TokenEvent(new, finish_reason=req.finish_reason if finished else None,
                                       cached_tokens=req.cached, logprobs=logprobs,
                                       prompt_logprobs=tuple(scored) if first else None))
            if finished:
                del self._streams[rid]
                eng.release(rid)

    def _drop(self, rid) -> None:
        """Cancel request ``rid`` if it is still active and forget it (its pages and slot are free)."""
        drop(self.engine, rid)

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            self._drop(rid)
            stream.emit(TokenEvent((), error=message))
        self._streams.clear()

    def _drain_submissions(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit" and cmd[-1].set_running_or_notify_cancel():
                cmd[-1].set_exception(LoopClosed("the server is shutting down"))

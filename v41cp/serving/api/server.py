"""``python -m v41cp serve``: the OpenAI-compatible server (FastAPI app on uvicorn) over one engine loop.

`run_server(engine, codec, model_name, host, port)` warms the engine up (compiles every program its rounds can
run — each prefill bucket, decode — before it opens its port, with a progress bar), starts the `EngineLoop` thread and
serves `v41cp.serving.api.app.build_app` with uvicorn. On SIGINT / SIGTERM the loop is shut down first,
so every request still in flight gets an error response (streams: an error event, then ``[DONE]``) instead
of holding the shutdown; then uvicorn closes the connections and exits.

Why FastAPI + uvicorn: the stack vLLM and SGLang serve the same API with; pydantic validates the request
bodies (a bad field is reported by name), Starlette streams server-sent events and tells a handler when its
client went away, and uvicorn is a maintained ASGI server — no HTTP parsing of our own.

Across processes (``--nnodes``): rank 0 runs `run_server` with a `ControlPlane`, every other rank runs
`run_follower` (the same warm-up, then `control_plane.follow` until rank 0 shuts down); no other rank listens.
When a follower dies or stops answering (`EngineLoop`'s ``follower_timeout``), rank 0 ends every request in flight
with an error naming the cause, stops serving and exits with status `EXIT_FOLLOWER_LOST`; a follower whose leader is
gone exits with that status too. Neither leaves the distributed runtime in order (its barrier would wait for the
lost process): they exit at once.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import uvicorn
from tqdm import tqdm

from v41cp.serving.api.app import build_app
from v41cp.serving.api.engine_loop import EngineLoop
from v41cp.serving.api.text import TextCodec
from v41cp.serving.engine import EngineLike, SamplingParams
from v41cp.serving.multihost.control_plane import ControlPlane, follow

__all__ = ["EXIT_FOLLOWER_LOST", "run_follower", "run_server", "warm_up"]

EXIT_FOLLOWER_LOST = 3       # the exit status of a process whose peer process died or stopped answering


def warm_up(engine: EngineLike, progress: bool = True) -> dict:
    """Compile every program the engine's rounds can run (`Engine.warm_up`: each prefill bucket, decode, the
    speculative round), then serve one short request through every stage (the PD hand-over, the control plane);
    returns the seconds. Leaves the engine as it was (the request is released)."""
    t0 = time.perf_counter()
    with tqdm(total=1, desc="warm-up compile", unit="program", disable=not progress, file=sys.stderr) as bar:
        def step(name: str, done: int, total: int) -> None:
            if done == 1:                                 # an engine's first program: its count joins the total
                bar.total += total
            bar.set_postfix_str(name)
            bar.update()

        stages = engine.warm_up(step)
        bar.set_postfix_str("one request through every stage")
        n = max(1, min(4, engine.capacity.max_tokens - 2))
        rid = "v41cp-warm-up"                            # (the same on every process of a multi-process server)
        engine.submit(rid, [0] * n, SamplingParams(max_new_tokens=2, stop_on_eos=False))
        while engine.requests[rid].status in ("waiting", "running"):
            engine.step()
        engine.release(rid)
        bar.update()
    return {"warm_up_s": round(time.perf_counter() - t0, 3), "programs": stages["programs"]}


def run_server(engine: EngineLike, codec: TextCodec | None, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               progress: bool = True, log_level: str = "info", control: ControlPlane | None = None,
               api_key: str | None = None, follower_timeout: float = 60.0) -> None:
    stages = warm_up(engine, progress)
    print(f"v41cp: warm-up compiled {stages['programs']} programs in {stages['warm_up_s']} s; serving {model_name!r} on http://{host}:{port}", file=sys.stderr,
          flush=True)
    lost = threading.Event()
    server: list = []

    def on_fatal(message: str) -> None:          # the loop is lost to a follower: stop serving, then exit non-zero
        print(f"v41cp: {message}; the requests in flight were ended with that error; exiting", file=sys.stderr,
              flush=True)
        lost.set()
        if server:
            server[0].should_exit = True

    loop = EngineLoop(engine, control=control, follower_timeout=follower_timeout, on_fatal=on_fatal).start()
    app = build_app(loop, codec, model_name, api_key)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # in-flight requests end with an error now, not after they finish; across processes the followers get
            # the closing message first, and every process leaves the distributed runtime together
            loop.shutdown(join=control is not None)
            if control is not None:
                control.shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                            access_log=False)
    server.append(_Server(config))
    if lost.is_set():
        server[0].should_exit = True
    try:
        server[0].run()
    finally:
        if lost.is_set():                # the distributed runtime cannot be left in order: exit now
            sys.stderr.flush()
            os._exit(EXIT_FOLLOWER_LOST)
        loop.shutdown(join=True)
        if control is not None:
            control.shutdown()


def _leader_lost(message: str) -> None:
    print(f"v41cp: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_FOLLOWER_LOST)


def run_follower(engine: EngineLike, control: ControlPlane, leader_timeout: float | None = 60.0) -> int:
    """A rank > 0 of a multi-process server: the leader's warm-up in lock-step, then its iterations until it
    closes; returns the steps taken. A leader that sends nothing for ``leader_timeout`` seconds (hung) ends this
    process with status 3, as one that is gone does."""
    warm_up(engine, progress=False)
    try:
        steps = follow(engine, control, leader_timeout, _leader_lost if leader_timeout is not None else None)
    except Exception as e:               # the leader is gone (its collective failed): exit now, not at a barrier
        print(f"v41cp: rank {control.rank}: the leader process is gone ({type(e).__name__}: {str(e)[:200]}); "
              "exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_FOLLOWER_LOST)
    control.shutdown()
    return steps

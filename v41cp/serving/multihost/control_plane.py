"""The control plane of a server that spans processes (`jax.distributed`): rank 0 decides, every rank applies.

Host control is SPMD: every process runs the same `Engine` over the one global mesh, and every step is a
collective, so all processes must submit, cancel, step and release the same requests in the same order. Only rank
0 serves HTTP. Its `EngineLoop` records what it did in one iteration (the requests it accepted, the ones it
cancelled, whether it is shutting down) as a `Commands` message, broadcasts it before stepping, and the followers
(`follow`) apply the same commands to their engines and step with it. What every process then does alone is
deterministic (the scheduler, the release of finished requests), so the engines stay in lock-step.

The broadcast is `jax.experimental.multihost_utils.broadcast_one_to_all` (a collective over all devices): first the
message length, then its UTF-8 JSON bytes padded to a power-of-two bucket (a few compiled broadcasts in all). An
idle server broadcasts an empty message every ``idle_wait`` seconds, so the followers wait inside a collective.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from v41cp.serving.engine import Engine, SamplingParams

__all__ = ["Commands", "ControlPlane", "apply_commands", "broadcast_json", "drop", "follow", "release_finished"]


@dataclass
class Commands:
    """One iteration of rank 0's engine loop: ``ops`` in the order its engine applied them — ``("submit", rid,
    prompt ids, sampling fields)`` for each request it accepted, ``("cancel", rid)`` (a no-op for a request that is
    gone) — and ``close``: the loop stops after this message."""
    ops: list = field(default_factory=list)
    close: bool = False

    def encode(self) -> bytes:
        return json.dumps({"ops": self.ops, "close": self.close}).encode()

    @staticmethod
    def decode(data: bytes) -> "Commands":
        d = json.loads(data.decode())
        return Commands([tuple(op) for op in d["ops"]], bool(d["close"]))

    def submit(self, rid, prompt: list[int], sampling: SamplingParams) -> None:
        if not isinstance(rid, (str, int)):
            raise TypeError(f"request ids of a multi-process server must be str or int, got {rid!r}")
        fields = asdict(sampling)
        fields["stop_token_ids"] = list(fields["stop_token_ids"])          # as JSON carries it
        self.ops.append(("submit", rid, [int(t) for t in prompt], fields))

    def cancel(self, rid) -> None:
        self.ops.append(("cancel", rid))


class ControlPlane:
    """Broadcasts rank 0's `Commands` to every process (``exchange``: rank 0 passes its message, the followers
    None; everyone gets rank 0's)."""

    def __init__(self):
        import jax

        self.rank, self.processes = jax.process_index(), jax.process_count()
        self._shut = False

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def shutdown(self) -> None:
        """Leave the distributed runtime in order (`jax.distributed.shutdown`: a barrier with the other processes),
        once this process's loop has sent or received the closing message; idempotent."""
        import jax

        if not self._shut:
            self._shut = True
            jax.distributed.shutdown()

    def exchange(self, commands: Commands | None) -> Commands:
        if self.leader != (commands is not None):
            raise ValueError(f"rank {self.rank}: only rank 0 passes a message to exchange")
        got = broadcast_json(commands.encode() if self.leader else None, source=self.leader)
        return Commands.decode(got)


def broadcast_json(data: bytes | None, source: bool, min_bucket: int = 256) -> bytes:
    """Broadcast ``data`` from the one process that passes ``source=True`` (the others pass None) to every process;
    returns it everywhere. A collective: every process calls it at the same point. Two broadcasts
    (`multihost_utils.broadcast_one_to_all`): the length, then the bytes padded to a power-of-two bucket (at least
    ``min_bucket``), so a few compiled programs serve every message."""
    from jax.experimental import multihost_utils

    if source != (data is not None):
        raise ValueError("the source process passes the message, the others pass None")
    data = data if source else b""
    n = int(multihost_utils.broadcast_one_to_all(np.asarray([len(data)], np.int64), is_source=source)[0])
    bucket = max(min_bucket, 1 << (n - 1).bit_length())
    buf = np.zeros(bucket, np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=source))[:n].tobytes()


def drop(engine: Engine, rid) -> None:
    """Cancel request ``rid`` if it is still active and forget it (its pages and slot are free)."""
    req = engine.requests.get(rid)
    if req is not None:
        if req.status in ("waiting", "running"):
            engine.cancel(rid)
        engine.release(rid)


def apply_commands(engine: Engine, commands: Commands) -> None:
    """A follower's side of one iteration: the leader's submits and cancels, in its order. A submit the leader's
    engine accepted and this one refuses means the engines diverged: raised."""
    for op in commands.ops:
        if op[0] == "submit":
            engine.submit(op[1], op[2], SamplingParams(**op[3]))
        elif op[0] == "cancel":
            drop(engine, op[1])
        else:
            raise ValueError(f"unknown control-plane operation {op[0]!r}")


def release_finished(engine: Engine) -> None:
    """Release every finished request, as the leader's loop does after each step once it has published them."""
    for rid in [rid for rid, r in engine.requests.items() if r.status in ("done", "cancelled")]:
        engine.release(rid)


def follow(engine: Engine, control: ControlPlane, timeout: float | None = None, on_timeout=None) -> int:
    """A follower rank's server loop: apply each broadcast iteration, step with the leader, until it closes.
    Returns the number of steps taken. ``timeout``: a watchdog thread calls ``on_timeout(message)`` when an exchange
    has waited that many seconds (a leader that hangs alive sends nothing and would be waited for forever; an idle
    leader still exchanges every iteration)."""
    steps = 0
    since: list[float | None] = [None]
    done = threading.Event()

    def watch():
        while not done.wait(min(1.0, timeout / 4)):
            if since[0] is not None and time.monotonic() - since[0] > timeout:
                on_timeout(f"rank {control.rank}: the leader sent nothing for {timeout:g} s")
                return

    if timeout is not None:
        threading.Thread(target=watch, name="v41cp-leader-watchdog", daemon=True).start()
    try:
        while True:
            since[0] = time.monotonic()
            commands = control.exchange(None)
            since[0] = None
            if commands.close:
                return steps
            steps += _follow_one(engine, commands)
    finally:
        done.set()


def _follow_one(engine: Engine, commands: Commands) -> int:
    """Apply one iteration's commands and step with the leader: the steps taken (0 or 1)."""
    apply_commands(engine, commands)
    steps = 0
    if engine.pending:
        try:
            engine.step()
            steps = 1
        except Exception:                # the leader's step failed too (the same program): it drops every request
            for rid in list(engine.requests):
                drop(engine, rid)
        release_finished(engine)
    return steps

"""The multi-host control plane's messages and their application, in one process: a follower engine that applies the
leader's `Commands` (submits and cancels, in the leader's order) and steps with it stays in lock-step — the same
requests, tokens and free pages after every step — and a command the follower refuses is raised, not skipped."""

import pytest

from v41cp.checkpoint import default_checkpoint, load
from v41cp.serving.engine import Capacity, Engine, SamplingParams
from v41cp.serving.multihost.control_plane import Commands, apply_commands, drop, release_finished

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)


def test_commands_round_trip_as_bytes():
    c = Commands()
    sampling = SamplingParams(max_new_tokens=3, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=7,
                              stop_token_ids=(9, 11), logprobs=2, prompt_logprobs=1, logit_bias=((5, -2.5),),
                              min_tokens=2, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                              grammar='{"grammars": [{"lark_grammar": "start: \\"a\\""}]}')
    c.submit("a", [5, 17, 42], sampling)
    c.submit(3, [1], SamplingParams())
    c.cancel("a")
    got = Commands.decode(c.encode())
    assert got.ops == [("submit", "a", [5, 17, 42], {"max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                                                     "top_k": 4, "min_p": 0.1, "seed": 7, "stop_on_eos": True,
                                                     "stop_token_ids": [9, 11], "logprobs": 2,
                                                     "prompt_logprobs": 1, "logit_bias": [[5, -2.5]],
                                                     "min_tokens": 2, "presence_penalty": 0.5,
                                                     "frequency_penalty": -1.0, "repetition_penalty": 1.25,
                                                     "grammar": '{"grammars": [{"lark_grammar": "start: \\"a\\""}]}'}),
                       ("submit", 3, [1], {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                           "min_p": 0.0, "seed": 0, "stop_on_eos": True, "stop_token_ids": [],
                                           "logprobs": None, "prompt_logprobs": None, "logit_bias": [],
                                           "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                           "repetition_penalty": 1.0, "grammar": None}),
                       ("cancel", "a")] and not got.close
    assert SamplingParams(**got.ops[0][3]) == sampling           # a follower rebuilds the leader's parameters
    with pytest.raises(TypeError, match="str or int"):
        c.submit(("a", 1), [1], SamplingParams())
    with pytest.raises(ValueError, match="unknown control-plane operation 'evict'"):
        apply_commands(None, Commands([("evict", "a")]))


def test_a_follower_applying_the_leaders_commands_stays_in_lock_step():
    cfg, params = load(default_checkpoint())
    cap = Capacity(max_batch=2, max_tokens=32, num_blocks=6)
    leader, follower = Engine(params, cfg, cap), Engine(params, cfg, cap)
    rounds = [[("submit", "a", [5, 17, 42], SamplingParams(max_new_tokens=6)),
               ("submit", "b", [9, 8, 7, 6], SamplingParams(max_new_tokens=5, temperature=0.8, seed=3))],
              [("submit", "c", [1, 2, 3], SamplingParams(max_new_tokens=4))],
              [("cancel", "b")], [], [], [], [], [], [], []]
    for ops in rounds:
        commands = Commands()
        for op in ops:                   # the leader applies its own operations and records them
            if op[0] == "submit":
                leader.submit(*op[1:])
                commands.submit(*op[1:])
            else:
                drop(leader, op[1])
                commands.cancel(op[1])
        apply_commands(follower, Commands.decode(commands.encode()))
        for eng in (leader, follower):
            if eng.pending:
                eng.step()
        assert {r: (q.status, q.output) for r, q in leader.requests.items()} == \
               {r: (q.status, q.output) for r, q in follower.requests.items()}
        assert leader.load() == follower.load()
        release_finished(leader)
        release_finished(follower)
    assert not leader.requests and not follower.requests
    assert leader.alloc.free_blocks == follower.alloc.free_blocks == leader.num_blocks
    # a submit the follower refuses (here: an id it still holds) means the engines diverged: raised
    follower.submit("x", [1, 2], SamplingParams(max_new_tokens=2))
    c = Commands()
    c.submit("x", [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already active"):
        apply_commands(follower, c)


def test_a_follower_gives_up_on_a_leader_that_sends_nothing():
    """`follow` with a timeout: an exchange that never returns (a leader hung alive) calls ``on_timeout`` within the
    bound; a leader that exchanges often (idle iterations) never does."""
    import threading
    import time
    from types import SimpleNamespace

    from v41cp.serving.multihost.control_plane import follow

    fired, messages = threading.Event(), []

    def on_timeout(message):
        messages.append(message)
        fired.set()

    class Hung:
        rank = 1

        def exchange(self, ops):
            fired.wait(10)                      # returns only once the watchdog fired
            raise RuntimeError("the test ends the wait")

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ends the wait"):
        follow(SimpleNamespace(pending=False), Hung(), timeout=0.5, on_timeout=on_timeout)
    assert messages == ["rank 1: the leader sent nothing for 0.5 s"] and time.monotonic() - t0 < 5

    class Idle:
        rank, calls = 1, 0

        def exchange(self, ops):
            self.calls += 1
            time.sleep(0.05)
            return Commands(close=self.calls > 30)

    messages.clear()
    assert follow(SimpleNamespace(pending=False), Idle(), timeout=0.5, on_timeout=on_timeout) == 0
    assert messages == []

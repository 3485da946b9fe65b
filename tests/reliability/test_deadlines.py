"""Every collective path runs under the Buffer's deadline: a stalled peer is named in time."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import waiting
from ubep.deadlines import _timeout_error

TIMEOUT_S = 1.0
STALL_S = 6 * TIMEOUT_S


def stalled_low_latency(transport: str) -> tuple[str, str, float]:
    """Rank 1 stalls before its low-latency dispatch; rank 0 must give up and name it."""
    me = dist.get_rank()
    with ubep.Buffer(
        hidden=128,
        num_experts=4,
        max_tokens_per_rank=8,
        transport=transport,
        timeout_s=TIMEOUT_S,
        low_latency=True,
    ) as buf:
        x = torch.randn(8, 128).to(torch.bfloat16)
        idx = torch.tensor([[0, 2]] * 8)
        if me == 1:
            time.sleep(STALL_S)
            return "stalled", "", STALL_S
        start = time.monotonic()
        try:
            got = buf.low_latency_dispatch(x, idx, 8, 4, async_finish=True)
            got.event.wait()
        except ubep.CommTimeoutError as error:
            return type(error).__name__, str(error), time.monotonic() - start
        return "returned", "", time.monotonic() - start


def test_low_latency_collective_path_names_a_stalled_peer_within_the_deadline():
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=60).outcomes(stalled_low_latency, "dist")
    kind, message, elapsed = outcomes[0].result
    assert kind == "CommTimeoutError", outcomes[0]
    assert "rank(s) 1" in message and "low-latency dispatch" in message, message
    assert elapsed < 3 * TIMEOUT_S + 1.0, elapsed  # within 3x the timeout (and the grace for a dead peer)


# -- what a backend failure says (issue 32, item 12) ------------------------------------------------

GLOO_CLOSED = (  # gloo's words when a peer's process ends (a SIGKILL, with two torchrun agents)
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:941. This is typically caused by a remote worker crashing. Check the logs of the remote "
    "worker before reporting an error."
)


def reported(message: str) -> str:
    """What a survivor's CommTimeoutError quotes of a backend failure with `message`."""
    error = _timeout_error(None, 1.0, "dispatch (tokens)", None, RuntimeError(message), None, None)
    return str(error).split("it reported: ", 1)[1].removesuffix(")")


def test_a_backend_reason_is_quoted_up_to_a_sentence_end_never_cut_mid_word():
    long_line = GLOO_CLOSED + "\nthe backtrace, line 2"
    assert reported(long_line) == GLOO_CLOSED[: GLOO_CLOSED.index(" Check the logs")]
    assert reported("Connection reset by peer") == "Connection reset by peer"  # short: whole
    one_sentence = "a reason without a sentence end " * 8  # longer than any cut: kept whole
    assert reported(one_sentence.strip()) == one_sentence.strip()


# -- a deadline shorter than the liveness period (issue 32, item 11) -------------------------------


class Clock:
    """A monotonic clock the test moves by hand: no assertion depends on how fast this host runs."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_deadline_shorter_than_the_liveness_period_is_kept(monkeypatch):
    clock, slept = Clock(), []
    monkeypatch.setattr(waiting, "time", clock)  # the wait's clock only
    deadline_s = waiting.LIVENESS_PERIOD_S / 5
    start = clock.now
    waiter = waiting.Waiter("combine", deadline_s, lambda r: False, lambda r: None, slept.append, yields=0)
    waiter.pause([1])  # at the start: nobody late yet
    assert slept == [pytest.approx(deadline_s)], slept  # it sleeps no longer than the deadline
    clock.now = start + deadline_s / 2
    waiter.pause([1])
    assert slept[-1] == pytest.approx(deadline_s / 2), slept  # the rest of the deadline
    clock.now = start + deadline_s
    said = rf"combine: no signal from rank\(s\) 1 after {deadline_s:g} s"
    with pytest.raises(ubep.CommTimeoutError, match=said):
        waiter.pause([1])  # the deadline, not the next liveness check, ends the wait


# -- stats(merge=True) keeps the Buffer's deadline and blame (issue 32, item 5) ---------------------

MERGE_TIMEOUT_S = 2.0


def merge_with_a_lost_peer(fault: str) -> tuple[str, list[int], list[int], float]:
    """Rank 1 stops (SIGSTOP) or dies (SIGKILL) after a call; rank 0 merges the stats."""
    me = dist.get_rank()
    pids: list[int] = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    with ubep.Buffer(
        hidden=128, num_experts=4, max_tokens_per_rank=8, stats=True, timeout_s=MERGE_TIMEOUT_S
    ) as buf:
        got = buf.dispatch(
            torch.ones(2, 128), topk_idx=torch.tensor([[0, 2], [1, 3]]), topk_weights=torch.ones(2, 2)
        )
        buf.combine(got.recv_x, got.handle)
        if me == 1:
            os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            return "woken", [], [], 0.0  # SIGCONT from rank 0, once it is done
        time.sleep(0.2)  # rank 1 stops or dies first
        start = time.monotonic()
        try:
            buf.stats(merge=True)
            seen = ("returned", [], [])
        except ubep.CommTimeoutError as error:
            seen = (str(error), error.peers, error.dead_peers)
        finally:
            if fault == "stop":
                os.kill(pids[1], signal.SIGCONT)
        return (*seen, time.monotonic() - start)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_merging_stats_with_a_stopped_or_dead_peer_names_it_within_the_deadline(fault):
    """It waited for the process group's timeout (30 min by default) with a stopped peer, and raised
    gloo's bare RuntimeError naming no rank with a dead one."""
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=90).outcomes(merge_with_a_lost_peer, fault)
    assert outcomes[0].ok, outcomes[0].error
    message, peers, dead, elapsed = outcomes[0].result
    assert message.startswith("stats (merge): "), message
    assert peers == [1] and dead == ([1] if fault == "kill" else []), message
    assert "rank(s) 1 stopped" in message if fault == "stop" else "rank(s) 1 died" in message, message
    assert elapsed < 3 * MERGE_TIMEOUT_S + 1.0, elapsed  # the Buffer's deadline, not the group's

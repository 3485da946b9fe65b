"""A fabric's close waits for its sends in flight (issue 45): a rank that sends its last message and
closes at once must not lose it. On gloo a send leaves only once its receiver has posted a receive
for it, and the receiver posts the inbox of a call parity again only when it frees the message
before; so the last message of a rank that runs two calls ahead waits for its peer, and a close
that shut the group down at once dropped it (the peer then named the sender as lost).
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep.across.fabric import Lane, open_fabric
from ubep.calls import CallId

NO_ZMQ = pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq is not installed")
HAS_NIXL = any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13"))
NO_NIXL = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
TIMEOUT_S = 10.0
SEQS = (1, 3)  # one call parity: the second message waits until the first's inbox is freed


def sent_then_closed(fabric_name: str) -> list[int]:
    """Rank 1 sends its messages of calls SEQS to rank 0 and closes at once; rank 0 reads them a while
    later. Returns the payload words rank 0 read (rank 1: none)."""
    me = dist.get_rank()
    if fabric_name == "nixl":
        os.environ["UCX_TLS"] = "tcp"  # as between hosts
    fabric, _ = open_fabric(fabric_name, None, me, 2, [Lane("rows", 1, 8)], TIMEOUT_S)
    if me == 1:
        for seq in SEQS:
            out = fabric.outbox("rows", 0, CallId(seq, seq, "dispatch"), 1, 8)
            out.header[0] = seq
            out.payload.view(torch.int64)[0] = 100 + seq
            fabric.send(out)
        fabric.close()
        return []
    time.sleep(0.5)  # rank 1 is in its close by now (not a bound on a wait: the deadline is TIMEOUT_S)
    got = []
    try:
        for seq in SEQS:
            call = CallId(seq, seq, "dispatch")
            fabric.begin(call)
            for msg in fabric.arrivals("rows", call, [1], "the last messages"):
                got.append(int(msg.payload.view(torch.int64)[0]))
                fabric.release("rows", msg.peer, call)
    finally:
        fabric.close()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fabric", ["gloo", pytest.param("zmq", marks=NO_ZMQ), pytest.param("nixl", marks=NO_NIXL)]
)
def test_a_rank_that_closes_right_after_its_last_send_still_delivers_it(fabric):
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=100).outcomes(sent_then_closed, fabric)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error}"
    assert outcomes[0].result == [100 + seq for seq in SEQS]


def closed_while_a_peer_still_connects() -> bool:
    """Rank 1 opens a zmq fabric and closes it at once; rank 0 is slow to connect its own DEALERs
    (it sleeps right after the address exchange). Returns whether rank 0's construction ended."""
    me = dist.get_rank()
    if me == 0:
        gather = dist.all_gather_object

        def slow_gather(*args, **kwargs):
            gather(*args, **kwargs)
            time.sleep(1.0)  # rank 1's own connections come up meanwhile

        dist.all_gather_object = slow_gather
    fabric, _ = open_fabric("zmq", None, me, 2, [Lane("rows", 1, 8)], TIMEOUT_S)
    fabric.close()
    return True


@NO_ZMQ
@pytest.mark.timeout(120)
def test_a_rank_cannot_leave_zmq_construction_before_a_slower_peer_is_connected():
    """Before READY, rank 1 left construction once its own connection was up, closed and exited;
    rank 0 then raised "rank 1 died" in its own construction (seen in CI under load)."""
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=100).outcomes(closed_while_a_peer_still_connects)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error}"

"""The transport interface on its own: layout, publish/read with bounds, landed order, inboxes,
aborts and deadlines, on a virtual world (threads of this process, no rank processes)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ubep.calls import CallId
from ubep.errors import CommTimeoutError, PeerDataError
from ubep.transport.base import Field, Header, Region
from ubep.transport.heap import Layout
from ubep.transport.virtual import VirtualRank, VirtualWorld, virtual_heap
from ubep.waiting import PeerAbortedError

ROUTE = Header(
    "t.route", (Field("n", hi=10, says="announced {value} rows, at most {hi}"), Field("c", length=3))
)
INBOX = Header("t.inbox", (Field("rows"),), inbox=True)
DATA = Region("t.data", (4, 8), torch.int64, double=True)
BLOCKS = (ROUTE, INBOX, DATA)
CALL = CallId(seq=1, epoch=1, kind="test")


def heaps(world: VirtualWorld, timeout_s: float = 2.0):
    """Every rank's heap, built collectively from threads."""
    return world.run(lambda rank: virtual_heap(BLOCKS, rank, timeout_s))


def test_layout_places_every_block_aligned_and_double_buffered_twice():
    layout = Layout(3, BLOCKS)
    starts = [offset for offset, _, _ in layout.offsets.values()]
    assert all(s % 64 == 0 for s in starts) and len(set(starts)) == len(starts)
    assert ("t.data", 1) in layout.offsets and ("t.inbox", 1) in layout.offsets
    assert layout.offsets[("t.inbox", 0)][1] == (3, 2)  # one record (stamp + rows) per writer
    with pytest.raises(ValueError, match="two blocks"):
        Layout(2, (DATA, Region("t.data", (1,), torch.int64)))


def test_published_record_reads_back_typed_and_a_bad_value_names_the_rank():
    a, b = heaps(VirtualWorld(2))
    assert not b.stamped(ROUTE, CALL, 0)
    a.view(DATA, 0, CALL).fill_(7)  # payload before the stamp
    a.publish(ROUTE, CALL, {"n": 4, "c": [1, 2, 3]})
    assert b.stamped(ROUTE, CALL, 0)
    got = b.read(ROUTE, CALL, 0)
    assert got["n"] == 4 and got["c"].tolist() == [1, 2, 3]
    assert int(b.view(DATA, 0, CALL).sum()) == 7 * 32
    a.publish(ROUTE, CALL, {"n": 11, "c": [0, 0, 0]})
    with pytest.raises(PeerDataError, match=r"t\.route: rank 0 announced 11 rows, at most 10"):
        b.read(ROUTE, CALL, 0)


def test_halves_follow_the_epoch_parity():
    a, _ = heaps(VirtualWorld(2))
    even, odd = CallId(2, 2), CallId(3, 3)
    a.view(DATA, 0, even).fill_(1)
    a.view(DATA, 0, odd).fill_(2)
    assert int(a.view(DATA, 0, even)[0, 0]) == 1 and int(a.view(DATA, 0, odd)[0, 0]) == 2


def test_landed_yields_in_arrival_order_and_inbox_rows_are_per_writer():
    world = VirtualWorld(3)
    order = []

    def rank_body(rank: VirtualRank):
        heap = virtual_heap(BLOCKS, rank, 5.0)
        if rank.rank == 0:
            order.extend(heap.landed(INBOX, CALL, [1, 2], "inbox"))
            return [heap.read(INBOX, CALL, p)["rows"] for p in (1, 2)]
        time.sleep(0.3 if rank.rank == 1 else 0.0)  # rank 2 writes first
        heap.publish(INBOX, CALL, {"rows": 10 * rank.rank}, to=0)
        return None

    results = world.run(rank_body)
    assert order == [2, 1]
    assert results[0] == [10, 20]


def test_a_silent_peer_is_named_at_the_deadline():
    a, _ = heaps(VirtualWorld(2), timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"phase x: no signal from rank\(s\) 1"):
        list(a.landed(ROUTE, CALL, [1], "phase x"))
    assert 1.0 <= time.monotonic() - start < 3 * 1.0 + 1.0  # at the deadline (docs/reliability.md's bound)


def test_an_aborting_peer_ends_the_wait_at_once():
    a, b = heaps(VirtualWorld(2), timeout_s=10.0)
    threading.Timer(0.1, lambda: b.abort(CALL)).start()
    start = time.monotonic()
    with pytest.raises(PeerAbortedError, match="rank 1 aborted"):
        list(a.landed(ROUTE, CALL, [1], "phase y"))
    assert time.monotonic() - start < 10.0  # before the deadline


def test_an_inbox_needs_a_target_and_an_own_record_refuses_one():
    a, _ = heaps(VirtualWorld(2))
    with pytest.raises(ValueError, match="inbox"):
        a.publish(INBOX, CALL, {"rows": 1})
    with pytest.raises(ValueError, match="inbox"):
        a.publish(ROUTE, CALL, {"n": 1}, to=1)

"""Elastic expert parallelism (issue 43, items 2 and 4): redundant experts carry a dead rank's load,
the staying ranks place experts again without it, a late rank is never masked, and a split group
never goes on as two.

Redundant copies: 6 ranks, 6 logical experts on 12 slots, each expert on one rank of two hosts.
Ranks die (one, or a whole host) between two calls, so every survivor meets the death inside a
dispatch (on_peer_failure="mask"); every combine is checked bit for bit against the result of the
same logical routing with no failure at all (small integers and dyadic weights: every float32 sum
is exact, however the copies group the terms), with nothing dropped. Then the survivors set a
placement among themselves and run 50 more exact calls.

Partition: a "cut" fault (`ubep.faults`) drops everything each side sends the other over the fabric,
every process alive; the side without a quorum raises PartitionError, the other goes on exact.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from shrinkcase import buffer, normal_call
from test_peer_failure_mask import checked_pair

import ubep
from ubep.faults import FaultPlan
from ubep.membership import quorum
from ubep.placement import Placement
from ubep.transport.virtual import VirtualRank, VirtualWorld

R, E, L, K, H, T = 6, 6, 2, 3, 16, 8  # ranks, logical experts, slots per rank, top-k, hidden, tokens
FAULT_PAIR = 3  # the pair whose dispatch meets the deaths
PAIRS_AFTER = 25  # 50 calls after the placement among survivors


def two_host_copies(host: int) -> Placement:
    """Logical expert e on rank e and on rank (e + host) % R: one copy on each of two hosts of `host`
    ranks (slot 2r holds expert r, slot 2r + 1 expert (r - host) % R)."""
    logical = [e for r in range(R) for e in (r, (r - host) % R)]
    return Placement.from_list(logical, num_ranks=R, num_logical=E)


def on_ranks(ranks: list[int], skip: int | None = None) -> Placement:
    """The slots of `ranks` hold the logical experts in turn (never `skip`); the other ranks' slots
    hold them in turn from expert 0 (so every expert has a copy somewhere)."""
    experts = [e for e in range(E) if e != skip]
    order = ranks + [r for r in range(R) if r not in ranks]
    logical = [0] * (R * L)
    live = len(ranks) * L
    for j, slot in enumerate(s for r in order for s in range(r * L, (r + 1) * L)):
        logical[slot] = experts[j % len(experts)] if j < live else (j - live) % E
    return Placement.from_list(logical, num_ranks=R, num_logical=E)


def inputs(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (x float32 [n, H] small integers, logical topk_idx [n, K] some -1, dyadic weights)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = int(torch.randint(1, T + 1, (1,), generator=g))
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    idx[torch.rand(n, K, generator=g) < 0.1] = -1
    x = torch.randint(-8, 9, (n, H), generator=g).to(torch.float32)
    w = 2.0 ** -torch.randint(1, 4, (n, K), generator=g).to(torch.float32)
    return x, idx, w


def expert(logical_MK: torch.Tensor, w_MK: torch.Tensor, x_MH: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: row m gets sum over valid k of w[m, k] * (expert + 1) * x[m]."""
    scale_M = torch.where(logical_MK >= 0, w_MK * (logical_MK + 1).to(torch.float32), 0.0).sum(dim=1)
    return scale_M[:, None] * x_MH


def placed_pair(buf: ubep.Buffer, seed: int) -> None:
    """One dispatch and combine under the Buffer's placement, against the logical routing's result with
    no rank missing (the tokens' own rows: independent of who holds which copy); nothing dropped."""
    me = buf.rank
    x, idx, w = inputs(seed, me)
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    slots = buf.placement.local_logical(me)
    logical = torch.where(got.recv_topk_idx >= 0, slots[got.recv_topk_idx.clamp(min=0)], -1)
    out = buf.combine(expert(logical, got.recv_topk_weights, got.recv_x), got.handle)
    where = f"pair {seed} rank {me} masked {list(buf.masked_ranks)}"
    assert torch.equal(out.combined_x, expert(idx, w, x)), where
    assert got.handle.num_dropped == 0, where
    assert not bool(buf.left_out(idx).any()), where


def copies_carry_the_load(transport: str, host: int, dying: list[int]) -> dict:
    me = dist.get_rank()
    on = {"on_peer_failure": "mask", "transport": transport}
    sizes = {"hidden": H, "num_experts": R * L, "max_tokens_per_rank": T, "max_topk": K}
    with ubep.Buffer(timeout_s=3.0, **sizes, **on) as buf:
        buf.set_placement(two_host_copies(host))
        for seed in range(FAULT_PAIR):
            placed_pair(buf, seed)
        dist.barrier()  # every rank finished the pair before: the deaths meet the next dispatch
        if me in dying:
            os.kill(os.getpid(), signal.SIGKILL)
        placed_pair(buf, FAULT_PAIR)
        masked = list(buf.masked_ranks)
        for seed in range(100, 105):  # the two-host placement still, its lost copies left aside
            placed_pair(buf, seed)
        survivors = [r for r in range(R) if r not in dying]
        with pytest.raises(ValueError, match=r"logical expert\(s\) \[0\] only on masked rank"):
            buf.set_placement(on_ranks(survivors, skip=0))
        buf.set_placement(on_ranks(survivors))
        for seed in range(200, 200 + PAIRS_AFTER):
            placed_pair(buf, seed)
    return {"masked": masked}


COPIES = [  # (transport, host size, the ranks that die)
    ("shm", 3, [1]),  # one rank of one host
    ("shm", 3, [3, 4, 5]),  # a whole host: the other keeps exactly half, with rank 0
    ("dist", 2, [2, 3]),  # three emulated hosts over the fabric, the middle one lost
    ("dist", 3, [4]),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,host,dying", COPIES)
def test_redundant_copies_carry_a_dead_ranks_tokens_and_the_survivors_place_again(transport, host, dying):
    per_node = host if transport == "dist" else None
    launch = ubep.LocalLaunch(world_size=R, ranks_per_node=per_node, timeout_s=220)
    outcomes = launch.outcomes(copies_carry_the_load, transport, host, dying)
    for o in outcomes:
        if o.rank in dying:
            assert o.cause == "died", (o.rank, o.cause, o.error)
        else:
            assert o.ok, (o.rank, o.cause, o.error)
            assert o.result["masked"] == dying, (o.rank, o.result)


# -- slow is not dead ----------------------------------------------------------------------------------

SLOW, DEADLINE_S = 1, 3.0


def late_before_every_call(transport: str) -> list[int]:
    """Rank SLOW sleeps half the deadline before each of 24 calls: nobody masks it, all exact."""
    with buffer(None, "ubep", timeout_s=DEADLINE_S, on_peer_failure="mask", transport=transport) as buf:
        for seed in range(12):
            if buf.rank == SLOW:
                time.sleep(DEADLINE_S / 2)
            normal_call(buf, seed, set())
        return list(buf.masked_ranks)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_a_rank_late_by_half_the_deadline_before_every_call_is_never_masked(transport):
    got = ubep.LocalLaunch(world_size=3, timeout_s=160).run(late_before_every_call, transport)
    assert got == [[]] * 3, got


# -- a split is not two worlds --------------------------------------------------------------------------


def test_the_quorum_rule():
    """A strict majority of the ranks in goes on; on an exact half, the side with the lowest of them."""
    everyone = range(6)
    assert quorum(everyone, [0, 1, 2, 3]) and not quorum(everyone, [4, 5])
    assert quorum(everyone, [0, 1, 2]) and not quorum(everyone, [3, 4, 5])
    assert quorum(everyone, [0, 4, 5]) and not quorum(everyone, [1, 2, 3])
    assert quorum([1, 2, 4, 5], [1, 2]) and not quorum([1, 2, 4, 5], [4, 5])  # rank 0 masked before
    assert not quorum(everyone, [])
    for n in range(1, 9):  # two sides of a split never both hold it
        for side in range(1 << n):
            a = [r for r in range(n) if side >> r & 1]
            b = [r for r in range(n) if not side >> r & 1]
            assert not (quorum(range(n), a) and quorum(range(n), b)), (n, a, b)


def split(transport: str, sides: list[list[int]]) -> str:
    """Every rank cuts its link to the other side at the 4th pair's dispatch (a "cut" fault: both sides'
    processes alive, each unable to reach the other). The side with a quorum masks the other and goes
    on exact for 25 pairs; every rank of the other raises PartitionError."""
    me = dist.get_rank()
    others = next(s for s in sides if me not in s)
    at = 2 * FAULT_PAIR + 1  # the 4th pair's dispatch
    plan = FaultPlan(rank=me, point="dispatch.start", action="cut", call=at, peers=tuple(others))
    on = {"faults": plan, "on_peer_failure": "mask", "transport": transport, "fabric": "zmq"}
    with buffer(None, "ubep", timeout_s=3.0, **on) as buf:
        for seed in range(FAULT_PAIR):
            checked_pair(buf, seed)
        dist.barrier()  # every rank finished the pair before the cut
        try:
            checked_pair(buf, FAULT_PAIR)
        except ubep.PartitionError as error:
            with pytest.raises(RuntimeError, match="split without a quorum"):
                checked_pair(buf, FAULT_PAIR + 1)  # and its Buffer takes no further call
            return f"PartitionError lost {error.lost}"
        for seed in range(100, 125):
            checked_pair(buf, seed)
        return f"on without {list(buf.masked_ranks)}"


SPLITS = [
    ([[0, 1, 2, 3], [4, 5]], 3),  # the majority goes on
    ([[0, 1, 2], [3, 4, 5]], 3),  # an exact half: the side of rank 0 goes on
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sides,host", SPLITS)
def test_a_partition_leaves_one_side_going_on_and_the_other_raises(sides, host):
    pytest.importorskip("zmq")
    launch = ubep.LocalLaunch(world_size=R, ranks_per_node=host, timeout_s=220)
    outcomes = launch.outcomes(split, "dist", sides)
    going, stopping = sides
    for o in outcomes:
        assert o.ok, (o.rank, o.cause, o.error)
        want = f"on without {stopping}" if o.rank in going else f"PartitionError lost {going}"
        assert o.result == want, (o.rank, o.result)


def masking_a_side(rank: VirtualRank, sides: list[list[int]], done: threading.Barrier) -> str:
    """mask_ranks applies the rule too: each side masks the other; only the side with a quorum goes on."""
    with buffer(rank, "ubep", timeout_s=10) as buf:
        normal_call(buf, 0, set())
        done.wait()
        others = next(s for s in sides if rank.rank not in s)
        try:
            buf.mask_ranks(others)
        except ubep.PartitionError as error:
            assert f"rank {rank.rank} stops" in str(error) and error.lost == others, str(error)
            return "stopped"
        normal_call(buf, 1, set(others))
        return "on"


def test_mask_ranks_on_the_side_without_a_quorum_raises_partition_error():
    done = threading.Barrier(R)
    sides = [[1, 2, 4, 5], [0, 3]]
    got = VirtualWorld(R, timeout_s=60).run(lambda rank: masking_a_side(rank, sides, done))
    assert got == ["stopped", "on", "on", "stopped", "on", "on"], got

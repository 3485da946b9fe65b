"""Set-ups that failed under load (issue 45): every layer that builds something collectively waits
construction's deadline, and a fabric's group on a subgroup meets no other subgroup's.

- A rank late to a layer's construction (load, a slow import: here a rank that sleeps past the
  calls' `timeout_s`, well within construction's) is waited for: the fabric's group, its pid
  exchange, a collective path's pid exchange and hier's rail and node groups each waited the
  calls' 2 s, so a loaded host failed the set-up ("Buffer construction (fabric): rank(s) 1 did
  not arrive", low latency over dist alike).
- Two subgroups building a Buffer over the fabric side by side: `dist.new_group` named both
  fabric groups alike (its name counts the groups every rank of the world made), so the later
  one read the earlier one's addresses in the store and timed out connecting.

Each set-up then makes one dispatch + combine, checked against `ubep.reference`.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, expert_output

import ubep
import ubep.buffer
from ubep import reference
from ubep.deadlines import CONSTRUCTION_MIN_TIMEOUT_S

HAS_NIXL = any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13"))
NO_NIXL = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
NO_ZMQ = pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq is not installed")
TIMEOUT_S = 2.0  # the calls' deadline
LATE_S = TIMEOUT_S + 1.5  # how late the slow rank reaches its layers' construction
assert LATE_S < CONSTRUCTION_MIN_TIMEOUT_S / 2  # construction's deadline leaves room for load besides
SLOW = 1


def round_exact(buf: ubep.Buffer, sc: Scenario, me: int) -> bool:
    """One dispatch + combine of `sc` as rank `me` of `buf`'s group, against the reference."""
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    out = buf.combine(expert_output(got.recv_x, me), got.handle)
    ys = [expert_output(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    combined = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    return torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(out.combined_x, combined)


def late(build):
    """`build` (the exchanges' construction, after the Buffer's handshake), reached LATE_S late."""

    def slow(*args, **kwargs):
        time.sleep(LATE_S)
        return build(*args, **kwargs)

    return slow


R = 4  # two emulated nodes of two (hier's rails); dist reaches every peer directly
SC = Scenario(name="late", num_ranks=R, num_experts=8, hidden=32, topk=2, tokens=(6,) * R, seed=5)


def late_rank(transport: str, protocol: str, fabric: str) -> str:
    """Rank SLOW reaches the exchanges' construction LATE_S late; every rank then makes a round.
    Returns "exact", "wrong" or the error."""
    me = dist.get_rank()
    if me == SLOW:
        ubep.buffer.build = late(ubep.buffer.build)
    try:
        with ubep.Buffer(
            hidden=SC.hidden,
            num_experts=SC.num_experts,
            max_tokens_per_rank=6,
            transport=transport,
            protocol=protocol,
            fabric=fabric,
            timeout_s=TIMEOUT_S,
            low_latency=True,  # its own construction too, where it has one (LLDist's pid exchange)
        ) as buf:
            exact = round_exact(buf, SC, me)
            dist.barrier()  # no rank closes while a peer's last message from it may be in flight
            return "exact" if exact else "wrong"
    except ubep.UbepError as error:
        return f"{type(error).__name__}: {error}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("transport", "protocol", "fabric"),
    [
        ("dist", "ubep", "gloo"),  # the fabric's group and pid exchange
        pytest.param("dist", "ubep", "zmq", marks=NO_ZMQ),  # its address exchange and connections
        pytest.param("dist", "ubep", "nixl", marks=NO_NIXL),  # its metadata exchange and first notices
        ("dist", "bsp", "gloo"),  # the collective paths' pid exchanges (normal and low-latency)
        ("hier", "ubep", "gloo"),  # the rail and node groups, and the fabric over the rails
    ],
)
def test_a_rank_late_to_construction_is_waited_for(transport, protocol, fabric):
    launch = ubep.LocalLaunch(world_size=R, ranks_per_node=2, timeout_s=100)
    said = launch.run(late_rank, transport, protocol, fabric)
    assert said == ["exact"] * R, said


HALVES, HALF = 2, 4  # two subgroups of four ranks: [0, 1, 2, 3] and [4, 5, 6, 7]
QUAD = Scenario(name="quad", num_ranks=HALF, num_experts=8, hidden=32, topk=2, tokens=(6,) * HALF, seed=9)


def side_by_side(fabric: str) -> str:
    """Each half of the world builds a Buffer over the fabric on its own subgroup, the second half a
    moment after the first (its fabric group is made after the first one's is)."""
    me = dist.get_rank()
    groups = [dist.new_group(list(range(h * HALF, (h + 1) * HALF))) for h in range(HALVES)]
    mine = groups[me // HALF]
    if me // HALF == 1:
        time.sleep(1.0)
    try:
        with ubep.Buffer(
            mine,
            hidden=QUAD.hidden,
            num_experts=QUAD.num_experts,
            max_tokens_per_rank=6,
            transport="dist",
            fabric=fabric,
            timeout_s=TIMEOUT_S,
        ) as buf:
            exact = round_exact(buf, QUAD, mine.rank())
            dist.barrier(mine)  # no rank closes while a peer's last message from it may be in flight
            return "exact" if exact else "wrong"
    except ubep.UbepError as error:
        return f"{type(error).__name__}: {error}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fabric", ["gloo", pytest.param("zmq", marks=NO_ZMQ), "auto"])
def test_two_subgroups_build_over_the_fabric_side_by_side(fabric):
    """gloo: the fabric's own group; zmq and auto's choice: over the Buffer's group (NIXL's fabric,
    the same way, makes no group either)."""
    said = ubep.LocalLaunch(world_size=HALVES * HALF, timeout_s=100).run(side_by_side, fabric)
    assert said == ["exact"] * HALVES * HALF, said

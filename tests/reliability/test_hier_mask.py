"""Masking across hosts on `hier` (issue 43, item 1): a whole node lost, its ranks masked (by
`mask_ranks`, or inside the call that meets the loss with on_peer_failure="mask"), and the survivors'
rails leave its slot out; every later call is checked bit for bit against the reference fed the
same membership (`shrinkcase.normal_call`, `test_peer_failure_mask.checked_pair`). Masking one rank of
a node whose other ranks stay (its rail's forwarder there) is refused with an error naming it.

Nodes are emulated on this host (`LocalLaunch(ranks_per_node=2)`): rails cross over the fabric.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
from shrinkcase import buffer, normal_call
from test_peer_failure_mask import checked_pair

import ubep

WORLD, PER_NODE = 6, 2  # nodes (0, 1), (2, 3), (4, 5); rails (0, 2, 4) and (1, 3, 5)
LOST_NODE = (4, 5)
TIMEOUT_S = 3.0
CALLS_AFTER = 25  # dispatch + combine pairs after the loss: 50 calls


def lost_node(fabric: str, how: str) -> dict:
    """A checked pair on every rank; then every rank of LOST_NODE kills itself, and the survivors go
    on without it: "mask_ranks" (the next call fails naming a rank of it, then they mask the node) or
    "inside" (on_peer_failure="mask": the next pair is finished without it). Returns this survivor's
    error (mask_ranks only), the ranks masked, and how many of CALLS_AFTER pairs were exact after."""
    me = dist.get_rank()
    on_failure = "mask" if how == "inside" else "raise"
    hier = {"transport": "hier", "fabric": fabric, "on_peer_failure": on_failure}
    with buffer(None, "ubep", TIMEOUT_S, low_latency=False, **hier) as buf:
        normal_call(buf, 0, set())
        dist.barrier()  # the pair before is every rank's: the loss meets the next one
        if me in LOST_NODE:
            os.kill(os.getpid(), signal.SIGKILL)
        error = "none"
        if how == "inside":
            checked_pair(buf, 1)
        else:
            try:
                normal_call(buf, 1, set())
            except ubep.UbepError as e:
                error = f"{type(e).__name__}: {e}"
            buf.mask_ranks(LOST_NODE)
        masked = set(buf.masked_ranks)
        for seed in range(100, 100 + CALLS_AFTER):
            normal_call(buf, seed, masked)
        return {"error": error, "masked": sorted(masked), "exact": CALLS_AFTER}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fabric", ["zmq", "gloo"])
@pytest.mark.parametrize("how", ["mask_ranks", "inside"])
def test_a_lost_node_is_masked_and_the_survivors_rails_go_on_exactly(fabric, how):
    launch = ubep.LocalLaunch(world_size=WORLD, ranks_per_node=PER_NODE, timeout_s=200)
    outcomes = launch.outcomes(lost_node, fabric, how)
    for o in outcomes:
        if o.rank in LOST_NODE:
            assert o.cause == "died", (o.rank, o.cause, o.error)
            continue
        assert o.ok, f"rank {o.rank}: {o.error}"
        assert o.result["masked"] == list(LOST_NODE), (o.rank, o.result)
        error = o.result["error"]
        if how == "mask_ranks":  # a ubep error that names a rank of the lost node
            assert error.startswith(("CommTimeoutError", "PeerAbortedError")), (o.rank, error)
            assert any(f"rank {r}" in error or f"rank(s) {r}" in error for r in LOST_NODE), (o.rank, error)


def one_rank_of_a_node() -> str:
    """Every rank masks rank 3 (node 1's second rank, rail (1, 3)'s forwarder there); returns what
    mask_ranks raised ("none": it returned)."""
    with buffer(None, "ubep", TIMEOUT_S, low_latency=False, transport="hier") as buf:
        normal_call(buf, 0, set())
        try:
            buf.mask_ranks([3])
        except NotImplementedError as e:
            return str(e)
        return "none"


@pytest.mark.timeout(120)
def test_masking_one_rank_of_a_node_on_hier_is_refused_naming_it():
    launch = ubep.LocalLaunch(world_size=4, ranks_per_node=PER_NODE, timeout_s=100)
    outcomes = launch.outcomes(one_rank_of_a_node)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error}"
    assert outcomes[3].result == "none"  # it masked itself: it retires
    for o in outcomes[:3]:
        assert "rank(s) [3] of node 1 are masked" in o.result, (o.rank, o.result)

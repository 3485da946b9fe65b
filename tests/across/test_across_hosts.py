"""UBEP across hosts (issue 31): protocol "ubep" on transports "dist" (every peer over the fabric) and
"hier" (rails over the fabric, a heap within each node), against the plain-torch reference.

- No torch.distributed collective runs inside a dispatch or combine, normal or low-latency: after
  construction every collective is made to raise, and the results still match the reference
  (2 nodes of 2 ranks, 2 nodes of 4, and every rank its own node).
- dist with ubep matches the reference on the core scenarios, FP8 and cached dispatch.
- `fabric="auto"` runs zmq where every rank has pyzmq, else gloo on every rank, and `explain()` says
  which and why.
- Failures across hosts: a killed peer is named by every survivor within its deadline, and after
  `mask_ranks` the survivors' calls are exact; a stopped peer likewise; a late message of a call the
  others gave up on is never taken for a later call.

Nodes are emulated on this host (`LocalLaunch(ranks_per_node=...)`): traffic between them really
goes over the fabric (its default engine, zmq where pyzmq is installed, over loopback TCP).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, assert_dispatch_matches, expert_output, scenarios_for

import ubep
from ubep import reference

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "monitored_barrier", "new_group",
)  # fmt: skip


class NoCollectives:
    """While entered, every torch.distributed collective raises (point-to-point sends stay)."""

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def refuse(name):
            def collective(*args, **kwargs):
                raise AssertionError(f"torch.distributed.{name} ran inside a call")

            return collective

        for name in self.saved:
            setattr(dist, name, refuse(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def normal_round(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    """Dispatch, combine (with weights), cached dispatch and combine, each against the reference."""
    xs, idxs, ws, ref = sc.expected()
    where = f"{sc.name} rank {me}"
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    assert_dispatch_matches(got, ref[me], where)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
    tol = {} if want.dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}  # hier groups by node
    torch.testing.assert_close(out.combined_x, want, **({"rtol": 0, "atol": 0} | tol), msg=where)
    assert torch.equal(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0)), where
    again = buf.dispatch(xs[me] * 2, handle=got.handle)
    assert torch.equal(again.recv_x, ref[me].recv_x_MH * 2), where


def ll_round(buf: ubep.Buffer, sc: Scenario, me: int, hook: bool) -> None:
    """A low-latency dispatch and combine (by hook or at once) against the reference."""
    xs, idxs, ws = sc.inputs()
    T, E = sc.capacity, sc.num_experts
    ref = reference.low_latency_dispatch(xs, idxs, E, T)
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, E, return_recv_hook=hook)
    if hook:
        got.hook()
    counts = ref[me].recv_count_L
    assert torch.equal(got.recv_count, counts), me
    for j, c in enumerate(counts.tolist()):
        assert torch.equal(got.recv_x[j, :c], ref[me].recv_x_LMX[j, :c]), (me, j)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle, return_recv_hook=hook)
    if hook:
        out.hook()
    assert torch.equal(out.combined_x, reference.low_latency_combine(ys, ref, idxs, ws)[me]), me


def without_collectives(transport: str) -> int:
    """Build (collective), then every call with collectives refused."""
    me, R = dist.get_rank(), dist.get_world_size()
    scs = [
        Scenario(name=f"fabric-{i}", num_ranks=R, num_experts=4 * R, capacity=16, seed=40 + i)
        for i in range(2)
    ]
    with ubep.Buffer(
        hidden=64,
        num_experts=4 * R,
        max_tokens_per_rank=16,
        transport=transport,
        timeout_s=30,
        low_latency=True,
    ) as buf:
        assert "no collective inside a call" in buf.explain(), buf.explain()
        with NoCollectives():
            for sc in scs:
                normal_round(buf, sc, me)
                ll_round(buf, sc, me, hook=True)
                ll_round(buf, sc, me, hook=False)
    return len(scs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("transport", "world_size", "per_node"), [("hier", 4, 2), ("hier", 8, 4), ("dist", 4, 2), ("hier", 2, 1)]
)
def test_no_collective_runs_inside_a_call(transport, world_size, per_node):
    launch = ubep.LocalLaunch(world_size=world_size, ranks_per_node=per_node, timeout_s=280)
    assert launch.run(without_collectives, transport) == [2] * world_size


def fp8_round(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    """An FP8 dispatch: values and scales each arrive as the reference moves them."""
    xs, idxs, ws = sc.inputs()
    pairs = [ubep.fp8.quantize(x.float()) for x in xs]
    got = buf.dispatch(pairs[me], topk_idx=idxs[me], topk_weights=ws[me])
    values = reference.dispatch([v for v, _ in pairs], idxs, ws, sc.num_experts)[me].recv_x_MH
    scales = reference.dispatch([s for _, s in pairs], idxs, ws, sc.num_experts)[me].recv_x_MH
    assert torch.equal(got.recv_x[0].view(torch.uint8), values.view(torch.uint8)), me
    assert torch.equal(got.recv_x[1], scales), me


def dist_matches_reference() -> int:
    me, R = dist.get_rank(), dist.get_world_size()
    checked = 0
    for sc in scenarios_for(R):
        with ubep.Buffer(
            hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity, transport="dist",
            timeout_s=30, low_latency=False,
        ) as buf:  # fmt: skip
            normal_round(buf, sc, me)
            checked += 1
    fp8 = Scenario(name="fp8", num_ranks=R, num_experts=4 * R, hidden=256, capacity=12, seed=7)
    with ubep.Buffer(
        hidden=256, num_experts=4 * R, max_tokens_per_rank=12, transport="dist", timeout_s=30
    ) as buf:
        fp8_round(buf, fp8, me)
    return checked


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dist_with_ubep_matches_the_reference(world_size):
    launch = ubep.LocalLaunch(world_size=world_size, timeout_s=380)
    assert launch.run(dist_matches_reference) == [len(scenarios_for(world_size))] * world_size


# -- failures ---------------------------------------------------------------------------------------

R, E, T, H = 3, 12, 8, 64
SC = Scenario(name="survivors", num_ranks=R, num_experts=E, hidden=H, capacity=T, seed=5)
VICTIM = 2
TIMEOUT_S = 4.0


def survivor_round(buf: ubep.Buffer, me: int, masked: set[int]) -> bool:
    """One dispatch + combine among the ranks that stay, each against the reference without `masked`."""
    xs, idxs, ws = SC.inputs()
    xs, idxs, ws = reference.without_ranks(xs, idxs, ws, masked, E)
    ref = reference.dispatch(xs, idxs, ws, E)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    ys = [expert_output(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    out = buf.combine(expert_output(got.recv_x, me), got.handle)
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    return torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(out.combined_x, want)


def lose_a_peer(how: str) -> tuple[str, float, bool]:
    """Rank VICTIM dies (or stops) in the second call; the survivors raise, mask it, and go on.
    Returns (the error, seconds to it, whether the calls after the mask are exact)."""
    me = dist.get_rank()
    pids: list[int | None] = [None] * R
    dist.all_gather_object(pids, os.getpid())
    with ubep.Buffer(
        hidden=H,
        num_experts=E,
        max_tokens_per_rank=T,
        transport="dist",
        timeout_s=TIMEOUT_S,
        low_latency=False,
    ) as buf:
        assert survivor_round(buf, me, set())
        if me == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        xs, idxs, ws = SC.inputs()
        start = time.monotonic()
        try:
            buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
            error = "none"
        except ubep.UbepError as e:
            error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        buf.mask_ranks([VICTIM])
        exact = all(survivor_round(buf, me, {VICTIM}) for _ in range(3))
        if how == "stop" and me == 0:
            os.kill(pids[VICTIM], signal.SIGKILL)  # the stopped rank never returns: end it
        return error, elapsed, exact


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_peer_is_named_within_the_deadline_and_the_survivors_go_on(how):
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=60).outcomes(lose_a_peer, how)
    for rank in (0, 1):
        assert outcomes[rank].ok, (rank, outcomes[rank].error)
        error, elapsed, exact = outcomes[rank].result
        assert error.startswith("CommTimeoutError") and f"rank(s) {VICTIM}" in error, error
        if how == "kill":  # its process is gone: named at once, not at the deadline
            assert "died" in error and elapsed < TIMEOUT_S, (error, elapsed)
        assert exact, f"rank {rank}: the calls after mask_ranks differ from the reference"


def late_message() -> tuple[str, bool]:
    """Rank 1 starts the first call only once the others gave up on it (at their deadline) and went on
    to the next; its message of that call then lands, and must not be taken for a later call's."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    with ubep.Buffer(
        hidden=H, num_experts=E, max_tokens_per_rank=T, transport="dist", timeout_s=2.0, low_latency=False
    ) as buf:
        xs, idxs, ws = SC.inputs()
        if me == 1:
            store.wait(["gave-up-0", "gave-up-2"])
        try:
            buf.dispatch(xs[me] * 3, topk_idx=idxs[me], topk_weights=ws[me])
            first = "none"
        except ubep.UbepError as e:
            first = type(e).__name__
        if me != 1:
            store.set(f"gave-up-{me}", "1")
        exact = all(survivor_round(buf, me, set()) for _ in range(3))
        return first, exact


@pytest.mark.timeout(120)
def test_a_late_message_of_an_abandoned_call_is_never_taken_for_a_later_one():
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=60).outcomes(late_message)
    for o in outcomes:
        assert o.ok, (o.rank, o.error)
    firsts = [o.result[0] for o in outcomes]
    assert firsts[0] in ("CommTimeoutError", "PeerAbortedError") and firsts[2] != "none", firsts
    assert [o.result[1] for o in outcomes] == [True] * R, outcomes


# -- which fabric "auto" picks ---------------------------------------------------------------------


def auto_fabric_says(without_zmq: int | None) -> tuple[str, bool]:
    """(explain(), whether a round was exact) of a Buffer with fabric "auto", where rank `without_zmq`
    (None: no rank) cannot import pyzmq."""
    me = dist.get_rank()
    if me == without_zmq:
        find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *rest: None if name == "zmq" else find_spec(name, *rest)
    with ubep.Buffer(hidden=H, num_experts=E, max_tokens_per_rank=T, transport="dist", timeout_s=30) as buf:
        return buf.explain(), survivor_round(buf, me, set())


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq is not installed")
def test_auto_runs_zmq_where_every_rank_has_pyzmq_else_gloo_on_every_rank():
    launch = ubep.LocalLaunch(world_size=R, timeout_s=100)
    for without, engine in ((None, "zmq"), (1, "gloo")):
        said = launch.run(auto_fabric_says, without)
        assert all(exact and f"over the {engine} fabric (auto: " in text for text, exact in said), said
    assert all("rank(s) [1] lack pyzmq" in text for text, _ in said), said

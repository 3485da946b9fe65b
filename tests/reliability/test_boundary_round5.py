"""The boundary items of issue 45 on every transport (shm, dist, hier): one launch per transport runs
each item's calls on one Buffer, and the tests below judge them.

3. combine with more weight columns than max_topk: ValueError on the calling rank before anything
   is sent, its peer told it rejected its input, the next calls exact (before: SIGABRT in gloo on
   dist, a raw RuntimeError on hier, PeerDataError on shm); a fabric message larger than its lane
   is a ValueError naming the lane (before: sent, and gloo aborted the receiving process).
4. bf16 at an odd hidden: a combine with weights equals the reference (before, on dist:
   "storage_offset() must be divisible by 4" on every rank).
6. UBEP_FABRIC set differently on two ranks: ConfigMismatchError naming "fabric" on both (before:
   one rank built, the other failed or waited).
7. the low-latency recv_count is the caller's own tensor: writing into it changes neither the
   handle nor the later combine (before: it was the handle's, and the combine failed or differed).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from scenarios import expert_output

import ubep
from ubep import reference, routing
from ubep.across.fabric import Lane, open_fabric
from ubep.calls import CallId

R, E, T, MAX_TOPK, K = 2, 8, 6, 4, 3
HIDDEN = 7  # odd: n bf16 rows end on a 2-byte boundary
WIDE = 64  # weight columns of the rejected combine: far more than max_topk (and than the lanes hold)
TIMEOUT_S = 10.0
TRANSPORTS = ("shm", "dist", "hier")


def inputs(seed: int):
    """(xs, topk_idxs, topk_weights) of every rank; each rank rebuilds all of them from the seed."""
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(T, HIDDEN, generator=g) * 3).bfloat16() for _ in range(R)]
    idxs = [routing.drop(routing.uniform(T, E, K, g), 0.2, g) for _ in range(R)]
    return xs, idxs, [routing.weights(T, K, g) for _ in range(R)]


def combine_with_weights(buf: ubep.Buffer, me: int, seed: int) -> bool:
    """A dispatch and a combine with weights, each equal to the reference: the rows' plain sums, and
    each token's weights back where its experts were (every weight comes back once, plus zeros)."""
    xs, idxs, ws = inputs(seed)
    ref = reference.dispatch(xs, idxs, ws, E)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    out = buf.combine(expert_output(got.recv_x, me), got.handle, got.recv_topk_weights)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
    want_x = reference.combine(ys, ref, [T] * R)[me]
    want_w = torch.where(idxs[me] >= 0, ws[me], 0.0)
    return (
        torch.equal(got.recv_x, ref[me].recv_x_MH)
        and torch.equal(out.combined_x, want_x)
        and torch.equal(out.combined_topk_weights, want_w)
    )


def too_wide_combine(buf: ubep.Buffer, me: int) -> tuple[str, str]:
    """Rank 1 passes WIDE weight columns to combine, rank 0 K: (error type, message) on each."""
    xs, idxs, ws = inputs(1)
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    w = torch.rand(got.recv_x.shape[0], WIDE if me == 1 else K)
    try:
        buf.combine(got.recv_x, got.handle, w)
    except (ValueError, ubep.UbepError) as error:
        return type(error).__name__, str(error)
    return "none", ""


def caller_owns_recv_count(buf: ubep.Buffer, me: int, hook: bool) -> tuple[bool, bool]:
    """(recv_count as the reference's, the combine exact) after the caller overwrote recv_count."""
    xs, idxs, ws = inputs(2)
    ll_ref = reference.low_latency_dispatch(xs, idxs, E, T)
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, E, return_recv_hook=hook)
    got.hook()
    counted = torch.equal(got.recv_count, ll_ref[me].recv_count_L)
    got.recv_count.fill_(T * R)  # the caller's to use as scratch: every row "valid"
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ll_ref)]
    y = expert_output(got.recv_x, me)
    out = buf.low_latency_combine(y, idxs[me], ws[me], got.handle)
    want = reference.low_latency_combine(ys, ll_ref, idxs, ws)[me]
    return counted, torch.equal(out.combined_x, want)


def lane_limit() -> list[str]:
    """A gloo fabric of one small lane: messages one word or one byte over it, each refused."""
    me = dist.get_rank()
    fabric, _ = open_fabric("gloo", None, me, R, [Lane("probe", 2, 16)], TIMEOUT_S)
    seen = []
    try:
        for words, nbytes in ((3, 16), (2, 17)):
            try:
                fabric.outbox("probe", 1 - me, CallId(seq=1, epoch=1, kind="dispatch"), words, nbytes)
                seen.append("none")
            except ValueError as error:
                seen.append(str(error))
    finally:
        fabric.close()
    return seen


def mixed_fabrics() -> tuple[str, str]:
    """rank 1 sets UBEP_FABRIC=nixl, rank 0 gloo: (error type, message) of the construction."""
    os.environ["UBEP_FABRIC"] = "nixl" if dist.get_rank() == 1 else "gloo"
    sizing = dict(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=T)
    try:
        ubep.Buffer(**sizing, transport="dist", timeout_s=5).close()
    except Exception as error:  # before the fix: anything (ImportError, a timeout)
        return type(error).__name__, str(error)
    finally:
        del os.environ["UBEP_FABRIC"]
    return "none", ""


def every_item(transport: str) -> dict[str, object]:
    """Each item's calls on one Buffer, in turn; a call's failure is recorded, never raised."""
    me, seen = dist.get_rank(), {}
    with ubep.Buffer(
        hidden=HIDDEN,
        num_experts=E,
        max_tokens_per_rank=T,
        max_topk=MAX_TOPK,
        transport=transport,
        timeout_s=TIMEOUT_S,
        low_latency=True,  # item 7's calls
    ) as buf:
        for name, run in (
            ("weights at odd hidden", lambda: combine_with_weights(buf, me, 0)),
            ("too wide", lambda: too_wide_combine(buf, me)),
            ("after too wide", lambda: combine_with_weights(buf, me, 3)),
            ("recv_count", lambda: caller_owns_recv_count(buf, me, hook=False)),
            ("recv_count hook", lambda: caller_owns_recv_count(buf, me, hook=True)),
        ):
            try:
                seen[name] = run()
            except Exception as error:  # recorded for the test to show
                seen[name] = f"raised {type(error).__name__}: {error}"
    if transport == "dist":
        seen["lane limit"] = lane_limit()
    return seen


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list]:
    """Per transport, every rank's outcome of `every_item` (hier: two emulated nodes of one rank)."""
    return {
        transport: ubep.LocalLaunch(
            world_size=R, ranks_per_node=1 if transport == "hier" else None, timeout_s=120
        ).outcomes(every_item, transport)
        for transport in TRANSPORTS
    }


def results(outcomes, transport: str) -> list[dict[str, object]]:
    for o in outcomes[transport]:  # a SIGABRT from gloo shows here as a rank that died with no result
        assert o.ok, f"{transport} rank {o.rank}: {o.cause}, exit code {o.exit_code}: {o.error}"
    return [o.result for o in outcomes[transport]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item3_too_many_weight_columns_is_refused_at_the_boundary(outcomes, transport):
    for rank, seen in enumerate(results(outcomes, transport)):
        error, message = seen["too wide"]
        if rank == 1:
            assert error == "ValueError", (transport, seen)
            assert f"topk_weights has {WIDE} columns" in message and f"max_topk={MAX_TOPK}" in message
        else:
            assert error == "PeerAbortedError", (transport, seen)
            assert "combine" in message and "rank 1 aborted the call (it rejected its input" in message
        assert seen["after too wide"] is True, (transport, rank, seen)


@pytest.mark.timeout(400)
def test_item3_a_message_larger_than_its_lane_is_named(outcomes):
    for seen in results(outcomes, "dist"):
        assert len(seen["lane limit"]) == 2, seen
        for said in seen["lane limit"]:
            assert "exceeds the 'probe' lane's 2 words and 16 bytes" in said, said


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item4_combine_with_weights_at_odd_hidden_in_bf16(outcomes, transport):
    for rank, seen in enumerate(results(outcomes, transport)):
        assert seen["weights at odd hidden"] is True, (transport, rank, seen)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item7_recv_count_is_the_callers_own(outcomes, transport):
    for rank, seen in enumerate(results(outcomes, transport)):
        assert seen["recv_count"] == (True, True), (transport, rank, seen)
        assert seen["recv_count hook"] == (True, True), (transport, rank, seen)


@pytest.mark.timeout(60)
def test_item6_fabric_set_differently_is_named_at_construction():
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=40).outcomes(mixed_fabrics)
    for o in outcomes:
        assert o.ok, o.error
        error, message = o.result
        assert error == "ConfigMismatchError", (o.rank, error, message)
        assert "fabric (rank(s) 0: 'gloo'; rank(s) 1: 'nixl')" in message, message

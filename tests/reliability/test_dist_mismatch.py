"""Ranks whose calls differ on the torch.distributed transports ("dist", and "hier" across
emulated nodes) get a Python error on every rank, and the group goes on (issue 14, item 3).
Before the call header, gloo ended the process with SIGABRT ("Received data size doesn't
match expected size"), the peers hung, or mixed handles went unnoticed."""

from __future__ import annotations

import time
from dataclasses import astuple

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, expert_output

import ubep
from ubep import reference
from ubep.across.call_header import CallHeader, check
from ubep.calls import CallId
from ubep.protocols.base import DTYPE_CODES

R, E, T = 2, 8, 6
SC = Scenario(name="mismatch", num_ranks=R, num_experts=E, hidden=64, topk=2, capacity=T, tokens=(6, 5))
ODD = 1  # the rank whose call departs from rank 0's
TIMEOUT_S = 10.0


def normal_call(buf: ubep.Buffer, me: int, seed: int = 0, **dispatch_kw):
    xs, idxs, ws = Scenario(**{**SC.__dict__, "seed": seed}).inputs()
    kw = {"topk_idx": idxs[me], "topk_weights": ws[me], **dispatch_kw}
    return buf.dispatch(kw.pop("x", xs[me]), **kw)


def ll_call(buf: ubep.Buffer, me: int, tokens: int = T):
    xs, idxs, _ = SC.inputs()
    return buf.low_latency_dispatch(xs[me], idxs[me], tokens, E)


def exact_round_trip(buf: ubep.Buffer, me: int) -> bool:
    """One dispatch + combine and one low-latency dispatch + combine, each equal to the reference."""
    xs, idxs, ws, ref = SC.expected()
    got = normal_call(buf, me)
    out = buf.combine(expert_output(got.recv_x, me), got.handle)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(R)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    ok = torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(out.combined_x, want)
    ll_ref = reference.low_latency_dispatch(xs, idxs, E, T)
    ll = ll_call(buf, me)
    ok &= torch.equal(ll.recv_count, ll_ref[me].recv_count_L)
    ll_ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ll_ref)]
    ll_out = buf.low_latency_combine(ll_ys[me], idxs[me], ws[me], ll.handle)
    return ok and torch.equal(ll_out.combined_x, reference.low_latency_combine(ll_ys, ll_ref, idxs, ws)[me])


def mismatch(buf: ubep.Buffer, me: int, case: str) -> None:
    """Rank ODD's call departs from rank 0's as `case` says."""
    odd = me == ODD
    if case == "kinds":
        ll_call(buf, me) if odd else normal_call(buf, me)
    elif case == "dtype":
        xs, _, _ = SC.inputs()
        normal_call(buf, me, x=xs[me].float() if odd else xs[me])
    elif case == "topk":
        xs, idxs, ws = SC.inputs()
        k = 1 if odd else 2
        normal_call(buf, me, topk_idx=idxs[me][:, :k].contiguous(), topk_weights=ws[me][:, :k].contiguous())
    elif case == "hidden":  # rejected by validation on rank ODD
        xs, _, _ = SC.inputs()
        normal_call(buf, me, x=torch.cat([xs[me], xs[me][:, :1]], dim=1) if odd else xs[me])
    elif case in ("handles", "combine rejected"):
        first, second = normal_call(buf, me), normal_call(buf, me, seed=1)
        got = second if odd and case == "handles" else first
        x = got.recv_x[:, :-1] if odd and case == "combine rejected" else got.recv_x
        buf.combine(x, got.handle)
    elif case == "tokens":
        ll_call(buf, me, T - 1 if odd else T)
    elif case == "ll rejected":  # an expert id out of range on rank ODD
        xs, idxs, _ = SC.inputs()
        buf.low_latency_dispatch(xs[me], idxs[me] + E if odd else idxs[me], T, E)
    else:  # "ll handles", "ll dtype", "ll combine rejected"
        xs, idxs, ws = SC.inputs()
        first, second = ll_call(buf, me), ll_call(buf, me)
        got = second if odd and case == "ll handles" else first
        y = got.recv_x
        if odd and case == "ll dtype":
            y = y.float()
        elif odd and case == "ll combine rejected":
            y = y[:, :, :-1]
        buf.low_latency_combine(y, idxs[me], ws[me], got.handle)


def run_case(case: str, transport: str) -> tuple[str, str, float, bool]:
    """(error type, message, seconds) of the mismatched call on this rank, and whether the next
    calls are exact."""
    me = dist.get_rank()
    with ubep.Buffer(
        hidden=SC.hidden,
        num_experts=E,
        max_tokens_per_rank=T,
        transport=transport,
        timeout_s=TIMEOUT_S,
        low_latency=True,
    ) as buf:
        start = time.monotonic()
        try:
            mismatch(buf, me, case)
            seen = ("none", "")
        except (ValueError, TypeError, ubep.UbepError) as error:
            seen = (type(error).__name__, str(error))
        return (*seen, time.monotonic() - start, exact_round_trip(buf, me))


DIFFER = {  # case: what every rank's PeerDataError must say
    "kinds": "kind: rank(s) 0 called dispatch, rank(s) 1 called low_latency_dispatch",
    "dtype": "dtype: rank(s) 0 torch.bfloat16, rank(s) 1 torch.float32",
    "topk": "topk: rank(s) 0 2, rank(s) 1 1",
    "handles": "handle: rank(s) 0 the handle of call #1, rank(s) 1 the handle of call #2",
    "tokens": "tokens: rank(s) 0 6, rank(s) 1 5",
    "ll handles": "handle: rank(s) 0 the handle of call #1, rank(s) 1 the handle of call #2",
    "ll dtype": "dtype: rank(s) 0 torch.bfloat16, rank(s) 1 torch.float32",
}
REJECTED = {  # case: the call rank ODD rejected
    "hidden": "dispatch",
    "ll rejected": "low_latency_dispatch",
    "combine rejected": "combine",
    "ll combine rejected": "low_latency_combine",
}


NORMAL = ["dtype", "topk", "handles", "hidden", "combine rejected"]  # hier's own path: normal mode
CASES = [("dist", case) for case in [*DIFFER, *REJECTED]] + [("hier", case) for case in NORMAL]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,case", CASES)
def test_mismatched_calls_raise_on_every_rank_and_the_group_goes_on(transport, case):
    nodes = 1 if transport == "hier" else None  # hier: two emulated nodes of one rank each
    launch = ubep.LocalLaunch(world_size=R, ranks_per_node=nodes, timeout_s=40)
    outcomes = launch.outcomes(run_case, case, transport)
    for o in outcomes:  # a SIGABRT from gloo shows here as a rank that died with no result
        assert o.ok, f"rank {o.rank}: {o.cause}, exit code {o.exit_code}: {o.error}"
    for rank, (error, message, elapsed, exact_after) in enumerate(o.result for o in outcomes):
        assert elapsed < TIMEOUT_S, f"rank {rank} took {elapsed:.2f} s: a deadline, not the header"
        if case in DIFFER:
            assert error == "PeerDataError", (rank, error, message)
            assert "(call header): the ranks' calls differ in " + DIFFER[case] in message, message
        elif rank == ODD:
            assert error in ("ValueError", "TypeError"), (rank, error, message)
        else:
            assert error == "PeerAbortedError", (rank, error, message)
            assert f"rank {ODD} aborted the call (it rejected its input for {REJECTED[case]}" in message
        assert exact_after, f"rank {rank}: the calls after the mismatch differ from the reference"


def hier_kinds(protocol: str) -> tuple[str, str]:
    me = dist.get_rank()
    with ubep.Buffer(
        hidden=SC.hidden,
        num_experts=E,
        max_tokens_per_rank=T,
        transport="hier",
        timeout_s=1,
        protocol=protocol,
        low_latency=True,
    ) as buf:
        try:
            mismatch(buf, me, "kinds")
        except ubep.UbepError as error:
            return type(error).__name__, str(error)
    return "none", ""


@pytest.mark.timeout(60)
def test_hier_normal_against_low_latency_call_is_named_over_the_fabric():
    """hier with ubep runs both modes' crossings on one fabric, so each rank sees the other's message of
    the same call on another lane and names the difference."""
    outcomes = ubep.LocalLaunch(world_size=R, ranks_per_node=1, timeout_s=40).outcomes(hier_kinds, "ubep")
    for o in outcomes:
        assert o.ok and o.result[0] == "PeerDataError", outcomes
        assert "the ranks' calls differ in " + DIFFER["kinds"] in o.result[1], o.result


@pytest.mark.timeout(60)
def test_hier_bsp_normal_against_low_latency_call_times_out_in_python():
    """The baseline's limit: hier-bsp's normal header runs on the rail, the low-latency one on the whole
    group, so neither sees the other; both ranks reach the deadline, still without a process abort."""
    outcomes = ubep.LocalLaunch(world_size=R, ranks_per_node=1, timeout_s=40).outcomes(hier_kinds, "bsp")
    assert [(o.ok, o.result[0]) for o in outcomes] == [(True, "CommTimeoutError")] * R, outcomes


def headers(*rows: CallHeader) -> torch.Tensor:
    return torch.tensor([astuple(h) for h in rows], dtype=torch.int64)


def test_check_names_every_differing_field_with_the_ranks_errors_use():
    call = CallId(seq=4, epoch=2, kind="combine")
    a = CallHeader.of(call, handle=3, dtype=DTYPE_CODES[torch.bfloat16], topk=2)
    b = CallHeader.of(call, handle=1, dtype=DTYPE_CODES[torch.float32], topk=2)
    check(headers(a, a, a), "combine (call header)", (0, 1, 2))  # agreement: no error
    with pytest.raises(ubep.PeerDataError) as caught:
        check(headers(a, b, a), "combine (call header)", (1, 3, 5))  # a rail: EP ranks 1, 3, 5
    assert str(caught.value) == (
        "combine (call header): the ranks' calls differ in handle: rank(s) 1, 5 the handle of call #3, "
        "rank(s) 3 the handle of call #1; dtype: rank(s) 1, 5 torch.bfloat16, rank(s) 3 torch.float32"
    )


def test_check_reports_a_rejection_before_any_difference():
    call = CallId(seq=9, epoch=5, kind="ll_dispatch")
    mine = CallHeader.of(call, dtype=DTYPE_CODES[torch.bfloat16], tokens=T)
    rejected = CallHeader.rejected(call)
    with pytest.raises(ubep.PeerAbortedError) as caught:
        check(headers(mine, rejected, rejected), "low-latency dispatch (call header)", (0, 1, 2))
    assert caught.value.peer == 1
    said = "(it rejected its input for low_latency_dispatch (call #9); see its error; so did rank(s) 2)"
    assert said in str(caught.value)

"""Low-latency mode's Triton call halves (`ubep.protocols.ll.triton_driver` over its
`triton_halves`): one kernel launch per half over the heap's address table, bit for bit against
`ubep.reference` and against the numba halves, across two processes sharing memory, with rows after
data and in word form (8-byte words of payload and epoch; a stale epoch is not read as landed);
masked ranks; a whole `Buffer` call that reads nothing back on the host (capturable), and this rank's
bad input caught in the kernels.

On CPU the kernels run under Triton's interpreter over the shared-memory heap's host addresses, which
the interpreter dereferences as a GPU dereferences the CUDA heap's: `test_interpreter_suite` reruns this
module with TRITON_INTERPRET=1 (set before triton is imported). Shapes are tiny: the interpreter runs
every program in Python.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from interpreted import interpreted, run_interpreted

import ubep
from ubep import fp8, reference
from ubep.protocols.base import DTYPE_CODES


@pytest.mark.timeout(480)
def test_interpreter_suite():
    """This module under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreted(__file__, 460)  # 188 s seen at load 35


def test_status_codes_are_the_numba_halves():
    """Both kinds of halves report through `ll_status`: their codes must be its codes."""
    pytest.importorskip("triton")
    from ubep.protocols.ll import status as ll_status
    from ubep.protocols.ll import triton_halves as ll_triton

    names = ["E_FIELD", "E_REJECTED", "E_T", "E_FORMAT", "E_COUNTS", "E_TOKENS", "E_RETURNED", "E_MINE"]
    assert [getattr(ll_triton, n).value for n in names] == [getattr(ll_status, n) for n in names]
    numba_halves = pytest.importorskip("ubep.protocols.ll.numba_halves")
    assert [getattr(numba_halves, n) for n in names] == [getattr(ll_status, n) for n in names]
    blocks = ["SENT", "SLOTS", "SLOT_INFO", "RETURNED", "BACK_SLOTS", "DONE_WORDS", "REJECTED", "S_COUNTS"]
    assert [getattr(ll_triton, n).value for n in blocks] == [getattr(numba_halves, n) for n in blocks]


def test_own_input_codes_raise_the_hosts_exceptions():
    """The send kernels' input codes are ll_status's, and become the host validator's exceptions."""
    pytest.importorskip("triton")
    import numpy as np

    from ubep import validate
    from ubep.protocols.ll import status as ll_status
    from ubep.protocols.ll import triton_halves as ll_triton

    names = ["E_EXPERT", "E_REPEATED", "E_UNRECEIVED", "E_OTHER_TOPK", "E_TOO_MANY"]
    assert [getattr(ll_triton, n).value for n in names] == [getattr(ll_status, n) for n in names]

    def raised(code, *words):
        return ll_status.error(None, None, None, "x", code, np.array([code, *words, 0, 0, 0]), 0)

    got = raised(ll_status.E_EXPERT, 0, 9, 8, 3)
    assert type(got) is ValueError and str(got) == str(validate.bad_expert(8, 9))
    assert "row 2 lists the same expert twice (5)" in str(raised(ll_status.E_REPEATED, 1, 5, 0, 2))
    assert "not received" in str(raised(ll_status.E_UNRECEIVED, 0, 0, 0, 0))
    assert "rank 1 sent this rank 9 rows" in str(raised(ll_status.E_TOO_MANY, 1, 9, 8, 0))


def test_in_word_slots_take_twice_the_bytes():
    from ubep.factory import heap_bytes
    from ubep.layout import ExpertPlacement
    from ubep.protocols.base import Sizing
    from ubep.protocols.ll import LLBlocks
    from ubep.protocols.ll.plans import per_writer

    s = Sizing(hidden=128, capacity=4, max_topk=2, placement=ExpertPlacement.contiguous(8, 2))
    R, L, T, B = 2, 4, 4, s.row_bytes
    plain, word = LLBlocks.of(s), LLBlocks.of(s, in_word=True)
    assert word.slots.shape == (R, L, T, 2 * B) and word.back_slots.shape == (R, per_writer(s), 2 * B)
    extra = 2 * (R * L * T * B + R * per_writer(s) * B)  # both halves of both slot regions, once more
    grew = heap_bytes(s, low_latency=True, ll_flag="in-word") - heap_bytes(s, low_latency=True)
    assert extra <= grew < extra + 4 * 4096, (grew, extra)  # (regions are page aligned)
    assert plain.slots.shape[-1] == B
    assert ubep.Buffer.size_hint(
        hidden=128, num_experts=8, max_tokens_per_rank=4, num_ranks=2, max_topk=2, low_latency=True,
        ll_flag="in-word",
    ).segment_bytes == heap_bytes(s, low_latency=True, ll_flag="in-word")  # fmt: skip


def test_flags_need_the_triton_halves(monkeypatch):
    kw = dict(hidden=128, num_experts=4, max_tokens_per_rank=4, low_latency=True)
    with pytest.raises(ValueError, match="ll_flag must be one of"):
        ubep.Buffer(ll_flag="after", **kw)
    with pytest.raises(ValueError, match=r"ll_flag='in-word', capturable=False: these need .*Triton halves"):
        ubep.Buffer(ll_flag="in-word", engine="torch", **kw)
    monkeypatch.setenv("UBEP_CAPTURABLE", "1")
    with pytest.raises(ValueError, match=r"capturable=True: these need .*Triton halves"):
        ubep.Buffer(engine="torch", **kw)
    monkeypatch.setenv("UBEP_LL_FLAG", "word")
    with pytest.raises(ValueError, match="UBEP_LL_FLAG='word'"):
        ubep.Buffer(engine="torch", **kw)


# --- two processes over the shared-memory heap ----------------------------------------------------


CHECKED = ("n-below-t-with-minus-one", "fp8", "float32")


def against_reference_and_numba(_: int) -> list[str]:
    """bf16 (with -1 slots, via the hook), FP8 and fp32 cases, each checked against the reference, with
    rows after data and in word form; the same inputs through the numba halves and through both forms
    give the same bits (both halves of the slots are used); in word form, a stale epoch is not landed."""
    from test_low_latency import CAPACITY, HIDDEN, cases, run_case

    R, me = torch.distributed.get_world_size(), torch.distributed.get_rank()
    E = 2 * R
    checked = []
    kw = dict(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60, low_latency=True)
    got = {}
    for flag in ("after-data", "in-word"):
        with ubep.Buffer(engine="triton", ll_flag=flag, **kw) as buf:
            assert type(buf._ll._compiled).__name__ == "LLTriton" and buf._ll._compiled.flag == flag
            assert f"({flag})" in buf.explain() and f"ll_flag {flag!r}" in buf.explain()
            for case in cases(R):
                if case.name in CHECKED:
                    run_case(buf, case, me, R, E)
                    checked.append(f"{case.name} {flag}")
            got[flag] = _one_call(buf, me, R, E, use_fp8=True) + _one_call(buf, me, R, E, use_fp8=False)
            if flag == "in-word":
                checked.append(_stale_words(buf, me, R, E))
    with ubep.Buffer(engine="numba", **kw) as buf:
        assert type(buf._ll._compiled).__name__ == "LLNumba"
        want = _one_call(buf, me, R, E, use_fp8=True) + _one_call(buf, me, R, E, use_fp8=False)
    for name, tensors in got.items():
        for a, b in zip(tensors, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                f"{name} differs from the numba halves"
            )
    checked.append("numba")
    return checked


def _stale_words(buf: ubep.Buffer, me: int, R: int, E: int) -> str:
    """In word form, rows whose words still carry the epoch of the call before on this half (what the
    slots held) are not read as landed: the receive half's wait runs out naming their sender; once the
    words carry the call's epoch, the same half places the reference's rows."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase

    from ubep.errors import CommTimeoutError
    from ubep.protocols.ll.plans import dispatch_outputs, wire_rows
    from ubep.protocols.ll.triton_driver import LLTriton

    ll = buf._ll
    device = LLTriton(ll.t, ll.blocks, buf.sizing, ll._consumed, buf.engine, True, 20, flag="in-word")
    call = buf._calls.next("ll_dispatch")
    assert call.epoch > 2  # its half served call epoch - 2: the slots hold that call's words
    device._epochs[0] += call.epoch - 1  # continue the host's epochs
    xs, idxs, _ = LLCase(name="stale", drop=0.2, seed=5).inputs(R, E)
    wire = wire_rows(xs[me], CAPACITY, False)
    out = dispatch_outputs(wire, HIDDEN, R, idxs[me], E)
    receive = device.dispatch_rows(call, wire.rows_NB, wire.code, CAPACITY, out)
    torch.distributed.barrier()  # every rank's send has finished: all words are in place
    mine = ll.t.view(ll.blocks.slots, me, call)[me].view(torch.int64)  # the words this rank sent itself
    ref = reference.low_latency_dispatch(xs, idxs, E, CAPACITY)[me]
    sent = int(ref.layout_range_LR2[:, me, 1].sum())  # rows from this rank to itself
    assert sent > 0 and int(((mine[:, :, 0] >> 32) == call.epoch).sum()) == sent  # a row's first word
    fresh = mine.clone()
    mine.copy_((mine & 0xFFFFFFFF) | ((call.epoch - 2) << 32))  # as the call before left them
    receive()
    with pytest.raises(CommTimeoutError, match=rf"no signal from rank\(s\) {me} .*20 polls"):
        device.check()
    assert not (out.handle.recv_src_rank_LM == me).any(), "rows of a stale epoch were read as landed"
    mine.copy_(fresh)
    receive()  # the same half again: every word carries the epoch now
    device.check()
    assert torch.equal(out.handle.recv_count_L, ref.recv_count_L)
    for j, c in enumerate(ref.recv_count_L.tolist()):
        assert torch.equal(out.recv_x[j, :c], ref.recv_x_LMX[j, :c])
    torch.distributed.barrier()
    return "stale epoch"


def _one_call(buf: ubep.Buffer, me: int, R: int, E: int, use_fp8: bool) -> list[torch.Tensor]:
    """One dispatch + combine (seeded inputs); every output tensor, valid rows only."""
    from test_low_latency import CAPACITY, LLCase, expert_output

    xs, idxs, ws = LLCase(name="numba", drop=0.2, seed=11).inputs(R, E)
    got = buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, use_fp8=use_fp8)
    h = got.handle
    values = got.recv_x[0] if use_fp8 else got.recv_x
    rows = [values[j, : int(c)] for j, c in enumerate(h.recv_count_L.tolist())]
    if use_fp8:
        rows += [got.recv_x[1][j, : int(c)] for j, c in enumerate(h.recv_count_L.tolist())]
    y = expert_output(fp8.dequantize(*got.recv_x) if use_fp8 else got.recv_x, me)
    out = buf.low_latency_combine(y, idxs[me], ws[me], h)
    return [*rows, h.recv_count_L, h.layout_range_LR2, h.recv_src_token_LM, h.recv_src_k_LM, out.combined_x]


@interpreted
@pytest.mark.timeout(200)
def test_two_processes_equal_the_reference_and_the_numba_halves():
    got = ubep.LocalLaunch(world_size=2, timeout_s=180).run(against_reference_and_numba, 0)
    want = [f"{case} {flag}" for flag in ("after-data", "in-word") for case in CHECKED]
    assert got == [[*want, "stale epoch", "numba"]] * 2


# --- masked ranks (virtual ranks: threads of one process over one heap) ---------------------------


def masked(rank, done: threading.Barrier) -> list[int]:
    """Rank 2 leaves; ranks 0 and 1 keep calling low-latency mode on the device halves, exact against
    the reference restricted to them."""
    from shrinkcase import buffer, low_latency_call

    with buffer(rank, "ubep", timeout_s=60, engine="triton") as buf:
        assert type(buf._ll._compiled).__name__ == "LLTriton"
        low_latency_call(buf, 1, set())
        done.wait()
        buf.mask_ranks([2])
        if rank.rank == 2:
            return []
        for seed in (2, 3):
            low_latency_call(buf, seed, {2})
        return list(buf.masked_ranks)


@interpreted
@pytest.mark.timeout(200)
def test_masked_rank_is_left_out():
    from ubep.transport.virtual import VirtualWorld

    done = threading.Barrier(3)
    assert VirtualWorld(3, timeout_s=120).run(lambda rank: masked(rank, done)) == [[2], [2], []]


# --- no host sync: a whole call, capturable, with every device-to-host read made to fail ----------


class HostSync(AssertionError):
    pass


def _no_host_reads(monkeypatch_like: list) -> None:
    """Make every device-to-host read fail unless Triton's interpreter makes it (the interpreter stands
    in for the device: its own copies are the device's loads and stores)."""

    def forbid(owner, name):
        real = getattr(owner, name)

        def guard(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("triton"):
                return real(*args, **kwargs)
            raise HostSync(f"host read {name} from {caller}")

        monkeypatch_like.append((owner, name, real))
        setattr(owner, name, guard)

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        forbid(torch.Tensor, name)
    forbid(torch.cuda, "synchronize")
    forbid(torch.cuda.Stream, "synchronize")
    forbid(torch.cuda.Event, "synchronize")
    # operations whose output size depends on values: on a GPU each reads a count back (a sync)
    for name in ("nonzero", "bincount", "masked_select", "unique", "repeat_interleave", "equal"):
        forbid(torch, name)
        forbid(torch.Tensor, name)

    def by_mask(owner, name):  # x[mask], x[mask] = v: a boolean index is a nonzero
        real = getattr(owner, name)

        def guard(self, index, *rest):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            parts = index if isinstance(index, tuple) else (index,)
            if not caller.startswith("triton") and any(
                isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts
            ):
                raise HostSync(f"boolean index ({name}) from {caller}")
            return real(self, index, *rest)

        monkeypatch_like.append((owner, name, real))
        setattr(owner, name, guard)

    by_mask(torch.Tensor, "__getitem__")
    by_mask(torch.Tensor, "__setitem__")


def _restore(patched: list) -> None:
    for owner, name, real in reversed(patched):
        setattr(owner, name, real)


def without_host_reads(_: int) -> str:
    """Each rank runs dispatch + combine on capturable device halves with host reads forbidden, then
    checks the status words and the results; a call on the non-capturable halves must trip the guard."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase, expert_output

    from ubep.protocols.ll.plans import dispatch_outputs
    from ubep.protocols.ll.triton_driver import LLTriton

    R, me = torch.distributed.get_world_size(), torch.distributed.get_rank()
    E = 2 * R
    with ubep.Buffer(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                     engine="triton", low_latency=True) as buf:  # fmt: skip
        ll = buf._ll
        device = LLTriton(ll.t, ll.blocks, buf.sizing, ll._consumed, buf.engine, capturable=True)
        xs, idxs, ws = LLCase(name="sync", drop=0.2, seed=3).inputs(R, E)
        ref = reference.low_latency_dispatch(xs, idxs, E, CAPACITY)
        ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
        want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
        code = DTYPE_CODES[torch.bfloat16]
        plan = type("Plan", (), {"max_tokens": CAPACITY, "code": code})
        out = dispatch_outputs(plan, HIDDEN, R, idxs[me], E)
        combined = torch.empty(xs[me].shape[0], HIDDEN, dtype=torch.bfloat16)
        patched: list = []
        _no_host_reads(patched)
        try:
            dispatch, combine = buf._calls.next("ll_dispatch"), buf._calls.next("ll_combine")
            device.dispatch_rows(dispatch, xs[me].view(torch.uint8), code, CAPACITY, out)()
            device.combine_rows(combine, ys[me], ws[me], out.handle, combined)()
        finally:
            _restore(patched)
        device.check()
        h = out.handle
        assert torch.equal(h.recv_count_L, ref[me].recv_count_L)
        assert torch.equal(h.layout_range_LR2, ref[me].layout_range_LR2)
        assert torch.equal(combined, want)
        # the guard catches a host read: the non-capturable halves read their status after each launch
        _no_host_reads(patched := [])
        try:
            with pytest.raises(HostSync):
                ll._compiled.dispatch_rows(
                    buf._calls.next("ll_dispatch"),
                    xs[me].view(torch.uint8),
                    code,
                    CAPACITY,
                    dispatch_outputs(plan, HIDDEN, R, idxs[me], E),
                )
        finally:
            _restore(patched)
    return "ok"


@interpreted
@pytest.mark.timeout(200)
def test_a_whole_call_reads_nothing_back_on_the_host():
    assert ubep.LocalLaunch(world_size=2, timeout_s=180).run(without_host_reads, 0) == ["ok", "ok"]


def buffer_without_host_reads(_: int) -> list[str]:
    """A whole `Buffer.low_latency_dispatch` + `low_latency_combine` (capturable, both flags; FP8 in word
    form) with every host read forbidden: the Buffer checks shapes, dtypes and devices only, and the
    kernels the values; equal to the reference. Then rank 0 passes an expert id out of range, still
    without a host read: `check()` raises the host's ValueError on rank 0, and on rank 1 that rank 0
    rejected the call."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase, expert_output

    from ubep.waiting import PeerAbortedError

    R, me = torch.distributed.get_world_size(), torch.distributed.get_rank()
    E = 2 * R
    xs, idxs, ws = LLCase(name="buffer", drop=0.2, seed=4).inputs(R, E)
    ref = reference.low_latency_dispatch(xs, idxs, E, CAPACITY)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
    qs = [fp8.quantize(x) for x in xs]  # what FP8 delivers: the reference over values and scales
    ref_v = reference.low_latency_dispatch([q[0] for q in qs], idxs, E, CAPACITY)[me]
    ref_s = reference.low_latency_dispatch([q[1] for q in qs], idxs, E, CAPACITY)[me]
    bad = idxs[me].clone()
    if me == 0:
        bad[0, 0] = E
    seen = []
    for flag in ("after-data", "in-word"):
        with ubep.Buffer(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                         engine="triton", ll_flag=flag, capturable=True,
                         low_latency=True) as buf:  # fmt: skip
            assert "capturable" in buf.explain()
            use_fp8 = flag == "in-word"  # FP8 quantizes on the way out: tensor operations only
            patched: list = []
            _no_host_reads(patched)
            try:
                got = buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, use_fp8=use_fp8)
                out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle)
            finally:
                _restore(patched)
            buf.check()
            assert torch.equal(got.handle.recv_count_L, ref[me].recv_count_L)
            assert torch.equal(got.handle.layout_range_LR2, ref[me].layout_range_LR2)
            for j, c in enumerate(ref[me].recv_count_L.tolist()):
                if use_fp8:
                    assert torch.equal(
                        got.recv_x[0][j, :c].view(torch.uint8), ref_v.recv_x_LMX[j, :c].view(torch.uint8)
                    )
                    assert torch.equal(got.recv_x[1][j, :c], ref_s.recv_x_LMX[j, :c])
                else:
                    assert torch.equal(got.recv_x[j, :c], ref[me].recv_x_LMX[j, :c])
            assert torch.equal(out.combined_x, want)
            _no_host_reads(patched := [])
            try:  # a bad call (and the combine a graph would run after it) reads nothing back either
                got = buf.low_latency_dispatch(xs[me], bad, CAPACITY, E)
                buf.low_latency_combine(ys[me], bad, ws[me], got.handle)
            finally:
                _restore(patched)
            if me == 0:
                with pytest.raises(ValueError, match=rf"topk_idx values must lie in \[-1, {E}\); found {E}"):
                    buf.check()
            else:
                with pytest.raises(PeerAbortedError, match="rank 0"):
                    buf.check()
            seen.append(flag)
    return seen


@interpreted
@pytest.mark.timeout(300)
def test_a_whole_buffer_call_reads_nothing_back_and_its_kernels_check_the_values():
    got = ubep.LocalLaunch(world_size=2, timeout_s=280).run(buffer_without_host_reads, 0)
    assert got == [["after-data", "in-word"]] * 2


# --- errors: a rejected call, a peer with another T, a peer that never sends -------------------------


def errors(rank, done: threading.Barrier) -> str:
    """The device halves report what the CPU protocol reports, in its words."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase

    from ubep.errors import CommTimeoutError, PeerDataError
    from ubep.protocols.ll.plans import dispatch_outputs
    from ubep.protocols.ll.triton_driver import LLTriton
    from ubep.waiting import PeerAbortedError

    me, R, E = rank.rank, rank.world_size, 2 * rank.world_size
    with ubep.Buffer(rank, hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                     engine="triton", low_latency=True) as buf:  # fmt: skip
        xs, idxs, _ = LLCase(name="T", seed=8).inputs(R, E)
        if me == 0:  # rejected before its send; the peer learns it from the rejected word, in its kernel
            with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank=4"):
                buf.low_latency_dispatch(xs[me][:5], idxs[me][:5], 4, E)
        else:
            with pytest.raises(PeerAbortedError, match="rank 0"):
                buf.low_latency_dispatch(xs[me][:4], idxs[me][:4], 4, E)
        good = idxs[me][:4]
        bad = good.clone()  # values the host no longer reads: the send kernel checks them
        bad[2, 0] = -2
        if me == 0:
            with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 4\); found -2"):
                buf.low_latency_dispatch(xs[me][:4], bad, 4, E)
        else:
            with pytest.raises(PeerAbortedError, match="rank 0"):
                buf.low_latency_dispatch(xs[me][:4], good, 4, E)
        twice = good.clone()
        twice[3, 1] = twice[3, 0] = 1
        if me == 1:
            with pytest.raises(ValueError, match=r"topk_idx row 3 lists the same expert twice \(1\)"):
                buf.low_latency_dispatch(xs[me][:4], twice, 4, E)
        else:
            with pytest.raises(PeerAbortedError, match="rank 1"):
                buf.low_latency_dispatch(xs[me][:4], good, 4, E)
        T = 6 + 2 * me  # each rank passes its own T
        with pytest.raises(PeerDataError, match=f"rank {1 - me} used T={8 - 2 * me}, this rank T={T}"):
            buf.low_latency_dispatch(xs[me][:6], idxs[me][:6], T, E)
        done.wait()
        if me == 0:  # rank 1 sends nothing: a capturable wait runs out and check() names it
            ll = buf._ll
            device = LLTriton(ll.t, ll.blocks, buf.sizing, ll._consumed, buf.engine, True, max_spins=20)
            device._epochs += buf._calls.next("ll_dispatch").epoch - 1  # continue the host's epochs
            plan = type("Plan", (), {"max_tokens": CAPACITY, "code": DTYPE_CODES[torch.bfloat16]})
            out = dispatch_outputs(plan, HIDDEN, R, idxs[me], E)
            device.dispatch_rows(None, xs[me].view(torch.uint8), plan.code, CAPACITY, out)()
            with pytest.raises(CommTimeoutError, match=r"no signal from rank\(s\) 1 .*20 polls"):
                device.check()
        done.wait()
    return "ok"


@interpreted
@pytest.mark.timeout(200)
def test_errors_are_the_cpu_protocols():
    from ubep.transport.virtual import VirtualWorld

    done = threading.Barrier(2)
    assert VirtualWorld(2, timeout_s=120).run(lambda rank: errors(rank, done)) == ["ok", "ok"]

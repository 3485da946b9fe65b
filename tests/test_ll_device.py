"""Low-latency mode's Triton call halves (`ubep.protocols.ll_device` over `ubep.engine.ll_triton`): one
kernel launch per half over the heap's address table, bit for bit against `ubep.reference` and against
the numba halves, across two processes sharing memory; masked ranks; and a whole call that reads
nothing back on the host.

On CPU the kernels run under Triton's interpreter over the shared-memory heap's host addresses, which
the interpreter dereferences as a GPU dereferences the CUDA heap's: `test_interpreter_suite` reruns this
module with TRITON_INTERPRET=1 (set before triton is imported). Shapes are tiny: the interpreter runs
every program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import ubep
from ubep import fp8, reference
from ubep.protocols.base import DTYPE_CODES

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_interpreter_suite")


@pytest.mark.timeout(480)
def test_interpreter_suite():
    """This module under TRITON_INTERPRET=1 in a fresh interpreter."""
    if INTERPRETED:
        pytest.skip("already the interpreter run")
    pytest.importorskip("triton")
    import ubep as package

    src = os.path.dirname(os.path.dirname(package.__file__))
    tests = os.path.dirname(__file__)
    path = os.pathsep.join([src, tests, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=460)  # 188 s seen at load 35
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]


def test_status_codes_are_the_numba_halves():
    """Both kinds of halves report through `ll_status`: their codes must be its codes."""
    pytest.importorskip("triton")
    from ubep.engine import ll_triton
    from ubep.protocols import ll_status

    names = ["E_FIELD", "E_REJECTED", "E_T", "E_FORMAT", "E_COUNTS", "E_TOKENS", "E_RETURNED", "E_MINE"]
    assert [getattr(ll_triton, n).value for n in names] == [getattr(ll_status, n) for n in names]
    numba_halves = pytest.importorskip("ubep.engine.ll_halves")
    assert [getattr(numba_halves, n) for n in names] == [getattr(ll_status, n) for n in names]
    blocks = ["SENT", "SLOTS", "SLOT_INFO", "RETURNED", "BACK_SLOTS", "DONE_WORDS", "REJECTED", "S_COUNTS"]
    assert [getattr(ll_triton, n).value for n in blocks] == [getattr(numba_halves, n) for n in blocks]


# --- two processes over the shared-memory heap ----------------------------------------------------


def against_reference_and_numba(_: int) -> list[str]:
    """bf16 (with -1 slots, via the hook), FP8 and fp32 cases, each checked against the reference; then
    the same inputs through the numba halves give the same bits (both halves of the slots are used)."""
    from test_low_latency import CAPACITY, HIDDEN, cases, run_case

    R, me = torch.distributed.get_world_size(), torch.distributed.get_rank()
    E = 2 * R
    checked = []
    kw = dict(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60)
    with ubep.Buffer(engine="triton", **kw) as buf:
        assert type(buf._ll._compiled).__name__ == "LLDevice"
        for case in cases(R):
            if case.name in ("n-below-t-with-minus-one", "fp8", "float32"):
                run_case(buf, case, me, R, E)
                checked.append(case.name)
        got = _one_call(buf, me, R, E, use_fp8=True)
    with ubep.Buffer(engine="numba", **kw) as buf:
        assert type(buf._ll._compiled).__name__ == "LLCompiled"
        want = _one_call(buf, me, R, E, use_fp8=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "the numba halves differ"
    checked.append("numba")
    return checked


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
    want = ["n-below-t-with-minus-one", "fp8", "float32"]
    assert got == [[*want, "numba"]] * 2


# --- masked ranks (virtual ranks: threads of one process over one heap) ---------------------------


def masked(rank, done: threading.Barrier) -> list[int]:
    """Rank 2 leaves; ranks 0 and 1 keep calling low-latency mode on the device halves, exact against
    the reference restricted to them."""
    from shrinkcase import buffer, low_latency_call

    with buffer(rank, "ubep", timeout_s=60, engine="triton") as buf:
        assert type(buf._ll._compiled).__name__ == "LLDevice"
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


def _restore(patched: list) -> None:
    for owner, name, real in reversed(patched):
        setattr(owner, name, real)


def without_host_reads(_: int) -> str:
    """Each rank runs dispatch + combine on capturable device halves with host reads forbidden, then
    checks the status words and the results; a call on the non-capturable halves must trip the guard."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase, expert_output

    from ubep.protocols.ll_base import dispatch_outputs
    from ubep.protocols.ll_device import LLDevice

    R, me = torch.distributed.get_world_size(), torch.distributed.get_rank()
    E = 2 * R
    with ubep.Buffer(hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                     engine="triton") as buf:  # fmt: skip
        ll = buf._ll
        device = LLDevice(ll.t, ll.blocks, buf.sizing, ll._consumed, buf.engine, capturable=True)
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


# --- errors: a rejected call, a peer with another T, a peer that never sends -------------------------


def errors(rank, done: threading.Barrier) -> str:
    """The device halves report what the CPU protocol reports, in its words."""
    from test_low_latency import CAPACITY, HIDDEN, LLCase

    from ubep.errors import CommTimeoutError, PeerDataError
    from ubep.protocols.ll_base import dispatch_outputs
    from ubep.protocols.ll_device import LLDevice
    from ubep.waiting import PeerAbortedError

    me, R, E = rank.rank, rank.world_size, 2 * rank.world_size
    with ubep.Buffer(rank, hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                     engine="triton") as buf:  # fmt: skip
        xs, idxs, _ = LLCase(name="T", seed=8).inputs(R, E)
        if me == 0:  # rejected before its send; the peer learns it from the rejected word, in its kernel
            with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank=4"):
                buf.low_latency_dispatch(xs[me][:5], idxs[me][:5], 4, E)
        else:
            with pytest.raises(PeerAbortedError, match="rank 0"):
                buf.low_latency_dispatch(xs[me][:4], idxs[me][:4], 4, E)
        T = 6 + 2 * me  # each rank passes its own T
        with pytest.raises(PeerDataError, match=f"rank {1 - me} used T={8 - 2 * me}, this rank T={T}"):
            buf.low_latency_dispatch(xs[me][:6], idxs[me][:6], T, E)
        done.wait()
        if me == 0:  # rank 1 sends nothing: a capturable wait runs out and check() names it
            ll = buf._ll
            device = LLDevice(ll.t, ll.blocks, buf.sizing, ll._consumed, buf.engine, True, max_spins=20)
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

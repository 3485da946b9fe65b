"""Normal mode's call halves as Triton kernels, for both protocols (ubep: `ubep.protocols.ubep.triton_driver`
over its `triton_halves`; bsp: `ubep.protocols.bsp.triton_driver` over its `triton_halves`): one
kernel launch per half or phase over the heap's address table, bit for bit against `ubep.reference`
and against the numba halves, across two processes sharing memory; the outputs padded to
num_worst_tokens; a masked rank; a whole dispatch + combine that reads nothing back on the host; a
peer's out-of-range count and a device wait that runs out, in the CPU protocol's words.

On CPU the kernels run under Triton's interpreter over the shared-memory heap's host addresses:
`test_interpreter_suite` reruns this module with TRITON_INTERPRET=1 (set before triton is imported).
Shapes are tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch
from interpreted import interpreted, run_interpreted
from repo import ROOT
from scenarios import Scenario, expert_output

import ubep
from ubep import fp8, reference

PROTOCOLS = {"ubep": ("UbepTriton", "UbepNumba"), "bsp": ("BspTriton", "BspNumba")}  # triton, numba

R2 = dict(num_ranks=2, num_experts=8, hidden=32, topk=3, capacity=6)
CASES = [  # bf16 with -1 slots and a token routed nowhere; fp32; bf16 sent as FP8 (values + scales)
    (Scenario(name="bf16-minus-one", drop=0.3, nowhere=1, seed=21, **R2), False),
    (Scenario(name="fp32", dtype=torch.float32, seed=22, **R2), False),
    (Scenario(name="fp8", hidden=256, num_ranks=2, num_experts=8, topk=3, capacity=6, seed=23), True),
]


@pytest.mark.timeout(300)
def test_interpreter_suite():
    """This module under TRITON_INTERPRET=1 in a fresh interpreter."""
    run_interpreted(__file__, 280)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_codes_and_layout_are_the_numba_halves(protocol):
    """Both kinds of halves report through one status module and address the same blocks and words
    (the dispatch halves the protocol's own; the combine normal mode's, which both protocols run)."""
    pytest.importorskip("triton")
    import importlib

    package = f"ubep.protocols.{protocol}"
    codes = importlib.import_module(f"{package}.codes")
    blocks = importlib.import_module(f"{package}.blocks")
    kernels = [importlib.import_module(f"{p}.triton_halves") for p in (package, "ubep.protocols.combine")]
    names = [n for m in (codes, blocks) for n in dir(m) if n.isupper() and isinstance(getattr(m, n), int)]
    assert len(names) >= 13
    declared = {n: getattr(codes, n, getattr(blocks, n, None)) for n in names}
    for n, value in declared.items():
        if hasattr(kernels[0], n):
            assert getattr(kernels[0], n).value == value, n
    in_kernels = {n for k in kernels for n in dir(k) if n.startswith("E_")}
    assert {n for n in names if n.startswith("E_")} <= in_kernels
    numba_halves = pytest.importorskip(f"{package}.numba_halves")
    assert all(getattr(numba_halves, n) == v for n, v in declared.items() if hasattr(numba_halves, n))


# --- two processes over the shared-memory heap ----------------------------------------------------


def _payload(x: torch.Tensor, as_fp8: bool):
    return fp8.quantize(x) if as_fp8 else x


def _received(recv_x, as_fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """What the experts compute on: recv_x, or the FP8 pair dequantized."""
    return (recv_x[0].float() * recv_x[1].repeat_interleave(fp8.BLOCK, 1)).to(dtype) if as_fp8 else recv_x


def _calls(buf: ubep.Buffer, sc: Scenario, me: int, as_fp8: bool) -> list[torch.Tensor]:
    """A dispatch, its combine and a cached dispatch on this rank: every output, as tensors."""
    xs, idxs, ws = sc.inputs()
    payload = _payload(xs[me], as_fp8)
    got = buf.dispatch(payload, topk_idx=idxs[me], topk_weights=ws[me])
    y = expert_output(_received(got.recv_x, as_fp8, sc.dtype), me)
    out = buf.combine(y, got.handle, topk_weights=got.recv_topk_weights)
    again = buf.dispatch(payload, handle=got.handle)
    pairs = (got.recv_x, again.recv_x) if as_fp8 else ((got.recv_x,), (again.recv_x,))
    return [
        *pairs[0], *pairs[1], got.recv_topk_idx, got.recv_topk_weights, got.handle.recv_src_token_M,
        got.handle.recv_src_rank_M, torch.tensor(got.num_recv_tokens_per_expert_list), out.combined_x,
        out.combined_topk_weights,
    ]  # fmt: skip


def _check_reference(sc: Scenario, me: int, as_fp8: bool, got: list[torch.Tensor]) -> None:
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
    if as_fp8:  # values (as bytes) and scales, each through the reference
        pairs = [fp8.quantize(x) for x in xs]
        values = reference.dispatch([v.view(torch.uint8) for v, _ in pairs], idxs, ws, sc.num_experts)[me]
        scales = reference.dispatch([s for _, s in pairs], idxs, ws, sc.num_experts)[me]
        assert torch.equal(got[0].view(torch.uint8), values.recv_x_MH), sc.name
        assert torch.equal(got[1], scales.recv_x_MH), sc.name
        assert torch.equal(got[2].view(torch.uint8), values.recv_x_MH), f"{sc.name}: cached"
        return
    mine = ref[me]
    assert torch.equal(got[0], mine.recv_x_MH) and torch.equal(got[1], mine.recv_x_MH), sc.name
    assert torch.equal(got[2], mine.recv_topk_idx_MK) and torch.equal(got[3], mine.recv_topk_weights_MK)
    assert torch.equal(got[4], mine.src_token_M) and torch.equal(got[5], mine.src_rank_M), sc.name
    assert got[6].tolist() == mine.num_recv_tokens_per_expert, sc.name
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    assert torch.equal(got[7], reference.combine(ys, ref, [x.shape[0] for x in xs])[me]), sc.name
    assert torch.equal(got[8], torch.where(idxs[me] >= 0, ws[me], 0.0)), sc.name


def _padded(buf: ubep.Buffer, sc: Scenario, me: int, worst: int) -> None:
    """The same dispatch and combine through the Buffer with num_worst_tokens, which the Triton halves
    take in their plan: every output has `worst` rows, the received ones first (equal to the
    reference's), then the padding; combine takes the padded rows back."""
    xs, idxs, ws = sc.inputs()
    mine = reference.dispatch(xs, idxs, ws, sc.num_experts)[me]
    M = mine.recv_x_MH.shape[0]
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me], num_worst_tokens=worst)
    assert (
        got.recv_x.shape[0] == got.recv_topk_idx.shape[0] == worst
        and got.num_recv_tokens_per_expert_list == []
    )
    assert torch.equal(got.recv_x[:M], mine.recv_x_MH) and not got.recv_x[M:].view(torch.uint8).any()
    assert torch.equal(got.recv_topk_idx[:M], mine.recv_topk_idx_MK) and (got.recv_topk_idx[M:] == -1).all()
    assert torch.equal(got.recv_topk_weights[:M], mine.recv_topk_weights_MK)
    route = got.handle.recv  # the device route is padded too: the halves sized it without a host read
    assert route.src_token_M.shape[0] == worst and torch.equal(route.src_token_M[:M], mine.src_token_M)
    assert (route.src_rank_M[M:] == -1).all()
    y = expert_output(got.recv_x, me)  # the padding rows too: only the received ones travel
    out = buf.combine(y, got.handle, topk_weights=got.recv_topk_weights)
    ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    assert torch.equal(out.combined_x, reference.combine(ys, ref, [x.shape[0] for x in xs])[me])
    assert torch.equal(out.combined_topk_weights, torch.where(idxs[me] >= 0, ws[me], 0.0))


def against_reference_and_numba(_: int) -> list[str]:
    """Each case through Buffer(engine="triton") against the reference, then through the numba halves:
    the same bits. Then num_worst_tokens padding, on the Triton halves. Both protocols."""
    me = torch.distributed.get_rank()
    checked = []
    for protocol, (triton_halves, numba_halves) in PROTOCOLS.items():
        for sc, as_fp8 in CASES:
            kw = dict(hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity,
                      timeout_s=60, protocol=protocol, low_latency=False)  # fmt: skip
            with ubep.Buffer(engine="triton", **kw) as buf:
                assert type(buf._exchange._compiled).__name__ == triton_halves
                assert "call halves one Triton kernel launch each" in buf.explain(), buf.explain()
                got = _calls(buf, sc, me, as_fp8)
                _check_reference(sc, me, as_fp8, got)
                if sc.name == "bf16-minus-one":
                    _padded(buf, sc, me, worst=sc.num_ranks * sc.capacity)
                    checked.append(f"{protocol}:num_worst_tokens")
            with ubep.Buffer(engine="numba", **kw) as buf:
                assert type(buf._exchange._compiled).__name__ == numba_halves
                want = _calls(buf, sc, me, as_fp8)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), sc.name
            checked.append(f"{protocol}:{sc.name}")
    return checked


@interpreted
@pytest.mark.timeout(200)
def test_two_processes_equal_the_reference_and_the_numba_halves():
    got = ubep.LocalLaunch(world_size=2, timeout_s=180).run(against_reference_and_numba, 0)
    cases = ["num_worst_tokens", "bf16-minus-one", "fp32", "fp8"]
    assert got == [[f"{p}:{c}" for p in PROTOCOLS for c in cases]] * 2


# --- the sum order: three ranks in float32 (two terms, or bf16 rows, add up exactly in any order) ----

ORDER = Scenario(name="fp32-three-ranks", num_ranks=3, num_experts=6, hidden=16, topk=3,
                 dtype=torch.float32, seed=31)  # fmt: skip  # summing ranks descending changes bits here


def in_rank_order(rank, protocol: str) -> str:
    sc = ORDER
    kw = dict(hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity, timeout_s=60)
    with ubep.Buffer(rank, engine="triton", protocol=protocol, low_latency=False, **kw) as buf:
        _check_reference(sc, rank.rank, False, _calls(buf, sc, rank.rank, False))
    return "ok"


@interpreted
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_three_ranks_sum_in_the_references_rank_order(protocol):
    from ubep.transport.virtual import VirtualWorld

    assert VirtualWorld(3, timeout_s=120).run(lambda rank: in_rank_order(rank, protocol)) == ["ok"] * 3


# --- a masked rank (virtual ranks: threads of one process over one heap) ---------------------------


def masked(rank, done: threading.Barrier, protocol: str) -> list[int]:
    """Rank 2 leaves; ranks 0 and 1 keep calling normal mode on the device halves, exact against the
    reference restricted to them."""
    from shrinkcase import buffer, normal_call

    with buffer(rank, protocol, timeout_s=60, engine="triton", low_latency=False) as buf:
        assert type(buf._exchange._compiled).__name__ == PROTOCOLS[protocol][0]
        normal_call(buf, 1, set())
        done.wait()
        buf.mask_ranks([2])
        if rank.rank == 2:
            return []
        normal_call(buf, 2, {2})
        return list(buf.masked_ranks)


@interpreted
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_masked_rank_is_left_out(protocol):
    from ubep.transport.virtual import VirtualWorld

    done = threading.Barrier(3)
    assert VirtualWorld(3, timeout_s=120).run(lambda rank: masked(rank, done, protocol)) == [[2], [2], []]


# --- no host sync: a whole call, capturable, with every device-to-host read made to fail ----------


def _capturable(buf: ubep.Buffer, max_spins: int | None = None):
    """Capturable device halves of buf's protocol over its heap (they take up at the host's next call)."""
    from ubep.faults import NO_FAULTS

    ex = buf._exchange
    local = ex._local_of_RE if buf.protocol == "bsp" else ex._local_of_E
    return type(ex._compiled)(ex.t, ex.blocks, buf.sizing, NO_FAULTS, local, buf.engine, True, max_spins)


def without_host_reads(_: int, protocol: str) -> str:
    """Each rank runs dispatch + combine with num_worst_tokens on capturable device halves with host
    reads forbidden, then checks the status words and the results; without num_worst_tokens the
    dispatch reads its one count, and the guard catches it."""
    from test_ll_device import HostSync, _no_host_reads, _restore

    from ubep.results import DispatchHandle

    sc = CASES[0][0]
    me = torch.distributed.get_rank()
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
    ys = [expert_output(ref[r].recv_x_MH, r) for r in range(sc.num_ranks)]
    worst = sc.num_ranks * sc.capacity
    with ubep.Buffer(hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity,
                     timeout_s=60, engine="triton", low_latency=False, protocol=protocol) as buf:  # fmt: skip
        device = _capturable(buf)
        plan, _ = buf._plans.dispatch(xs[me], None, None, None, idxs[me], ws[me], 0)
        patched: list = []
        _no_host_reads(patched)
        try:
            dispatch = buf._calls.next("dispatch")
            got = device.dispatch(dispatch, replace(plan, num_worst_tokens=worst), None)
            handle = DispatchHandle(
                num_tokens=xs[me].shape[0], is_token_in_rank_NR=plan.is_token_in_rank_NR,
                send_counts_R=plan.send_counts_R, recv=got.route, num_recv_tokens_per_expert_list=[],
                seq=dispatch.seq,
            )  # fmt: skip
            y = expert_output(got.recv_x_MH, me)
            out, out_w = device.combine(buf._calls.next("combine"), y, handle, got.recv_topk_weights_MK)
        finally:
            _restore(patched)
        device.check()
        M = ref[me].recv_x_MH.shape[0]
        assert torch.equal(got.recv_x_MH[:M], ref[me].recv_x_MH)
        assert torch.equal(got.recv_topk_idx_MK[:M], ref[me].recv_topk_idx_MK)
        assert torch.equal(out, reference.combine(ys, ref, [x.shape[0] for x in xs])[me])
        assert torch.equal(out_w, torch.where(idxs[me] >= 0, ws[me], 0.0))
        _no_host_reads(patched := [])
        try:  # without num_worst_tokens the receive size is read on the host: the guard sees it
            with pytest.raises(HostSync):
                device.dispatch(buf._calls.next("dispatch"), plan, None)
        finally:
            _restore(patched)
    return "ok"


@interpreted
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_whole_call_with_num_worst_tokens_reads_nothing_back_on_the_host(protocol):
    assert ubep.LocalLaunch(world_size=2, timeout_s=180).run(without_host_reads, 0, protocol) == ["ok", "ok"]


def _layout(topk_idx_NK: torch.Tensor, num_experts: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_token_in_rank bool [N, R], tokens per rank int64 [R]), by a loop over tokens: the reference
    the send kernel's layout is compared with (contiguous experts: E / R a rank)."""
    per_rank = num_experts // num_ranks
    in_rank = torch.zeros(topk_idx_NK.shape[0], num_ranks, dtype=torch.bool)
    for t, row in enumerate(topk_idx_NK.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t, e // per_rank] = True
    return in_rank, in_rank.sum(0)


def buffer_without_host_reads(_: int, protocol: str) -> list[str]:
    """Whole `Buffer` normal-mode calls, capturable, with num_worst_tokens and every host read forbidden:
    get_dispatch_layout (ids outside [0, E) count as none there), dispatch, combine and a cached
    dispatch; the Buffer checks shapes, dtypes and devices, the send
    kernel derives the layout and checks topk_idx's values. Equal to the reference. Then rank 0 passes
    an expert id out of range and rank 1 a repeated expert, still without a host read: `check()`
    raises the host's ValueError on the rank that passed it, and on its peer that it rejected the call.
    Then a good call again: a rejected call leaves the group able to go on. Last, the device's epochs
    follow the host's call numbers, calls that never reached the device included."""
    from test_ll_device import _no_host_reads, _restore

    from ubep.calls import CallCounter
    from ubep.waiting import PeerAbortedError

    sc = replace(CASES[0][0], tokens=(5, 4))  # both ranks send: each passes a bad input once
    R, me, E = sc.num_ranks, torch.distributed.get_rank(), sc.num_experts
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, E)
    mine, M, worst = ref[me], ref[me].recv_x_MH.shape[0], R * sc.capacity
    ys = [expert_output(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]

    def calls(buf: ubep.Buffer, idx: torch.Tensor):
        patched: list = []
        _no_host_reads(patched)
        try:
            layout = buf.get_dispatch_layout(idx, E)  # DeepEP's sequence: the layout, then the dispatch
            got = buf.dispatch(
                xs[me], num_tokens_per_rank=layout.num_tokens_per_rank, topk_idx=idx, topk_weights=ws[me],
                is_token_in_rank=layout.is_token_in_rank, num_worst_tokens=worst,
            )  # fmt: skip
            out = buf.combine(expert_output(got.recv_x, me), got.handle, topk_weights=got.recv_topk_weights)
            again = buf.dispatch(xs[me], handle=got.handle)
        finally:
            _restore(patched)
        in_rank, counts = _layout(idx.where((idx >= -1) & (idx < E), -1), E, R)  # outside [0, E): none
        assert torch.equal(layout.is_token_in_rank, in_rank)
        assert layout.num_tokens_per_rank.tolist() == counts.tolist()
        return got, out, again

    def exact(got, out, again) -> None:
        assert torch.equal(got.recv_x[:M], mine.recv_x_MH) and torch.equal(again.recv_x[:M], mine.recv_x_MH)
        assert not got.recv_x[M:].view(torch.uint8).any() and not again.recv_x[M:].view(torch.uint8).any()
        assert (
            torch.equal(got.recv_topk_idx[:M], mine.recv_topk_idx_MK) and (got.recv_topk_idx[M:] == -1).all()
        )
        assert torch.equal(got.recv_topk_weights[:M], mine.recv_topk_weights_MK)
        assert torch.equal(got.handle.recv.src_token_M[:M], mine.src_token_M)
        in_rank, counts = _layout(idxs[me], E, R)
        assert torch.equal(got.handle.is_token_in_rank_NR, in_rank)
        assert torch.equal(got.handle.send_counts_R, counts)
        assert torch.equal(out.combined_x, want)

    seen = []
    kw = dict(hidden=sc.hidden, num_experts=E, max_tokens_per_rank=sc.capacity, timeout_s=60, engine="triton")
    with ubep.Buffer(low_latency=False, protocol=protocol, capturable=True, **kw) as buf:
        assert "capturable" in buf.explain(), buf.explain()
        result = calls(buf, idxs[me])
        buf.check()
        exact(*result)
        seen.append("exact")
        out_of_range, repeated = idxs[me].clone(), idxs[me].clone()
        out_of_range[0, 0] = E if me == 0 else out_of_range[0, 0]
        if me == 1:
            repeated[2] = torch.tensor([1, 5, 1])
        for bad, by, said in ((out_of_range, 0, rf"values must lie in \[-1, {E}\); found {E}"),
                              (repeated, 1, r"row 2 lists the same expert twice \(1\)")):  # fmt: skip
            calls(buf, bad)
            with pytest.raises(ValueError if me == by else PeerAbortedError) as caught:
                buf.check()
            assert caught.match(said if me == by else rf"rank {by} aborted the call \(it rejected its input")
            seen.append(f"rejected by {by}")
        result = calls(buf, idxs[me])
        buf.check()
        exact(*result)
        seen.append("exact")
        # capturable epochs follow the host's calls, also past calls that never reached the device
        device, host = _capturable(buf), CallCounter()
        for kind, reaches in (("dispatch", 1), ("combine", 1), ("dispatch", 0), ("dispatch", 1),
                              ("combine", 0), ("combine", 0), ("dispatch", 1), ("combine", 1)):  # fmt: skip
            call = host.next(kind)
            if reaches:
                assert int(device._epoch(call)) == call.exact().epoch, (kind, call)
    return seen


@interpreted
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_whole_buffer_call_reads_nothing_back_and_its_kernels_check_the_values(protocol):
    got = ubep.LocalLaunch(world_size=2, timeout_s=280).run(buffer_without_host_reads, 0, protocol)
    assert got == [["exact", "rejected by 0", "rejected by 1", "exact"]] * 2


# --- errors: a peer's out-of-range count, a device wait that runs out -------------------------------


def errors(rank, done: threading.Barrier, protocol: str) -> str:
    """The device halves report what the CPU protocol reports, in its words: a peer's corrupt count,
    this rank's bad topk_idx (found by the send kernel; the peer learns the call was rejected), and,
    capturable, a wait that ran out."""
    from ubep.errors import CommTimeoutError, PeerDataError
    from ubep.faults import FaultPlan
    from ubep.waiting import PeerAbortedError

    sc = CASES[0][0]
    me = rank.rank
    xs, idxs, ws = sc.inputs()
    kw = dict(hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity, timeout_s=30,
              protocol=protocol)  # fmt: skip
    corrupt = FaultPlan(rank=1, point="dispatch.count", action="corrupt", value=sc.capacity + 5)
    with ubep.Buffer(rank, engine="triton", low_latency=False, faults=corrupt, **kw) as buf:
        with pytest.raises((PeerDataError, PeerAbortedError)) as caught:
            buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        if caught.type is PeerDataError:
            said = f"rank 1 announced {sc.capacity + 5} tokens, capacity is {sc.capacity}"
            assert said in str(caught.value), caught.value
        done.wait()
    with ubep.Buffer(rank, engine="triton", low_latency=False, **kw) as buf:  # the send kernel checks
        x, idx, w = xs[me], idxs[me], ws[me]
        if me == 1:  # one token, an expert id out of range
            x, idx, w = xs[0][:1], torch.tensor([[0, 3, sc.num_experts + 2]]), ws[0][:1]
        with pytest.raises(ValueError if me == 1 else PeerAbortedError) as caught:
            buf.dispatch(x, topk_idx=idx, topk_weights=w)
        assert caught.match(
            rf"found {sc.num_experts + 2}" if me == 1 else r"rank 1 aborted the call \(it rejected its input"
        )
        done.wait()
    with ubep.Buffer(rank, engine="triton", low_latency=False, **kw) as buf:
        if me == 0:  # rank 1 sends nothing: a capturable wait runs out and check() names it
            device = _capturable(buf, max_spins=20)
            plan, _ = buf._plans.dispatch(xs[me], None, None, None, idxs[me], ws[me], 0)
            device.dispatch(buf._calls.next("dispatch"), replace(plan, num_worst_tokens=12), None)
            with pytest.raises(CommTimeoutError, match=r"no signal from rank\(s\) 1 .*20 polls"):
                device.check()
        done.wait()
    return "ok"


@interpreted
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_errors_are_the_cpu_protocols(protocol):
    from ubep.transport.virtual import VirtualWorld

    done = threading.Barrier(2)
    assert VirtualWorld(2, timeout_s=120).run(lambda rank: errors(rank, done, protocol)) == ["ok", "ok"]


# --- the device check's normal-mode step, as a dry run on the CPU ----------------------------------


@interpreted
@pytest.mark.timeout(200)
def test_device_normal_script_dry_run():
    """scripts/device_normal.py --smoke: 2 virtual ranks, num_worst_tokens, the replay loop (no graph)."""
    script = ROOT / "scripts" / "device_normal.py"
    run = subprocess.run([sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and "device_normal: ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bit for bit against the reference every replay" in run.stdout, run.stdout


# --- the factory's CUDA branch over a stand-in for symmetric memory, kernels interpreted -------------

CUDA_BRANCH = """
import sys, types
import torch
import torch.distributed as dist

arenas = []
class Handle:
    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        return arenas[0].view(dtype)
fake = types.ModuleType("torch.distributed._symmetric_memory")
fake.empty = lambda n, dtype, device: arenas.append(torch.full((n,), 7, dtype=dtype)) or arenas[-1]
fake.enable_symm_mem_for_group = lambda name: None
fake.rendezvous = lambda tensor, group: Handle()
sys.modules["torch.distributed._symmetric_memory"] = fake
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.synchronize = lambda device=None: None
torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(synchronize=lambda: None)

from ubep import reference
from ubep.calls import CallCounter
from ubep.engine.triton_engine import TritonEngine
from ubep.factory import Options, build
from ubep.faults import FaultPoints
from ubep.group import GroupInfo
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.protocols.base import SendPlan, Sizing
from ubep.results import DispatchHandle
from ubep.transport.cuda import CudaHeap

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
H, E, T, K = 64, 4, 6, 2
sizing = Sizing(hidden=H, capacity=T, max_topk=K, placement=ExpertPlacement.contiguous(E, 1))
options = Options(transport="cuda", protocol=sys.argv[1], low_latency=False, timeout_s=20)
normal, _ = build(GroupInfo(dist.group.WORLD, 0, 1, (0,)), sizing, options, TritonEngine(), FaultPoints())
try:
    assert isinstance(normal.t, CudaHeap) and type(normal._compiled).__name__ == sys.argv[2]
    table, _ = normal.t.address_table(normal.blocks.all())  # every header lives in the arena
    assert (table >= arenas[0].data_ptr()).all() and (table < arenas[0].data_ptr() + arenas[0].numel()).all()
    g = torch.Generator().manual_seed(4)
    calls = CallCounter()
    for step in range(3):  # both halves of the double buffer, and one reuse
        x = (torch.randn(5, H, generator=g) * 3).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
        idx[0, 1] = -1
        w = torch.rand(5, K, generator=g)
        in_rank = token_in_rank(idx, sizing.placement)
        plan = SendPlan(x, idx, w, in_rank, in_rank.sum(0))
        call = calls.next("dispatch")
        got = normal.dispatch(call, plan, None)
        want = reference.dispatch([x], [idx], [w], E)[0]
        assert torch.equal(got.recv_x_MH, want.recv_x_MH)
        assert torch.equal(got.recv_topk_idx_MK, want.recv_topk_idx_MK)
        handle = DispatchHandle(5, in_rank, in_rank.sum(0), got.route, [], seq=call.seq)
        y = (got.recv_x_MH.float() * 0.5 - 1).to(torch.bfloat16)
        out, _ = normal.combine(calls.next("combine"), y, handle, None)
        assert torch.equal(out, reference.combine([y], [want], [5])[0])
    print("CUDA BRANCH OK")
finally:
    normal.t.close()
    dist.destroy_process_group()
"""


@interpreted
@pytest.mark.timeout(200)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_factory_builds_normal_mode_on_the_cuda_heap(protocol):
    """Over a stand-in for symmetric memory: the protocol's headers are laid in the device arena and
    the normal-mode halves run there (three calls: both halves of ubep's double buffer, and a reuse)."""
    cmd = [sys.executable, "-c", CUDA_BRANCH, protocol, PROTOCOLS[protocol][0]]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert "CUDA BRANCH OK" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]

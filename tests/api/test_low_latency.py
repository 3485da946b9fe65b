"""Low-latency dispatch/combine against the reference, on every transport.

One launch per (transport, world size) runs every case on one Buffer, so the
calls also exercise both halves of the double-buffered slots many times over.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import fp8, reference, routing
from ubep.waiting import PeerAbortedError

HIDDEN = 128
CAPACITY = 16  # the Buffer's max_tokens_per_rank
TOPK = 4


@dataclass(frozen=True, kw_only=True)
class LLCase:
    name: str
    T: int = CAPACITY
    tokens: tuple[int, ...] | None = None  # per rank; None: random in [0, T]
    drop: float = 0.0
    use_fp8: bool = False
    mode: str = "sync"  # "sync", "hook" or "async"
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def inputs(self, R: int, E: int):
        gen = torch.Generator().manual_seed(self.seed)
        counts = self.tokens or tuple(int(c) for c in torch.randint(0, self.T + 1, (R,), generator=gen))
        xs, idxs, ws = [], [], []
        for n in counts:
            idx = routing.uniform(n, E, min(TOPK, E), gen)
            if self.drop:
                idx = routing.drop(idx, self.drop, gen)
            xs.append((torch.randn(n, HIDDEN, generator=gen) * 3).to(self.dtype))
            idxs.append(idx)
            ws.append(routing.weights(n, idx.shape[1], gen))
        return xs, idxs, ws


def cases(R: int) -> list[LLCase]:
    return [
        LLCase(name="n-equals-t", tokens=(CAPACITY,) * R, seed=1),
        LLCase(name="n-below-t-with-minus-one", T=12, drop=0.3, mode="hook", seed=2),
        LLCase(name="zero-tokens-on-odd-ranks", tokens=tuple(0 if r % 2 else 9 for r in range(R)), seed=3),
        LLCase(name="async", T=10, mode="async", drop=0.1, seed=4),
        LLCase(name="fp8", use_fp8=True, drop=0.2, seed=5),
        LLCase(name="fp8-hook", T=8, use_fp8=True, mode="hook", seed=6),
        LLCase(name="float32", dtype=torch.float32, mode="hook", seed=7),
    ]


def expert_output(recv_x_LMH: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in for the experts: a rank-dependent affine map of each row."""
    return (recv_x_LMH.float() * (0.5 + rank) - 1.0).to(recv_x_LMH.dtype)


def finish(result, mode: str) -> None:
    """Run the receive half the way `mode` asks for."""
    if mode == "hook":
        result.hook()
    elif mode == "async":
        result.event.wait()


def check_dispatch(got, want: reference.RefLowLatency, xs_rows, case: LLCase, R: int, where: str) -> None:
    """got (a LowLatencyDispatchResult) against the reference, valid rows only."""
    h = got.handle
    L = want.recv_count_L.numel()
    assert got.recv_count.dtype == torch.int32, where
    assert torch.equal(got.recv_count, want.recv_count_L), where
    assert torch.equal(h.layout_range_LR2, want.layout_range_LR2), where
    values = got.recv_x[0] if case.use_fp8 else got.recv_x
    assert tuple(values.shape) == (L, R * case.T, HIDDEN), where
    for j in range(L):
        c = int(want.recv_count_L[j])
        assert torch.equal(h.recv_src_token_LM[j, :c], want.src_token_LM[j, :c]), where
        assert torch.equal(h.recv_src_rank_LM[j, :c], want.src_rank_LM[j, :c]), where
        assert (h.recv_src_token_LM[j, c:] == -1).all(), where
        if not case.use_fp8:
            assert torch.equal(got.recv_x[j, :c], want.recv_x_LMX[j, :c]), where
            continue
        v, s = got.recv_x[0][j, :c], got.recv_x[1][j, :c]
        qv, qs = xs_rows(j, c)
        assert torch.equal(v.view(torch.uint8), qv.view(torch.uint8)), where
        assert torch.equal(s, qs), where
        x = want.recv_x_LMX[j, :c].float()
        assert ((fp8.dequantize(v, s) - x).abs() <= fp8.error_bound(x, s)).all(), where


def run_case(buf: ubep.Buffer, case: LLCase, me: int, R: int, E: int) -> None:
    where = f"{case.name} rank {me}"
    xs, idxs, ws = case.inputs(R, E)
    ref = reference.low_latency_dispatch(xs, idxs, E, case.T)
    quantised_rows = None
    if case.use_fp8:
        qs = [fp8.quantize(x) for x in xs]
        ref_v = reference.low_latency_dispatch([q[0] for q in qs], idxs, E, case.T)[me]
        ref_s = reference.low_latency_dispatch([q[1] for q in qs], idxs, E, case.T)[me]

        def quantised_rows(j, c):
            return ref_v.recv_x_LMX[j, :c], ref_s.recv_x_LMX[j, :c]

    hooked, asynced = case.mode == "hook", case.mode == "async"
    got = buf.low_latency_dispatch(
        xs[me], idxs[me], case.T, E, case.use_fp8, async_finish=asynced, return_recv_hook=hooked
    )
    assert got.handle.received == (case.mode == "sync"), where
    finish(got, case.mode)
    check_dispatch(got, ref[me], quantised_rows, case, R, where)

    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle, asynced, hooked)
    finish(out, case.mode)
    assert out.combined_x.dtype == case.dtype, where
    torch.testing.assert_close(out.combined_x, want, rtol=0, atol=0, msg=where)


def two_outstanding(buf: ubep.Buffer, me: int, R: int, E: int, transport: str) -> None:
    """Two micro-batches in flight, receive halves in reverse order; then the halves are reused."""
    a, b, c = (LLCase(name=f"micro-batch-{i}", drop=0.1, seed=20 + i) for i in range(3))
    inputs = [case.inputs(R, E) for case in (a, b, c)]
    refs = [reference.low_latency_dispatch(xs, idxs, E, CAPACITY) for xs, idxs, _ in inputs]
    sent = [
        buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, return_recv_hook=True)
        for xs, idxs, _ in inputs[:2]
    ]
    sent[1].hook()
    sent[0].hook()
    ys = [[expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)] for ref in refs]
    combines = []
    for i, (_, idxs, ws) in enumerate(inputs[:2]):
        check_dispatch(sent[i], refs[i][me], None, a, R, f"outstanding dispatch {i} rank {me}")
        combines.append(
            buf.low_latency_combine(ys[i][me], idxs[me], ws[me], sent[i].handle, async_finish=True)
        )
    for i in (1, 0):
        combines[i].event.wait()
        xs, idxs, ws = inputs[i]
        want = reference.low_latency_combine(ys[i], refs[i], idxs, ws)[me]
        assert torch.equal(combines[i].combined_x, want), f"outstanding combine {i} rank {me}"
    run_case(buf, c, me, R, E)  # third call: the first call's half again
    if transport == "shm":  # a third send while two await their receive half is refused locally
        xs, idxs, _ = inputs[0]
        held = [
            buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E, return_recv_hook=True) for _ in range(2)
        ]
        with pytest.raises(RuntimeError, match="at most two"):
            buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY, E)
        for result in held:
            result.hook()
        run_case(buf, a, me, R, E)
        run_case(buf, b, me, R, E)


def rejected_then_usable(buf: ubep.Buffer, me: int, R: int, E: int) -> None:
    """N > T on rank 0 raises there before sending; peers are told; the Buffer keeps working."""
    case = LLCase(name="after-rejection", T=8, seed=30)
    xs, idxs, _ = case.inputs(R, E)
    too_many = torch.zeros(case.T + 1, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(case.T + 1, 1, dtype=torch.int64)
    if me == 0:
        with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank=8"):
            buf.low_latency_dispatch(too_many, idx, case.T, E)
    else:
        with pytest.raises(PeerAbortedError, match=r"rank 0|rank\(s\) \[0\]"):
            buf.low_latency_dispatch(xs[me], idxs[me], case.T, E)
    with pytest.raises(ValueError, match="exceeds the Buffer's max_tokens_per_rank"):
        buf.low_latency_dispatch(xs[me], idxs[me], CAPACITY + 1, E)
    for seed in (31, 32):  # both halves of the slots
        run_case(buf, LLCase(name=f"after-rejection-{seed}", T=8, mode="hook", seed=seed), me, R, E)


def ll_matrix(transport: str) -> int:
    me = dist.get_rank() if dist.is_initialized() else 0
    R = dist.get_world_size() if dist.is_initialized() else 1
    E = 4 * R
    with ubep.Buffer(
        hidden=HIDDEN,
        num_experts=E,
        max_tokens_per_rank=CAPACITY,
        transport=transport,
        timeout_s=20,
        low_latency=True,
    ) as buf:
        for case in cases(R):
            run_case(buf, case, me, R, E)
        two_outstanding(buf, me, R, E, transport)
        rejected_then_usable(buf, me, R, E)
    return len(cases(R))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_low_latency_matches_reference(transport, world_size):
    counts = ubep.LocalLaunch(world_size=world_size, timeout_s=180).run(ll_matrix, transport)
    assert counts == [len(cases(world_size))] * world_size


def test_low_latency_eight_ranks_shm():
    counts = ubep.LocalLaunch(world_size=8, timeout_s=240).run(ll_matrix, "shm")
    assert counts == [len(cases(8))] * 8


def test_low_latency_one_rank():
    assert ll_matrix("auto") == len(cases(1))


def test_handle_before_receive_and_foreign_topk_are_rejected():
    with ubep.Buffer(hidden=HIDDEN, num_experts=4, max_tokens_per_rank=4, low_latency=True) as buf:
        x = torch.randn(3, HIDDEN).bfloat16()
        idx = torch.tensor([[0, 1], [2, -1], [-1, -1]])
        w = torch.ones(3, 2)
        got = buf.low_latency_dispatch(x, idx, 4, 4, return_recv_hook=True)
        y = torch.zeros(4, 4, HIDDEN, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="not received yet"):
            buf.low_latency_combine(y, idx, w, got.handle)
        got.hook()
        with pytest.raises(ValueError, match="topk_idx must be the one"):
            buf.low_latency_combine(y, idx.flip(0), w, got.handle)
        with pytest.raises(ValueError, match=r"shape \[L, R \* T, H\]"):
            buf.low_latency_combine(y[:, :2], idx, w, got.handle)
        with pytest.raises(TypeError, match="use_fp8=True"):
            buf.low_latency_dispatch(fp8.quantize(x), idx, 4, 4)
        out = buf.low_latency_combine(y, idx, w, got.handle)
        assert torch.equal(out.combined_x, torch.zeros(3, HIDDEN, dtype=torch.bfloat16))

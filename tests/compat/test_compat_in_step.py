"""The DeepEP layers stay in step when one rank rejects its input or calls with other shapes
(issue 32, items 2 and 3).

Each layer (`deep_ep.Buffer`, `ElasticBuffer`) runs a list of rounds on 2 ranks, new inputs every
round; in some, rank ODD departs: it rejects its input (an expert id out of range, fp16 x, more
tokens than allowed, a bad combine argument), or it calls with another num_experts, T or hidden
than rank 0. Every round must end the same way on both ranks, in that very call:

- a clean round: every result bit for bit the reference's (`ubep.reference`; integer-valued
  tokens, so every sum is exact in any order);
- a rejection: ValueError or TypeError on rank ODD, `PeerAbortedError` naming it on rank 0;
- other shapes: `ConfigMismatchError` on both, naming the field and which ranks hold which value;

and the round after it is exact. Before the fix: wrong rows with no error on rank 0 and on the
rejecting rank's next call, a process ended by gloo (SIGABRT, "Received data size doesn't match
expected size"), or a hang until the launcher's deadline.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import reference
from ubep.compat.deep_ep import Buffer, Config, ElasticBuffer

R, E, H, T, K = 2, 8, 128, 8, 2
ODD = 1  # the rank that departs
TIMEOUT_S = 5  # every deadline of the layers' ubep Buffers
CAPACITY = 4096  # V1's normal-mode tokens per rank: Config's hint for hidden_bytes = 2 H (bf16)
REJECTED = ("ValueError", "TypeError")


def inputs(seed: int, num_experts: int = E, tokens: int | None = None, hidden: int = H):
    """Every rank's (x, topk_idx, topk_weights): integer-valued bf16 tokens, K distinct experts each."""
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for n in (tokens or 5, tokens or 3):
        xs.append(torch.randint(-8, 9, (n, hidden), generator=gen).bfloat16())
        idxs.append(torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(n)]))
        ws.append(torch.ones(n, K))
    return xs, idxs, ws


def expert_output(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    return (recv_x.float() * (rank + 2)).bfloat16()  # still integers: exact sums


def want_combined(xs, idxs, ws, me: int) -> torch.Tensor:
    ref = reference.dispatch(xs, idxs, ws, E)
    ys = [expert_output(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
    return reference.combine(ys, ref, [x.shape[0] for x in xs])[me]


# -- deep_ep.Buffer (V1) ---------------------------------------------------------------------------


def v1_dispatch(buf: Buffer, me: int, seed: int, fault: str | None) -> tuple:
    experts = 4 if fault == "num_experts" else E
    hidden = 2 * H if fault == "hidden" else H
    xs, idxs, ws = inputs(seed, experts, CAPACITY + 1 if fault == "tokens" else None, hidden)
    x, idx = xs[me], idxs[me]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    if fault == "expert":
        idx = idx.clone()
        idx[0, 0] = experts  # out of range, after a layout of the good routing
    if fault == "fp16":
        x = x.half()
    return buf.dispatch(
        x,
        topk_idx=idx,
        topk_weights=ws[me],
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    ), (xs, idxs, ws)


def v1_round(buf: Buffer, me: int, seed: int, call: str, fault: str | None) -> bool:
    """One round; True when every result equals the reference."""
    if call == "ll":
        return v1_low_latency(buf, me, seed, fault)
    got, (xs, idxs, ws) = v1_dispatch(buf, me, seed, fault if call == "dispatch" else None)
    recv_x, recv_idx, _, _, handle, _ = got
    ref = reference.dispatch(xs, idxs, ws, E)[me]
    exact = torch.equal(recv_x, ref.recv_x_MH) and torch.equal(recv_idx, ref.recv_topk_idx_MK)
    bias = torch.zeros(xs[me].shape[0] + (fault == "bias"), H)  # one row too many: rejected
    combined, _, _ = buf.combine(expert_output(recv_x, me), handle, bias=bias)
    return exact and torch.equal(combined, want_combined(xs, idxs, ws, me))


def v1_low_latency(buf: Buffer, me: int, seed: int, fault: str | None) -> bool:
    tokens = T // 2 if fault == "T" else T
    xs, idxs, ws = inputs(seed)
    got = buf.low_latency_dispatch(
        xs[me], idxs[me], tokens, E, use_fp8=False, use_ue8m0=fault == "ue8m0"
    )  # use_ue8m0 without round_scale: rejected by the layer itself
    recv_x, recv_count, handle, _, _ = got
    ref = reference.low_latency_dispatch(xs, idxs, E, T)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    combined, _, _ = buf.low_latency_combine(expert_output(recv_x, me), idxs[me], ws[me], handle)
    want = reference.low_latency_combine(ys, ref, idxs, ws)[me]
    return torch.equal(recv_count, ref[me].recv_count_L) and torch.equal(combined, want)


def run_rounds(layer: str, rounds: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """Every round's outcome on this rank: ("exact" or "WRONG", "") or (error type, message)."""
    os.environ["UBEP_TIMEOUT_S"] = str(TIMEOUT_S)  # the V1 layer's ubep Buffers (this rank process only)
    me = dist.get_rank()
    if layer == "v1":
        ll_bytes = Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
        buf = Buffer(None, Config().get_nvl_buffer_size_hint(2 * H, R), ll_bytes, low_latency_mode=True)
        play = v1_round
    else:
        buf = ElasticBuffer(
            None, num_max_tokens_per_rank=T, hidden=H, num_topk=K, num_cpu_timeout_secs=TIMEOUT_S
        )
        play = elastic_round
    seen = []
    for seed, (call, fault) in enumerate(rounds):
        try:
            exact = play(buf, me, seed, call, fault if me == ODD else None)
            seen.append(("exact" if exact else "WRONG", ""))
        except Exception as error:  # a raw backend error too: the test names it
            seen.append((type(error).__name__, str(error)))
    return seen


# -- ElasticBuffer (V2) ----------------------------------------------------------------------------


def elastic_round(buf: ElasticBuffer, me: int, seed: int, call: str, fault: str | None) -> bool:
    experts = 4 if fault == "num_experts" else E
    hidden = 2 * H if fault == "hidden" else H
    tokens = T // 2 if fault == "T" else T
    xs, idxs, ws = inputs(seed, experts, T + 1 if fault == "tokens" else None, hidden)
    x, idx = xs[me], idxs[me]
    if fault == "expert":
        idx = idx.clone()
        idx[0, 0] = experts
    if fault == "fp16":
        x = x.half()
    recv_x, recv_idx, _, handle, _ = buf.dispatch(
        x, topk_idx=idx, num_experts=experts, num_max_tokens_per_rank=tokens
    )
    ref = reference.dispatch(xs, idxs, ws, E)[me]
    exact = torch.equal(recv_x, ref.recv_x_MH) and torch.equal(recv_idx, ref.recv_topk_idx_MK)
    if call == "cached":  # topk_idx with a handle: rejected by the layer
        again, _, _, _, _ = buf.dispatch(x, handle=handle, topk_idx=idx if fault == "cached" else None)
        exact &= torch.equal(again, ref.recv_x_MH)
    y = expert_output(recv_x, me)
    combined, _, _ = buf.combine(y.half() if fault == "combine" else y, handle)
    return exact and torch.equal(combined, want_combined(xs, idxs, ws, me))


# -- the rounds and what each must end in ----------------------------------------------------------

V1_ROUNDS = [  # (call, what rank ODD does differently); None: nothing
    ("dispatch", None),
    ("dispatch", "expert"),
    ("dispatch", None),
    ("dispatch", "fp16"),
    ("dispatch", None),
    ("dispatch", "tokens"),
    ("dispatch", None),
    ("combine", "bias"),
    ("dispatch", None),
    ("ll", None),
    ("ll", "ue8m0"),
    ("ll", None),
    ("dispatch", "num_experts"),
    ("dispatch", None),
    ("dispatch", "hidden"),
    ("dispatch", None),
    ("ll", "T"),
    ("ll", None),
]
ELASTIC_ROUNDS = [
    ("dispatch", None),
    ("dispatch", "expert"),
    ("dispatch", None),
    ("dispatch", "fp16"),
    ("dispatch", None),
    ("dispatch", "tokens"),
    ("dispatch", None),
    ("dispatch", "combine"),
    ("cached", None),
    ("cached", "cached"),
    ("dispatch", None),
    ("dispatch", "num_experts"),
    ("dispatch", None),
    ("dispatch", "T"),
    ("dispatch", None),
    ("dispatch", "hidden"),
    ("dispatch", None),
]
MISMATCHED = {  # fault: the field every rank's ConfigMismatchError names, with the values
    "num_experts": f"num_experts (rank(s) 0: {E}; rank(s) 1: 4)",
    "hidden": f"hidden (rank(s) 0: {H}; rank(s) 1: {2 * H})",
    "T": f"num_max_tokens_per_rank (rank(s) 0: {T}; rank(s) 1: {T // 2})",
}
V1_T = f"num_max_dispatch_tokens_per_rank (rank(s) 0: {T}; rank(s) 1: {T // 2})"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layer,rounds", [("v1", V1_ROUNDS), ("elastic", ELASTIC_ROUNDS)])
def test_a_rank_that_rejects_or_differs_fails_every_rank_in_that_call_and_the_next_is_exact(layer, rounds):
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=200).outcomes(run_rounds, layer, rounds)
    for o in outcomes:  # a SIGABRT from gloo shows here as a rank that died with no result
        assert o.ok, f"rank {o.rank}: {o.cause}, exit code {o.exit_code}: {o.error}"
    seen = [o.result for o in outcomes]
    for i, (call, fault) in enumerate(rounds):
        mine, odd = seen[0][i], seen[ODD][i]
        where = f"round {i} ({call}, {fault}): rank 0 {mine}, rank {ODD} {odd}"
        if fault is None:
            assert mine[0] == odd[0] == "exact", where
        elif fault in MISMATCHED:
            said = V1_T if (layer, fault) == ("v1", "T") else MISMATCHED[fault]
            for error, message in (mine, odd):
                assert error == "ConfigMismatchError" and f"ranks disagree on {said}" in message, where
        else:
            assert odd[0] in REJECTED, where
            assert mine[0] == "PeerAbortedError" and f"rank {ODD} aborted the call" in mine[1], where

"""Low-latency mode on a heap, with a peer's published source-token index rewritten.

A sender writes, beside each row it puts in the receiver's slots, the row's
source token and top-k slot (`ll.slot_info`). The receiver must check those
before it places rows or routes the combine by them: a rewritten one must give
PeerDataError naming the sender, never an IndexError or a wrong `combined_x`.

The ranks are threads of one process (`VirtualWorld`), so the test rewrites the
word in the receiver's memory between the sender's send half and the
receiver's receive half, exactly where a hostile or broken peer would.
"""

from __future__ import annotations

import threading

import pytest
import torch

import ubep
from ubep import reference
from ubep.calls import CallId
from ubep.errors import PeerDataError, UbepError
from ubep.transport.virtual import VirtualRank, VirtualWorld

R, E, H, T, K = 2, 4, 32, 6, 2
TIMEOUT_S = 1.0
ENGINES = ["torch", "numba"]


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r's tokens: each selects one expert on rank 0 (rank 0 reads every rank's indices),
    and rank 0's tokens one on rank 1 as well."""
    gen = torch.Generator().manual_seed(10 + rank)
    x_NH = torch.randn(T, H, generator=gen)
    topk_idx_NK = torch.stack(
        [torch.randperm(E // R, generator=gen) for _ in range(T)]
    )  # experts 0, 1: rank 0
    topk_idx_NK[:, 1] += E // R if rank == 0 else 0  # rank 0's tokens also select an expert on rank 1
    if rank == 1:
        topk_idx_NK[:, 1] = -1
    topk_weights_NK = torch.rand(T, K, generator=gen)
    return x_NH, topk_idx_NK, topk_weights_NK


def expert(recv_x_LMH: torch.Tensor) -> torch.Tensor:
    return recv_x_LMH * 2.0 + 1.0


def corrupt_indices_from(buf: ubep.Buffer, me: int, src: int, value: int) -> None:
    """Rewrite, in `me`'s memory, every source-token word rank `src` published there (both halves)."""
    ll = buf._ll
    for epoch in (0, 1):
        ll.t.view(ll.blocks.slot_info, me, CallId(0, epoch))[src].fill_(value)


def one_call(rank: VirtualRank, sent: threading.Barrier, value: int | None, engine: str):
    """Dispatch (send half), wait for every rank's send, maybe corrupt, receive, combine.

    Returns combined_x, or the exception this rank's calls raised."""
    x_NH, topk_idx_NK, topk_weights_NK = inputs(rank.rank)
    with ubep.Buffer(
        rank,
        hidden=H,
        num_experts=E,
        max_tokens_per_rank=T,
        max_topk=K,
        timeout_s=TIMEOUT_S,
        engine=engine,
        low_latency=True,
    ) as buf:
        both_past = False  # once both ranks left the barriers, breaking it would only hit a slow leaver
        try:
            d = buf.low_latency_dispatch(x_NH, topk_idx_NK, T, E, return_recv_hook=True)
            sent.wait(TIMEOUT_S)
            if value is not None and rank.rank == 0:
                corrupt_indices_from(buf, 0, 1, value)
            sent.wait(TIMEOUT_S)
            both_past = True
            d.hook()
            return buf.low_latency_combine(
                expert(d.recv_x), topk_idx_NK, topk_weights_NK, d.handle
            ).combined_x
        except UbepError as error:
            if not both_past:
                sent.abort()
            return error


def run(value: int | None, engine: str) -> list:
    sent = threading.Barrier(R)
    return VirtualWorld(R, timeout_s=30).run(lambda rank: one_call(rank, sent, value, engine))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_untouched_indices_combine_as_the_reference(engine):
    """The harness itself: without a rewrite both ranks get the reference's combined_x."""
    got = run(None, engine)
    xs, idxs, ws = zip(*(inputs(r) for r in range(R)), strict=True)
    dispatched = reference.low_latency_dispatch(list(xs), list(idxs), E, T)
    want = reference.low_latency_combine(
        [expert(d.recv_x_LMX) for d in dispatched], dispatched, list(idxs), list(ws)
    )
    for r in range(R):
        assert isinstance(got[r], torch.Tensor), (r, got[r])
        torch.testing.assert_close(got[r], want[r], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "value", [-1, -(K * T), K * T, 2**62], ids=["minus-one", "negative", "one-past", "huge"]
)
@pytest.mark.parametrize("engine", ENGINES)
def test_rewritten_source_token_index_blames_the_sender(value, engine):
    got = run(value, engine)
    assert isinstance(got[0], PeerDataError), got[0]  # not IndexError, not a combined_x
    assert "rank 1 sent token indices out of range" in str(got[0]), got[0]
    # rank 1 gets no combined_x either: rank 0 never sends its rows back
    assert isinstance(got[1], UbepError), got[1]

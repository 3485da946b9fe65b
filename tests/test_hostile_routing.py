"""A peer that lists a token for this rank whose routing selects none of this rank's experts is
named by the rank that finds it, on both engines (issue 23, item 5).

Rank 1 routes every token to its own experts but, as a broken or hostile peer would, also lists
token 0 for rank 0. Rank 0 must raise `PeerDataError` naming rank 1, not a bare "a peer".
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ubep
from ubep.errors import PeerDataError
from ubep.transport.virtual import VirtualWorld

R, E, N, H = 2, 4, 3, 8  # rank 0 holds experts 0 and 1, rank 1 experts 2 and 3


def _lists_a_token_it_does_not_route(exchange) -> None:
    """Make `exchange` (rank 1's) list token 0 for rank 0 on its next dispatch."""
    honest = exchange.dispatch

    def dispatch(call, plan, handle):
        in_rank_NR = plan.is_token_in_rank_NR.clone()
        in_rank_NR[0, 0] = True
        counts_R = plan.send_counts_R.clone()
        counts_R[0] += 1
        return honest(
            call, dataclasses.replace(plan, is_token_in_rank_NR=in_rank_NR, send_counts_R=counts_R), handle
        )

    exchange.dispatch = dispatch


def _step(rank, engine: str) -> str:
    x = torch.ones(N, H)
    idx = torch.tensor([[2, 3]] * N) if rank.rank == 1 else torch.tensor([[0, 2]] * N)
    w = torch.ones(N, 2)
    with ubep.Buffer(rank, hidden=H, num_experts=E, max_tokens_per_rank=N, engine=engine, timeout_s=5) as buf:
        if rank.rank == 1:
            _lists_a_token_it_does_not_route(buf._exchange)
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w)
        except PeerDataError as error:
            return str(error)
        return ""


@pytest.mark.parametrize("engine", ["torch", "numba"])
def test_a_token_listed_for_no_local_expert_names_its_sender(engine):
    if engine == "numba":
        pytest.importorskip("numba")
    said = VirtualWorld(R, timeout_s=60).run(lambda rank: _step(rank, engine))
    assert "rank 1 listed a token for this rank that selects none of its experts" in said[0], said

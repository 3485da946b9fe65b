"""Test scenarios: every rank rebuilds every rank's inputs from a seed, so each
rank can check its own outputs against the plain-torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubep import reference, routing


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    num_ranks: int
    num_experts: int
    hidden: int = 64
    topk: int = 4
    capacity: int = 24
    tokens: tuple[int, ...] | None = None  # per rank; None: random in [0, capacity]
    kind: str = "uniform"  # a ubep.routing name
    skew: float = 1.0
    drop: float = 0.0  # fraction of top-k entries set to -1
    nowhere: int = 0  # tokens per rank routed to no expert at all
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def inputs(self):
        """(xs, topk_idxs, topk_weights): one entry per rank."""
        gen = torch.Generator().manual_seed(self.seed)
        R = self.num_ranks
        counts = self.tokens or tuple(
            int(c) for c in torch.randint(0, self.capacity + 1, (R,), generator=gen)
        )
        xs, idxs, ws = [], [], []
        for n in counts:
            idx = routing.make(self.kind, n, self.num_experts, self.topk, gen, skew=self.skew)
            if self.drop:
                idx = routing.drop(idx, self.drop, gen)
            if self.nowhere:
                idx[: min(self.nowhere, n)] = -1
            xs.append((torch.randn(n, self.hidden, generator=gen) * 3).to(self.dtype))
            idxs.append(idx)
            ws.append(routing.weights(n, self.topk, gen))
        return xs, idxs, ws

    def expected(self):
        xs, idxs, ws = self.inputs()
        return xs, idxs, ws, reference.dispatch(xs, idxs, ws, self.num_experts)


def assert_dispatch_matches(got, mine: reference.RefDispatch, where: str) -> None:
    """A normal-mode dispatch result equals the reference's, bit for bit, handle included."""
    assert torch.equal(got.recv_x, mine.recv_x_MH), where
    assert torch.equal(got.recv_topk_idx, mine.recv_topk_idx_MK), where
    assert torch.equal(got.recv_topk_weights, mine.recv_topk_weights_MK), where
    assert got.num_recv_tokens_per_expert_list == mine.num_recv_tokens_per_expert, where
    assert torch.equal(got.handle.recv_src_rank_M, mine.src_rank_M), where
    assert torch.equal(got.handle.recv_src_token_M, mine.src_token_M), where


def expert_output(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """A deterministic stand-in for the experts: scale rows by a rank-dependent factor."""
    return (recv_x.float() * (0.5 + rank) - 1.0).to(recv_x.dtype)


def scenarios_for(num_ranks: int) -> list[Scenario]:
    """The matrix the core issue asks for, at one world size."""
    R = num_ranks
    many = 4 * R
    out = [
        Scenario(name="uniform-many-experts", num_ranks=R, num_experts=many, seed=1),
        Scenario(name="one-expert-per-rank", num_ranks=R, num_experts=R, topk=min(2, R), seed=2),
        Scenario(name="hot-experts", num_ranks=R, num_experts=many, kind="hot", skew=0.8, seed=3),
        Scenario(
            name="zipf-float32",
            num_ranks=R,
            num_experts=many,
            kind="zipf",
            skew=1.2,
            dtype=torch.float32,
            seed=4,
        ),
        Scenario(name="minus-one-and-nowhere", num_ranks=R, num_experts=many, drop=0.3, nowhere=3, seed=5),
        Scenario(
            name="rank-with-zero-tokens",
            num_ranks=R,
            num_experts=many,
            tokens=tuple(0 if r == R - 1 else 24 for r in range(R)),
            seed=6,
        ),
        Scenario(
            name="full-capacity", num_ranks=R, num_experts=many, topk=min(8, many), tokens=(24,) * R, seed=7
        ),
    ]
    return out

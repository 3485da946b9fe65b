"""Synthetic MoE routing for benchmarks and tests: what a router's top-k looks like.

Every function returns `topk_idx_NK` (int64, no expert twice in a row) drawn
from a seeded generator, so all ranks can rebuild every rank's routing.
"""

from __future__ import annotations

import torch

ROUTINGS = ("uniform", "zipf", "deepseek-groups", "hot")


def _draw(probs_NE: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per row, drawn without replacement in proportion to probs."""
    if probs_NE.shape[0] == 0:
        return torch.empty(0, k, dtype=torch.int64, device=probs_NE.device)
    return torch.multinomial(probs_NE, k, replacement=False, generator=gen)


def uniform(n: int, num_experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Every expert equally likely."""
    return _draw(torch.ones(n, num_experts, dtype=torch.float32, device=gen.device), k, gen)


def zipf(n: int, num_experts: int, k: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Expert popularity falls as 1 / rank^skew; popular experts are scattered over ranks."""
    weights_E = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64, device=gen.device) ** skew
    weights_E = weights_E[torch.randperm(num_experts, generator=gen, dtype=torch.int64, device=gen.device)]
    return _draw(weights_E.float().expand(n, -1), k, gen)


def hot(
    n: int, num_experts: int, k: int, num_hot: int, hot_share: float, gen: torch.Generator
) -> torch.Tensor:
    """`num_hot` experts (the first ones) receive `hot_share` of the probability mass."""
    num_hot = min(num_hot, num_experts)
    weights_E = torch.full(
        (num_experts,),
        (1 - hot_share) / max(num_experts - num_hot, 1),
        dtype=torch.float32,
        device=gen.device,
    )
    weights_E[:num_hot] = hot_share / max(num_hot, 1)
    return _draw(weights_E.expand(n, -1), k, gen)


def deepseek_groups(
    n: int, num_experts: int, k: int, gen: torch.Generator, groups: int = 8, groups_per_token: int = 4
) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: each token picks `groups_per_token` of
    `groups` expert groups, then its top-k experts inside them."""
    per_group = num_experts // groups
    chosen_NG = _draw(torch.ones(n, groups, dtype=torch.float32, device=gen.device), groups_per_token, gen)
    allowed_NE = torch.zeros(n, groups, dtype=torch.bool, device=gen.device)
    allowed_NE.scatter_(1, chosen_NG, True)
    allowed_NE = allowed_NE.repeat_interleave(per_group, dim=1)
    return _draw(allowed_NE.float(), k, gen)


def make(
    kind: str, n: int, num_experts: int, k: int, gen: torch.Generator, skew: float = 1.0
) -> torch.Tensor:
    """Routing by name (`ROUTINGS`); `skew` is zipf's exponent or, for "hot", the hot share."""
    if kind == "uniform":
        return uniform(n, num_experts, k, gen)
    if kind == "zipf":
        return zipf(n, num_experts, k, skew, gen)
    if kind == "deepseek-groups":
        return deepseek_groups(n, num_experts, k, gen)
    if kind == "hot":
        return hot(n, num_experts, k, num_hot=max(1, num_experts // 32), hot_share=min(skew, 0.99), gen=gen)
    raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")


def drop(topk_idx_NK: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A copy with about `fraction` of the entries replaced by -1 ("no expert")."""
    mask = torch.rand(topk_idx_NK.shape, generator=gen, dtype=torch.float32, device=gen.device) < fraction
    return torch.where(mask, torch.full_like(topk_idx_NK, -1), topk_idx_NK)


def weights(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [n, k] router weights (softmax-like, rows sum to 1)."""
    return torch.softmax(torch.randn(n, k, generator=gen, dtype=torch.float32, device=gen.device), dim=1)

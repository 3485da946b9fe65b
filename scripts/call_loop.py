"""Dispatch + combine in a tight loop on local ranks, no bench around it: the slowest rank's wall
and each rank's CPU per pair, in microseconds. For before/after comparisons of the per-call cost
(docs/benchmarks-log.md, "Fewer torch calls around the halves"):

    python scripts/call_loop.py [--ranks 2] [--tokens 8] [--pairs 5000]

To compare with another commit, run it in turn with PYTHONPATH set to that commit's `src` (a git
worktree; run `ubep warm` there once), a few times each.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import ubep
from ubep.launcher import LocalLaunch

H, E, K = 7168, 256, 8  # DeepSeek-V3's hidden size, experts and top-k


def pairs(tokens: int, count: int) -> tuple[float, float]:
    """(wall us, CPU us) per dispatch + combine on this rank, after 50 untimed pairs."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=gen)
    with ubep.Buffer(dist.group.WORLD, hidden=H, num_experts=E, max_tokens_per_rank=128) as buf:
        for _ in range(50):
            d = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(d.recv_x, d.handle)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            d = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(d.recv_x, d.handle)
        return (time.perf_counter() - wall) / count * 1e6, (time.process_time() - cpu) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=5000)
    args = parser.parse_args()
    got = LocalLaunch(world_size=args.ranks, timeout_s=1800).run(pairs, args.tokens, args.pairs)
    print(
        f"{args.ranks} ranks, {args.tokens} tokens: {max(w for w, _ in got):,.0f} us per pair (slowest), "
        f"CPU per rank {min(c for _, c in got):,.0f}-{max(c for _, c in got):,.0f} us"
    )


if __name__ == "__main__":
    main()

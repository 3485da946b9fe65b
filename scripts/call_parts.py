"""What the Python around a decode-size dispatch costs, piece by piece, warm and in isolation: the
send plan (validation and the compiled routing check), its parts, and the numpy views the halves
take. The upper bound of what moving a piece into a compiled half can save (docs/benchmarks-log.md,
"What the rest of item 2 would save"):

    python scripts/call_parts.py [--tokens 8] [--number 20000]

Each piece is timed alone on rank 0 of two local ranks, best of three repeats of `--number` calls.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.distributed as dist

import ubep
from ubep import validate
from ubep.launcher import LocalLaunch

H, E, K, T = 7168, 256, 8, 128  # DeepSeek-V3's hidden size, experts and top-k; tokens a Buffer holds


def pieces(tokens: int, number: int) -> dict[str, float]:
    """Microseconds per call of each piece, on this rank."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    with ubep.Buffer(dist.group.WORLD, hidden=H, num_experts=E, max_tokens_per_rank=T) as buf:
        R, Kmax = buf.num_ranks, buf.sizing.max_topk
        timed = {
            "send plan (all of the Buffer's checks)": lambda: buf._plans.dispatch(
                x, None, None, None, idx, w, 0
            ),
            "  routing check and layout (compiled)": lambda: buf._plans.route(
                idx, buf._plans.rank_of_expert_E, R
            ),
            "  x's shape and dtype": lambda: validate.payload("x", x, H, T),
            "  topk_idx's shape and dtype": lambda: validate.topk_idx(idx, tokens, E, Kmax, values=False),
            "  topk_weights' shape and dtype": lambda: validate.topk_weights(w, (tokens, K)),
            "a numpy view of a tensor": lambda: idx.numpy(),
            "a byte view of bf16 rows": lambda: x.view(torch.uint8).numpy(),
            "a scratch array (np.zeros(6))": lambda: np.zeros(6, dtype=np.int64),
        }
        best = {name: min(timeit.repeat(fn, number=number, repeat=3)) for name, fn in timed.items()}
        dist.barrier()
    return {name: seconds / number * 1e6 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    got = LocalLaunch(world_size=2, timeout_s=600).run(pieces, args.tokens, args.number)[0]
    for name, us in got.items():
        print(f"{name:42s} {us:6.2f} us")


if __name__ == "__main__":
    main()

"""The DeepEP shim's first call against its later ones (issue 42): DeepEP allocates in its Buffer's
constructor, so a first dispatch costs what a later one does; a shim that builds at the first call
makes that call pay for the build.

On R local ranks (`ubep.LocalLaunch`), each rank times `deep_ep.Buffer(...)`, then `--calls`
rounds of get_dispatch_layout + dispatch + combine (normal mode, sized by
`Config.get_nvl_buffer_size_hint`), or of low_latency_dispatch + low_latency_combine (`--mode ll`,
sized by `get_low_latency_rdma_size_hint`). It prints, for the slowest rank, the constructor's
seconds, the first round's and the median of the later rounds', and their ratio:

    PYTHONPATH=src python scripts/deep_ep_first_call.py [--ranks 2] [--mode normal|ll] [--tokens 128]

Run `ubep warm` first: a cold numba cache makes every first call slow, here and anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ubep.compat import deep_ep
from ubep.launcher import LocalLaunch

H, E, K = 7168, 256, 8  # DeepSeek-V3's hidden size, experts and top-k, as in DeepEP's tests


def _normal_round(buf: deep_ep.Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w,
    )  # fmt: skip
    buf.combine(recv_x, handle)


def _ll_round(buf: deep_ep.Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, x.shape[0], E, use_fp8=False)
    buf.low_latency_combine(recv_x, idx, w, handle)


def rank_times(mode: str, tokens: int, calls: int) -> tuple[float, list[float]]:
    """(constructor seconds, each round's seconds) on this rank."""
    R = dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen, device="cpu")[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=gen, dtype=torch.float32, device="cpu")
    dist.barrier()
    start = time.perf_counter()
    if mode == "ll":
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, H, R, E)
        buf = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True)
    else:
        buf = deep_ep.Buffer(
            dist.group.WORLD, deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
        )
    built = time.perf_counter() - start
    rounds = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        (_ll_round if mode == "ll" else _normal_round)(buf, x, idx, w)
        rounds.append(time.perf_counter() - start)
    return built, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mode", choices=("normal", "ll"), default="normal")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    got = LocalLaunch(world_size=args.ranks, timeout_s=600).run(
        rank_times, args.mode, args.tokens, args.calls
    )
    built = max(b for b, _ in got)
    rounds = [max(r[i] for _, r in got) for i in range(args.calls)]  # the slowest rank's, per round
    later = statistics.median(rounds[1:])
    print(
        f"deep_ep.Buffer ({args.mode}), {args.ranks} ranks, {args.tokens} tokens, hidden {H}: constructor "
        f"{built:.3f} s, first round {rounds[0]:.3f} s, later rounds (median) {later:.3f} s, "
        f"first / later {rounds[0] / later:.1f}"
    )


if __name__ == "__main__":
    main()

"""What ubep's part of a vLLM DP=2 + EP decode step costs: the plugin's dispatch + combine
(`EPExchange`) alone, on the shapes of scripts/vllm_check.py's model (hidden 1024, 32 experts,
top-4, float32, 4 MoE layers), for the batches of its table (N sequences in total, N / 2 per
rank). Run it with ubep's environment (no vLLM needed) and set the result beside the table's
ms per step:

    python scripts/vllm_exchange_cost.py [--protocol ubep|bsp] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ubep
from ubep.integrations.vllm.manager import EPExchange, GroupExperts

HIDDEN, EXPERTS, TOPK, LAYERS = 1024, 32, 4, 4
BATCHES = (2, 8, 32)  # sequences in total, as in vllm_check.py


def per_step_ms(protocol: str, calls: int) -> dict[int, float]:
    """Median over calls of (dispatch + combine) x LAYERS, slowest rank, per batch."""
    me, R = dist.get_rank(), dist.get_world_size()
    local = EXPERTS // R
    maps = torch.full((R, EXPERTS), -1, dtype=torch.int32)
    for r in range(R):
        maps[r, r * local : (r + 1) * local] = torch.arange(local, dtype=torch.int32)
    experts = GroupExperts.from_expert_maps(maps, me)
    buffer = ubep.Buffer(
        hidden=HIDDEN,
        num_experts=EXPERTS,
        max_tokens_per_rank=max(BATCHES),
        protocol=protocol,
        expert_placement=experts.owner_B,
        low_latency=False,
    )
    exchange = EPExchange(buffer, experts)
    gen = torch.Generator().manual_seed(me)
    result = {}
    for n in BATCHES:
        tokens = n // R
        x = torch.randn(tokens, HIDDEN, generator=gen)
        ids = torch.rand(tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.rand(tokens, TOPK, generator=gen), dim=1)
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            recv_x, _, _ = exchange.dispatch(x, w, ids)
            exchange.combine(recv_x)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result[n] = 1e3 * LAYERS * statistics.median(slowest.tolist())
    exchange.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--protocol", default="ubep", choices=("ubep", "bsp"))
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    got = ubep.LocalLaunch(world_size=2, timeout_s=600).run(per_step_ms, args.protocol, args.calls)[0]
    print(f"ubep dispatch + combine per decode step ({LAYERS} MoE layers, protocol {args.protocol}), ms:")
    print("| N | " + " | ".join(str(n) for n in BATCHES) + " |")
    print("|---|" + "---|" * len(BATCHES))
    print("| ms | " + " | ".join(f"{got[n]:.2f}" for n in BATCHES) + " |")


if __name__ == "__main__":
    main()

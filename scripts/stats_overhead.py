"""What recording stats costs one rank per dispatch + combine, at `ubep bench`'s default shape.

    python scripts/stats_overhead.py [--reps 21] [--pairs 500]

Rank 0's share of the default shape (8 ranks x 128 tokens, H 7168, top-8 of 256 experts,
uniform routing, bf16): its real send plan and handle, through `RecordedExchange`, over a
stand-in exchange that answers at once, so the time measured is the recording alone.
Without and with recording alternate within every repetition; times are the calling thread's
CPU time (`time.thread_time`, which a busy shared host inflates far less than wall time),
medians over repetitions. `ubep bench --stats` measures the same thing end to end, as the
ratio of the ubep-stats row to the ubep row in the same rounds; on a host whose noise is
larger than the effect, this is the figure that resolves it (docs/observability.md).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from types import SimpleNamespace

import torch

from ubep import routing
from ubep.calls import CallCounter
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.observe.recording import RecordedExchange, Recorder
from ubep.protocols.base import SendPlan
from ubep.results import RecvRoute
from ubep.stats import StatsOptions

R, N, H, E, K = 8, 128, 7168, 256, 8


def pairs(reps: int, count: int) -> tuple[float, float]:
    """Median CPU microseconds per dispatch + combine: (stand-in alone, with recording)."""
    gen = torch.Generator().manual_seed(0)
    idx_NK = routing.make("uniform", N, E, K, gen)
    in_rank_NR = token_in_rank(idx_NK, ExpertPlacement.contiguous(E, R))
    plan = SendPlan(
        torch.randn(N, H).bfloat16(), idx_NK, torch.rand(N, K), in_rank_NR, in_rank_NR.sum(0), None
    )
    M = int(in_rank_NR.sum())  # about what rank 0 receives under uniform routing
    prefix_R1 = torch.linspace(0, M, R + 1).long()
    got = SimpleNamespace(recv_x_MH=torch.empty(M, H, dtype=torch.bfloat16))
    handle = SimpleNamespace(recv=RecvRoute(torch.empty(M, dtype=torch.long), prefix_R1, None), num_tokens=N)
    y_MH = torch.empty(M, H, dtype=torch.bfloat16)
    stand_in = SimpleNamespace(dispatch=lambda call, p, h: got, combine=lambda call, x, h, w: (None, None))
    recorded = RecordedExchange(stand_in, Recorder(0, R, E, StatsOptions(), logging.getLogger("ubep")))
    counter = CallCounter()

    def run(exchange) -> float:
        start = time.thread_time()
        for _ in range(count):
            exchange.dispatch(counter.next("dispatch"), plan, None)
            exchange.combine(counter.next("combine"), y_MH, handle, None)
        return (time.thread_time() - start) / count * 1e6

    run(stand_in), run(recorded)  # warm
    plain, with_stats = [], []
    for _ in range(reps):
        plain.append(run(stand_in))
        with_stats.append(run(recorded))
    return statistics.median(plain), statistics.median(with_stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--pairs", type=int, default=500)
    args = p.parse_args()
    plain, with_stats = pairs(args.reps, args.pairs)
    print(f"default shape, rank 0: {R} ranks x {N} tokens, H {H}, top-{K} of {E} experts")
    print(f"dispatch + combine through a stand-in exchange: {plain:.2f} us CPU")
    print(f"the same, recording stats:                      {with_stats:.2f} us CPU")
    print(f"recording costs {with_stats - plain:.2f} us CPU per dispatch + combine (median of {args.reps})")


if __name__ == "__main__":
    main()

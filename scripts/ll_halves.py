"""Each compiled call half of a decode-size dispatch + combine, timed alone: low-latency mode beside
normal mode, with the rows each moves (docs/benchmarks.md, "Low-latency mode at decode sizes"):

    python scripts/ll_halves.py [--ranks 8] [--tokens 8] [--batches 300]

Every rank runs a few dispatch + combine pairs at `ubep bench`'s shape and routing; rank 0 keeps
the arguments each half got in its last pair, then enters that half again and again with them
while its peers wait at a barrier. Every record the half reads has landed, so it never waits, and
what it writes is what it wrote. A figure is the thread's CPU per entry, the best of `--batches`
batches of 5, less the same loop without the half (it resets the half's progress words): a
loaded host preempts a batch, it does not shorten the half's own work. The halves run warm here;
in a call the rows come cold from the other ranks' caches.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

import ubep
import ubep.protocols.combine.numba_halves as combine_halves
import ubep.protocols.ubep.numba_halves as ubep_halves
from ubep.bench.workload import BenchConfig, build
from ubep.launcher import LocalLaunch
from ubep.protocols import halves

BATCH = 5  # entries per timed batch: short enough that most batches run unpreempted
PAIRS = 4  # pairs before the one whose arguments are kept


def _progress_words(args: tuple) -> list[tuple[np.ndarray, np.ndarray]]:
    """(array, its value at entry) for the small int64 arrays that were all zero when the half was
    entered: its progress (state, done) and status words, which an entry changes and the next must
    find as they were."""
    return [
        (a, a.copy())
        for a in args
        if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.size <= 64 and not a.any()
    ]


def _best_us(entry: Callable[[], object], reset: list, batches: int) -> float:
    """The thread's CPU per entry in microseconds, best over batches, each entry after a reset."""
    best = float("inf")
    for _ in range(batches):
        start = time.thread_time()
        for _ in range(BATCH):
            for array, zero in reset:
                np.copyto(array, zero)
            entry()
        best = min(best, (time.thread_time() - start) / BATCH * 1e6)
    return best


def _kept(mode: str, buf: ubep.Buffer, x, idx, w) -> tuple[dict[str, tuple], dict[str, int]]:
    """The halves of this rank's last pair with their arguments, and the rows it moved."""
    kept: dict[str, tuple] = {}
    run, direct = halves.run, {}

    def keeping(heap, call, phase, half, *args, **kwargs):
        kept[half.__name__] = (half, args, _progress_words(args))  # as they were at entry
        return run(heap, call, phase, half, *args, **kwargs)

    def keep_direct(module, name: str) -> None:  # normal mode's sends: entered without `halves.run`
        half = direct[(module, name)] = getattr(module, name)

        def entered(*args):
            kept[name] = (half, args, _progress_words(args))
            return half(*args)

        setattr(module, name, entered)

    halves.run = keeping
    keep_direct(ubep_halves, "dispatch_send")
    keep_direct(combine_halves, "combine_send")
    try:
        if mode == "ll":
            got = buf.low_latency_dispatch(x, idx, x.shape[0], buf.num_experts)
            buf.low_latency_combine(got.recv_x, idx, w, got.handle)
            rows = {"received": int(got.recv_count.sum()), "home": int((idx >= 0).sum())}
        else:
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(got.recv_x, got.handle)
            rows = {"received": got.recv_x.shape[0], "home": int(got.handle.is_token_in_rank_NR.sum())}
    finally:
        halves.run = run
        for (module, name), half in direct.items():
            setattr(module, name, half)
    return kept, rows


def time_halves(ranks: int, tokens: int, batches: int) -> dict:
    """Rank 0's CPU per entry of each half, in each mode, and the rows of its calls."""
    me = dist.get_rank()
    cfg = BenchConfig(ranks=ranks, tokens=(tokens,))
    work = build(cfg, tokens)
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    out = {}
    for mode in ("ll", "normal"):
        with ubep.Buffer(
            hidden=cfg.hidden,
            num_experts=cfg.experts,
            max_tokens_per_rank=tokens,
            max_topk=cfg.topk,
            low_latency=mode == "ll",
        ) as buf:
            for _ in range(PAIRS):
                if mode == "ll":
                    got = buf.low_latency_dispatch(x, idx, tokens, cfg.experts)
                    buf.low_latency_combine(got.recv_x, idx, w, got.handle)
                else:
                    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
                    buf.combine(got.recv_x, got.handle)
            kept, rows = _kept(mode, buf, x, idx, w)  # every rank: the pair needs them all
            us = {}
            for name, (half, args, reset) in kept.items() if me == 0 else ():
                baseline = _best_us(lambda: None, reset, batches)
                us[name] = _best_us(lambda h=half, a=args: h(*a), reset, batches) - baseline
            dist.barrier()  # the peers wait here until rank 0 is done with this Buffer's memory
            out[mode] = {"us": us, "rows": rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    got = LocalLaunch(world_size=args.ranks, timeout_s=600).run(
        time_halves, args.ranks, args.tokens, args.batches
    )
    for mode, label in (("ll", "low latency"), ("normal", "normal")):
        res = got[0][mode]
        print(f"{label}: rows received {res['rows']['received']}, rows the home sums {res['rows']['home']}")
        for name, us in res["us"].items():
            print(f"  {name:18s} {us:7.1f} us")
        print(f"  {'all halves':18s} {sum(res['us'].values()):7.1f} us")


if __name__ == "__main__":
    main()

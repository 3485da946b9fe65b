"""Low-latency mode over torch.distributed: when a rank stops taking part (it raised in its own
code and lingers), a survivor whose deadline comes late (a loaded host) names that rank, not a
survivor that gave up first and exited (issue 23, item 7: it said "rank(s) 0 died")."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import ubep

R, E, T, H = 3, 6, 4, 32
TIMEOUT_S = 2.0
LINGERER, LATE = 1, 2  # rank 1 skips the call; rank 2 reaches it late, on a busy core


def burn(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


def lingering_rank() -> str:
    me = dist.get_rank()
    gen = torch.Generator().manual_seed(me)
    x = torch.randn(T, H, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    stop = threading.Event()
    with ubep.Buffer(
        hidden=H,
        num_experts=E,
        max_tokens_per_rank=T,
        transport="dist",
        timeout_s=TIMEOUT_S,
        low_latency=True,
    ) as buf:
        buf.low_latency_dispatch(x, idx, T, E)  # one call that works
        if me == LINGERER:  # its own code raised; it stays, and calls nothing more for a while
            time.sleep(3 * TIMEOUT_S)
            return "lingered"
        if me == LATE:  # load: a thread burns this rank's core, and its call starts late
            threading.Thread(target=burn, args=(stop,), daemon=True).start()
            time.sleep(0.6 * TIMEOUT_S)
        try:
            buf.low_latency_dispatch(x, idx, T, E)
            return "no error"
        except ubep.UbepError as error:
            return f"{type(error).__name__}: {error}"
        finally:
            stop.set()


@pytest.mark.timeout(90)
def test_a_late_survivor_names_the_lingering_rank_not_the_survivor_that_left():
    said = ubep.LocalLaunch(world_size=R, timeout_s=60).run(lingering_rank)
    assert said[LINGERER] == "lingered"
    late = said[LATE]
    assert late.startswith("CommTimeoutError"), said
    assert "rank(s) 0 died" not in late and "no signal from rank(s) 1" in late, said

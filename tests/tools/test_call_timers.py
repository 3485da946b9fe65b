"""Call timers (`ubep.timers`): the blocks partition a call, the counts count, off costs nothing."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep import settings
from ubep.timers import BLOCKS, COUNTS, BlockTimes, CallTimers
from ubep.transport.virtual import VirtualWorld


def test_laps_charge_the_time_since_the_previous_mark():
    times = BlockTimes().begin()
    time.sleep(0.002)
    times.lap("validate")
    times.lap("receive")
    times.end()
    assert times.calls == 1
    assert times.wall_ns["validate"] >= 2_000_000 > times.wall_ns["receive"]
    assert times.cpu_ns["validate"] < times.wall_ns["validate"]  # asleep, not on the CPU
    got = times.per_call()
    assert set(got) == {f"{w} {b}" for w in ("wall", "cpu") for b in BLOCKS} | set(COUNTS)


def test_each_kind_is_timed_apart_and_reset_forgets():
    timers = CallTimers()
    assert timers.begin("no such kind") is None
    timers.begin("dispatch").end()
    timers.begin("ll_dispatch").end()
    assert timers.kinds["dispatch"].calls == timers.kinds["ll_dispatch"].calls == 1
    assert timers.per_call()["combine"] == {} == timers.per_call()["ll_combine"]
    timers.reset()
    assert timers.per_call() == {"dispatch": {}, "combine": {}, "ll_dispatch": {}, "ll_combine": {}}


def test_the_environment_turns_them_on():
    assert settings.resolve({}, {"UBEP_CALL_TIMERS": "1"})["call_timers"].value is True
    assert settings.resolve({}, {})["call_timers"] == settings.Setting(False, "default")


def _calls(rank, on: bool) -> tuple[dict, float]:
    """This rank's timers per call over 6 dispatch + combine pairs, and their wall time per pair (us)."""
    T, H, E, K = 8, 64, 8, 2
    g = torch.Generator().manual_seed(rank.rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    with ubep.Buffer(
        rank, hidden=H, num_experts=E, max_tokens_per_rank=T, engine="numba", call_timers=on, low_latency=True
    ) as buf:
        if not on:
            return buf.call_timers, 0.0
        start = time.perf_counter_ns()
        for _ in range(6):
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(got.recv_x, got.handle)
        for _ in range(3):
            got = buf.low_latency_dispatch(x, idx, T, E)
            buf.low_latency_combine(got.recv_x, idx, w, got.handle)
        elapsed = (time.perf_counter_ns() - start) / 6 / 1e3  # per normal pair, and half a low-latency one
        hooked = buf.low_latency_dispatch(x, idx, T, E, return_recv_hook=True)  # its receive half later:
        time.sleep(0.05)  # the caller's time until the hook is no block's
        hooked.hook()
        return buf.call_timers.per_call(), elapsed


def test_a_buffer_times_each_block_of_its_calls():
    pytest.importorskip("numba")
    assert VirtualWorld(2, timeout_s=60).run(lambda r: _calls(r, False))[0][0] is None
    for per_call, elapsed in VirtualWorld(2, timeout_s=60).run(lambda r: _calls(r, True)):
        # halves entered: normal dispatch, routes and gather; combine, the reduce; low latency, each
        # kind's send half (its reuse wait) and receive half
        for kind, halves in (("dispatch", 2), ("combine", 1), ("ll_dispatch", 2), ("ll_combine", 2)):
            got = per_call[kind]
            assert got["entries"] >= halves and got["cpu send"] > 0 and got["cpu validate"] > 0
            assert got["entries"] == halves + got["sleeps"]  # every sleep is followed by an entry
        for kind in ("dispatch", "combine"):
            walls = sum(v for k, v in per_call[kind].items() if k.startswith("wall "))
            assert walls <= elapsed  # the blocks partition each call; the loop adds only itself
        ll = sum(
            v
            for kind in ("ll_dispatch", "ll_combine")
            for k, v in per_call[kind].items()
            if k.startswith("wall ")
        )
        assert ll <= 2 * elapsed and per_call["ll_dispatch"]["wall between"] < 5_000  # not the 50 ms slept


def test_the_profile_table_shows_medians_over_ranks():
    from rich.console import Console

    from ubep.bench.profile import timer_table

    def rank(scale: float) -> dict:
        per_call = {f"{w} {b}": scale for w in ("wall", "cpu") for b in BLOCKS} | dict.fromkeys(COUNTS, scale)
        return {"timers": {"dispatch": per_call, "combine": per_call}}

    console = Console(width=200, record=True)
    console.print(timer_table([rank(1.0), rank(2.0), rank(30.0)], "t"))
    rows = [line.replace("│", " ").split() for line in console.export_text().splitlines()]
    assert ["validate", "2.0", "2.0", "2.0", "2.0"] in rows  # the median, not the mean
    assert ["total", "14.0", "14.0", "14.0", "14.0"] in rows  # 7 blocks of the median rank
    assert ["doorbell", "sleeps", "/", "call", "2.00", "2.00"] in rows


def _timers_across_nodes() -> dict:
    """The profile's call timers (`profile_rank`) of the rows ubep and hier-bsp, 2 emulated nodes of 2,
    and a Buffer's over the flat fabric (transport "dist"), both modes."""
    from ubep.bench.profile import profile_rank
    from ubep.bench.workload import BenchConfig, build

    cfg = BenchConfig(ranks=4, nodes=2, hidden=64, experts=8, topk=2, iters=2, warmup=1, timeout_s=60)
    out = {name: profile_rank(cfg, 8, 2, name)["timers"] for name in ("ubep", "hier-bsp")}
    work, me = build(cfg, 8), dist.get_rank()
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    with ubep.Buffer(
        hidden=64, num_experts=8, max_tokens_per_rank=8, transport="dist", call_timers=True, low_latency=True
    ) as buf:
        for _ in range(2):
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(got.recv_x, got.handle)
            ll = buf.low_latency_dispatch(x, idx, 8, 8)
            buf.low_latency_combine(ll.recv_x, idx, w, ll.handle)
        out["flat fabric"] = buf.call_timers.per_call()
    return out


def test_the_profile_fills_the_blocks_of_the_exchanges_across_nodes():
    """Across nodes, a call was one "between" block (issue 44): now the messages to peers (or
    hier-bsp's collectives) are "send", the fabric's and the heap's waits "wait", hier's rows on their
    way through the node "forward", the rows taken into place "receive"."""
    pytest.importorskip("numba")
    from ubep.launcher import LocalLaunch

    per_rank = LocalLaunch(world_size=4, timeout_s=120, ranks_per_node=2).run(_timers_across_nodes)
    for timers in per_rank:
        for name, kinds in timers.items():
            hier = name != "flat fabric"
            for kind in ("dispatch", "combine") + (() if hier else ("ll_dispatch", "ll_combine")):
                got = kinds[kind]
                blocks = ("send", "receive", "wait", "results") + (("forward",) if hier else ())
                assert {b for b in blocks if got[f"wall {b}"] > 0} == set(blocks), (name, kind, got)
                assert hier or got["wall forward"] == 0  # nothing forwards on the flat fabric

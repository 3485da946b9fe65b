"""Soak test: many dispatch/combine calls through one Buffer per rank, each with
random token counts, top-k, routing and dtype, each checked against the plain
torch reference. Reports failures, resident memory of every rank and /dev/shm
use at start and end, and the wall time.

    python scripts/soak.py --calls 10000 --world-size 4 --protocol ubep

One "call" is a dispatch and the combine of its result; every fourth call also
repeats the dispatch from its handle (cached dispatch). See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import ubep
from ubep import reference, routing
from ubep.transport.segments import NAME_PREFIX, SHM_DIR

KINDS = ("uniform", "zipf", "hot", "deepseek-groups")
MAX_REPORTED_FAILURES = 5
WARMUP_CALLS = 100


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    calls: int = 10_000
    world_size: int = 4
    protocol: str = "ubep"
    transport: str = "shm"
    hidden: int = 128
    capacity: int = 32  # max tokens per rank and call
    experts_per_rank: int = 4
    max_topk: int = 8
    timeout_s: float = 30.0
    seed: int = 0
    progress_every: int = 250

    def buffer(self, world_size: int, **kw) -> ubep.Buffer:
        """The Buffer every rank of the soak builds (collective)."""
        return ubep.Buffer(
            hidden=self.hidden,
            num_experts=self.experts_per_rank * world_size,
            max_tokens_per_rank=self.capacity,
            max_topk=self.max_topk,
            protocol=self.protocol,
            transport=self.transport,
            timeout_s=self.timeout_s,
            **kw,
        )


@dataclass(frozen=True, kw_only=True)
class RankSoak:
    rank: int
    calls: int
    failures: int
    first_failures: list[str]
    rss_start_mb: float  # after the Buffer is built, before the first call
    rss_warm_mb: float  # after the first WARMUP_CALLS calls (allocator and caches settled)
    rss_end_mb: float
    shm_segments_seen: int  # our group's names visible in /dev/shm while running (should be 0)


@dataclass(frozen=True, kw_only=True)
class SoakReport:
    config: SoakConfig
    ranks: list[RankSoak]
    wall_s: float
    shm_used_mb_before: float
    shm_used_mb_after: float
    ubep_names_before: int
    ubep_names_after: int
    extra: dict = field(default_factory=dict)

    @property
    def failures(self) -> int:
        return sum(r.failures for r in self.ranks)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def shm_state() -> tuple[float, int]:
    """(/dev/shm bytes used in MiB, number of ubep-* names there)."""
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
    return shutil.disk_usage(SHM_DIR).used / 2**20, len(names)


def call_inputs(cfg: SoakConfig, call: int, R: int):
    """Every rank's inputs for one call, rebuilt identically on every rank from the seed."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + call)
    E = cfg.experts_per_rank * R
    k = int(torch.randint(1, min(cfg.max_topk, E) + 1, (1,), generator=gen))
    kind = KINDS[int(torch.randint(len(KINDS), (1,), generator=gen))]
    if kind == "deepseek-groups" and (E % 8 or k > 4 * E // 8):
        kind = "uniform"
    dtype = (torch.bfloat16, torch.float32)[int(torch.randint(2, (1,), generator=gen))]
    drop = float(torch.rand(1, generator=gen)) * 0.3
    xs, idxs, ws = [], [], []
    for _ in range(R):
        n = int(torch.randint(0, cfg.capacity + 1, (1,), generator=gen))
        idx = routing.drop(routing.make(kind, n, E, k, gen, skew=0.9), drop, gen)
        xs.append((torch.randn(n, cfg.hidden, generator=gen) * 2).to(dtype))
        idxs.append(idx)
        ws.append(routing.weights(n, k, gen))
    return xs, idxs, ws


@dataclass(kw_only=True)
class Checked:
    """Calls a rank compared with the reference so far, and the comparisons that failed."""

    calls: int = 0
    wrong: list[str] = field(default_factory=list)


def check_call(
    buf: ubep.Buffer, cfg: SoakConfig, call: int, checked: Checked, masked: frozenset[int] = frozenset()
) -> None:
    """One dispatch + combine (+ a cached dispatch every 4th call), compared bit for bit with the
    reference fed the inputs as the ranks not `masked` see them. Each call that returns is
    counted and checked in `checked` at once, so a later call's error keeps an earlier result's."""
    me, R = buf.rank, buf.num_ranks
    E = cfg.experts_per_rank * R
    xs, idxs, ws = call_inputs(cfg, call, R)
    rx, ri, rw = reference.without_ranks(xs, idxs, ws, masked, E)
    ref = reference.dispatch(rx, ri, rw, E)
    mine = ref[me]

    def compare(**outcomes: bool) -> None:
        checked.calls += 1
        checked.wrong += [f"call {call}: {name}" for name, ok in outcomes.items() if not ok]

    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    compare(
        recv_x=torch.equal(got.recv_x, mine.recv_x_MH),
        recv_topk_idx=torch.equal(got.recv_topk_idx, mine.recv_topk_idx_MK),
        recv_topk_weights=torch.equal(got.recv_topk_weights, mine.recv_topk_weights_MK),
        counts=got.num_recv_tokens_per_expert_list == mine.num_recv_tokens_per_expert,
    )
    ys = [(r.recv_x_MH.float() * (1 + rank)).to(r.recv_x_MH.dtype) for rank, r in enumerate(ref)]
    want = reference.combine(ys, ref, [x.shape[0] for x in rx])[me]
    out = buf.combine(ys[me], got.handle, topk_weights=got.recv_topk_weights)
    compare(combined_x=torch.equal(out.combined_x, want))
    if call % 4 == 3:
        again = buf.dispatch(xs[me] * 2, handle=got.handle)
        compare(cached_recv_x=torch.equal(again.recv_x, mine.recv_x_MH * 2))


def soak_rank(cfg: SoakConfig) -> RankSoak:
    me, R = dist.get_rank(), dist.get_world_size()
    pids: list[int] = [0] * R
    dist.all_gather_object(pids, os.getpid())
    checked = Checked()
    with cfg.buffer(R) as buf:
        rss_start = rss_warm = rss_mb()
        with _progress(me, cfg) as tick:
            for call in range(cfg.calls):
                if call == min(WARMUP_CALLS, cfg.calls // 2):
                    rss_warm = rss_mb()
                check_call(buf, cfg, call, checked)  # a wrong result is noted; exchange errors end the soak
                tick(call + 1, len(checked.wrong))
        seen = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX) and int(n.split("-")[1]) in pids]
        rss_end = rss_mb()
    return RankSoak(
        rank=me,
        calls=cfg.calls,
        failures=len(checked.wrong),
        first_failures=checked.wrong[:MAX_REPORTED_FAILURES],
        rss_start_mb=rss_start,
        rss_warm_mb=rss_warm,
        rss_end_mb=rss_end,
        shm_segments_seen=len(seen),
    )


class _progress:
    """Rank 0 shows progress: a rich bar on a terminal, a line every `progress_every` calls otherwise."""

    def __init__(self, rank: int, cfg: SoakConfig):
        self.cfg, self.on = cfg, rank == 0
        self.console = Console()
        self.bar = Progress(console=self.console) if self.on and self.console.is_terminal else None
        self.start = time.monotonic()

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(f"soak ({self.cfg.protocol})", total=self.cfg.calls)
        return self.tick

    def tick(self, done: int, failures: int) -> None:
        if not self.on:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
        elif done % self.cfg.progress_every == 0 or done == self.cfg.calls:
            rate = done / max(time.monotonic() - self.start, 1e-9)
            self.console.print(
                f"soak: {done}/{self.cfg.calls} calls, {failures} failures, "
                f"{rate:.1f} calls/s, rank 0 rss {rss_mb():.1f} MiB",
                highlight=False,
            )

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_soak(cfg: SoakConfig, launch_timeout_s: float = 24 * 3600) -> SoakReport:
    shm_before, names_before = shm_state()
    start = time.monotonic()
    launch = ubep.LocalLaunch(world_size=cfg.world_size, timeout_s=launch_timeout_s)
    ranks = launch.run(soak_rank, cfg)
    wall = time.monotonic() - start
    shm_after, names_after = shm_state()
    return SoakReport(
        config=cfg,
        ranks=ranks,
        wall_s=wall,
        shm_used_mb_before=shm_before,
        shm_used_mb_after=shm_after,
        ubep_names_before=names_before,
        ubep_names_after=names_after,
    )


def print_report(report: SoakReport, console: Console) -> None:
    cfg = report.config
    title = f"soak: {cfg.calls} calls, {cfg.world_size} ranks, {cfg.protocol} over {cfg.transport}"
    table = Table(title=title)
    columns = ("rank", "calls", "failures", "rss start MiB", f"rss @{WARMUP_CALLS} MiB", "rss end MiB")
    for column in (*columns, "ubep names seen"):
        table.add_column(column, justify="right")
    for r in report.ranks:
        table.add_row(
            str(r.rank),
            str(r.calls),
            str(r.failures),
            f"{r.rss_start_mb:.1f}",
            f"{r.rss_warm_mb:.1f}",
            f"{r.rss_end_mb:.1f}",
            str(r.shm_segments_seen),
        )
    console.print(table)
    console.print(
        f"wall {report.wall_s:.1f} s; /dev/shm used {report.shm_used_mb_before:.1f} -> "
        f"{report.shm_used_mb_after:.1f} MiB; ubep-* names {report.ubep_names_before} -> "
        f"{report.ubep_names_after}; failures {report.failures}",
        highlight=False,
    )
    for r in report.ranks:
        for line in r.first_failures:
            console.print(f"rank {r.rank}: {line}", highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=SoakConfig.calls)
    parser.add_argument("--world-size", type=int, default=SoakConfig.world_size)
    parser.add_argument("--protocol", default=SoakConfig.protocol, choices=("ubep", "bsp"))
    parser.add_argument("--transport", default=SoakConfig.transport, choices=("shm", "dist"))
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args()
    cfg = SoakConfig(
        calls=args.calls,
        world_size=args.world_size,
        protocol=args.protocol,
        transport=args.transport,
        seed=args.seed,
    )
    report = run_soak(cfg)
    print_report(report, Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    raise SystemExit(1 if report.failures else 0)


if __name__ == "__main__":
    main()

"""CPU per rank and dispatch + combine pair across hosts: ubep over the zmq and gloo fabrics against
hier-bsp's collectives (issue 44, item 1), 8 ranks as 2 hosts of 4, DeepSeek-V3 decode shape.

    python scripts/fabric_cpu.py [--tokens 8,128] [--rounds 40] [--emulated]

Hosts: network namespace hosts (scripts/netns_hosts.sh, 25 Gbit links as `ubep bench --hosts`) where
root allows, else emulated nodes on loopback (`LocalLaunch(ranks_per_node=4)`). Every rank builds
the three Buffers (transport "hier": rails across hosts, shared memory within one) and checks one pair
of each against the reference; then, per round, one pair of each system in a rotating order, each
after a barrier. A pair's CPU is the rank's process CPU time across it (every thread: a fabric's I/O
thread too), its time the rank's wall clock. Printed per system and tokens: the median over ranks
of each rank's median CPU per pair (with the ranks' range), the same of the time, and the time over
hier-bsp's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import ubep
from ubep.bench.hosts import LINK_BURST, LINK_DELAY, LINK_RATE, SCRIPT, namespaces_available
from ubep.bench.workload import BenchConfig, build, expected_combine
from ubep.registry import BSP, GLOO, HIER, UBEP, ZMQ

HOSTS, PER_HOST = 2, 4
SYSTEMS = {  # row -> the Buffer's protocol and fabric (transport "hier" for all)
    "ubep-zmq": (UBEP.name, ZMQ.name),
    "ubep-gloo": (UBEP.name, GLOO.name),
    "hier-bsp": (BSP.name, None),
}
BASELINE = "hier-bsp"
WARMUP = 3  # rounds before the measured ones


def one_pair(buf: ubep.Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One dispatch, the experts returning their rows unchanged, one combine: the combined rows."""
    got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    return buf.combine(got.recv_x, got.handle).combined_x


def measure(tokens: list[int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """On every rank: {f"{system}@{tokens}": {"cpu_us": [...], "wall_us": [...]}} over the rounds."""
    me = dist.get_rank()
    cfg = BenchConfig(ranks=dist.get_world_size(), tokens=tuple(tokens))
    out: dict[str, dict[str, list[float]]] = {}
    for n in tokens:
        work = build(cfg, n)
        x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
        bufs = {
            row: ubep.Buffer(
                hidden=cfg.hidden,
                num_experts=cfg.experts,
                max_tokens_per_rank=n,
                transport=HIER.name,
                protocol=protocol,
                **({"fabric": fabric} if fabric else {}),
            )
            for row, (protocol, fabric) in SYSTEMS.items()
        }
        try:
            for row, buf in bufs.items():
                if not torch.equal(one_pair(buf, x, idx, w), expected_combine(work, me)):
                    raise AssertionError(f"rank {me}: {row} at {n} tokens does not match the reference")
            names = list(bufs)
            for r in range(WARMUP + rounds):
                for row in names[r % len(names) :] + names[: r % len(names)]:
                    dist.barrier()
                    cpu, wall = time.process_time(), time.monotonic()
                    one_pair(bufs[row], x, idx, w)
                    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
                    if r >= WARMUP:
                        got = out.setdefault(f"{row}@{n}", {"cpu_us": [], "wall_us": []})
                        got["cpu_us"].append(1e6 * cpu)
                        got["wall_us"].append(1e6 * wall)
        finally:
            for buf in bufs.values():
                buf.close()
    return out


def summary(per_rank: list[dict[str, dict[str, list[float]]]], tokens: list[int]) -> list[str]:
    """The table: per system and tokens, medians over ranks of each rank's median."""
    lines = ["system     tokens  CPU us/pair (ranks' range)  time us/pair  time / hier-bsp"]
    for n in tokens:
        cpu = {row: [statistics.median(r[f"{row}@{n}"]["cpu_us"]) for r in per_rank] for row in SYSTEMS}
        wall = {
            row: statistics.median(statistics.median(r[f"{row}@{n}"]["wall_us"]) for r in per_rank)
            for row in SYSTEMS
        }
        for row in SYSTEMS:
            spread = f"{statistics.median(cpu[row]):8.0f} ({min(cpu[row]):.0f}-{max(cpu[row]):.0f})"
            ratio = wall[row] / wall[BASELINE]
            lines.append(f"{row:10} {n:6}  {spread:26}  {wall[row]:12.0f}  {ratio:15.2f}")
    return lines


def rank_main(tokens: list[int], rounds: int, result: str) -> None:
    """One rank under torchrun (on a namespace host): measure, rank 0 writes every rank's samples."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    try:
        mine = measure(tokens, rounds)
        everyone: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            Path(result).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def on_namespace_hosts(tokens: list[int], rounds: int) -> list[dict]:
    """Every rank's samples from 2 namespace hosts of 4 ranks (torchrun on each)."""
    with tempfile.TemporaryDirectory(prefix="fabric-cpu-") as scratch:
        result = os.path.join(scratch, "samples.json")
        command = [
            str(SCRIPT), "-n", str(HOSTS), "-r", LINK_RATE, "-d", LINK_DELAY, "-b", LINK_BURST, "--",
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(PER_HOST),
            __file__, "--rank", ",".join(map(str, tokens)), str(rounds), result,
        ]  # fmt: skip
        subprocess.run(command, check=True, timeout=1800)
        return json.loads(Path(result).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,128", help="tokens per rank, a comma list")
    parser.add_argument("--rounds", type=int, default=40, help="measured pairs of each system")
    parser.add_argument("--emulated", action="store_true", help="emulated nodes even where root allows")
    parser.add_argument("--rank", nargs=3, help=argparse.SUPPRESS)  # one rank under torchrun
    args = parser.parse_args()
    if args.rank:
        rank_main([int(t) for t in args.rank[0].split(",")], int(args.rank[1]), args.rank[2])
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    hosts = namespaces_available()
    if hosts.ok and not args.emulated:
        where, per_rank = f"{HOSTS} namespace hosts of {PER_HOST}", on_namespace_hosts(tokens, args.rounds)
    else:
        launch = ubep.LocalLaunch(world_size=HOSTS * PER_HOST, ranks_per_node=PER_HOST, timeout_s=1800)
        where = f"{HOSTS} emulated nodes of {PER_HOST} ({'asked' if hosts.ok else hosts.why})"
        per_rank = launch.run(measure, tokens, args.rounds)
    load = os.getloadavg()[0]
    print(f"{where}; {args.rounds} pairs per system after {WARMUP} warm-up; load {load:.1f} at the end")
    print("\n".join(summary(per_rank, tokens)))


if __name__ == "__main__":
    main()

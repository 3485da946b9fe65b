"""What a Buffer costs in memory, measured: `python -m ubep.bench.footprint`.

For each (mode, ranks, tokens), `LocalLaunch` starts the ranks; each builds one Buffer at the
given shape, then makes two dispatch + combine pairs (the two halves of the double buffer) with
uniform top-k routing, and reports:

    mapped      the shared segments the Buffer maps on the host (`Buffer.size_hint(...).host_bytes`):
                what the construction's room check requires free
    /dev/shm    what those segments hold after the calls (the tmpfs's used bytes, less what it held
                before): shared memory is only taken where a page was touched
    RSS         per rank, the mean over ranks of the Buffer's growth of VmRSS from just before
                construction to after the calls, and of its anonymous part (the ranks' own tensors,
                the compiled halves' state) and shared part (segment pages this rank touched)

Defaults: DeepSeek-V3's shape (hidden 7168, 256 experts, top-8, bf16), normal mode at 128 and 4096
tokens per rank (a decode batch; the DeepEP layer's normal-mode size hint), low-latency mode at 128,
on 2 and 8 ranks. The ranks check that no segment is left in /dev/shm after they close.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import ubep
from ubep import routing
from ubep.launcher import LocalLaunch
from ubep.sim.table import render
from ubep.sizing import size_hint
from ubep.transport.segments import NAME_PREFIX, SHM_DIR

MiB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """One measurement: a Buffer of these sizes on `ranks` local ranks."""

    mode: str  # "normal" or "ll"
    ranks: int
    tokens: int
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    seed: int = 0

    @property
    def mapped_bytes(self) -> int:
        return size_hint(hidden=self.hidden, num_experts=self.experts, max_tokens_per_rank=self.tokens,
                         num_ranks=self.ranks, max_topk=self.topk,
                         low_latency=self.mode == "ll").host_bytes  # fmt: skip


def _rss() -> dict[str, int]:
    """This process's VmRSS and its anonymous and shared parts, in bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def shm_used() -> int:
    """Bytes the host's /dev/shm holds now (its tmpfs's used blocks)."""
    s = os.statvfs(SHM_DIR)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def _calls(buf: ubep.Buffer, shape: Shape, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(2):  # both halves of the double buffer
        if shape.mode == "ll":
            got = buf.low_latency_dispatch(x, idx, shape.tokens, shape.experts)
            buf.low_latency_combine(got.recv_x, idx, w, got.handle)
        else:
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(got.recv_x, got.handle)


def measure_rank(shape: Shape) -> dict:
    """This rank's RSS growth and, on rank 0, the host's /dev/shm growth (see the module doc)."""
    me = dist.get_rank()
    gen = torch.Generator().manual_seed(shape.seed * 1000 + me)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen, dtype=torch.float32, device="cpu").to(
        torch.bfloat16
    )
    idx = routing.uniform(shape.tokens, shape.experts, shape.topk, gen)
    w = routing.weights(shape.tokens, shape.topk, gen)
    dist.barrier()
    shm_before, rss_before = shm_used(), _rss()
    with ubep.Buffer(hidden=shape.hidden, num_experts=shape.experts, max_tokens_per_rank=shape.tokens,
                     max_topk=shape.topk, low_latency=shape.mode == "ll") as buf:  # fmt: skip
        _calls(buf, shape, x, idx, w)
        dist.barrier()  # every rank's calls are done: the segments hold all they will
        shm_after, rss_after = shm_used(), _rss()
        dist.barrier()
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
    return {
        "shm_bytes": shm_after - shm_before,
        "rss": {k: rss_after[k] - rss_before[k] for k in rss_before},
        "left_in_dev_shm": left,
    }


@dataclass(frozen=True, slots=True)
class Measured:
    shape: Shape
    mapped_bytes: int
    shm_bytes: int  # rank 0's view of the host, after the calls
    rss_bytes: float  # mean over ranks
    rss_anon_bytes: float
    rss_shmem_bytes: float


def measure(shape: Shape, timeout_s: float = 600.0) -> Measured:
    per_rank = LocalLaunch(world_size=shape.ranks, timeout_s=timeout_s).run(measure_rank, shape)
    if any(r["left_in_dev_shm"] for r in per_rank):
        raise RuntimeError(f"segments left in {SHM_DIR}: {per_rank[0]['left_in_dev_shm']}")

    def mean(key: str) -> float:
        return sum(r["rss"][key] for r in per_rank) / shape.ranks

    return Measured(shape, shape.mapped_bytes, per_rank[0]["shm_bytes"], mean("VmRSS"), mean("RssAnon"),
                    mean("RssShmem"))  # fmt: skip


def table(rows: list[Measured]) -> str:
    columns = ["mode", "ranks", "tokens/rank", "mapped MiB", "/dev/shm MiB", "RSS MiB/rank", "anon", "shared"]
    cells = [
        [m.shape.mode, str(m.shape.ranks), str(m.shape.tokens), f"{m.mapped_bytes / MiB:.0f}",
         f"{m.shm_bytes / MiB:.0f}", f"{m.rss_bytes / MiB:.0f}", f"{m.rss_anon_bytes / MiB:.0f}",
         f"{m.rss_shmem_bytes / MiB:.0f}"]
        for m in rows
    ]  # fmt: skip
    return render("Buffer footprint (bf16, uniform top-k routing, after 2 dispatch + combine pairs)",
                  columns, cells, left=("mode",))  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ubep.bench.footprint", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=_ints, default=[2, 8])
    p.add_argument("--normal-tokens", type=_ints, default=[128, 4096], help="normal mode's T (empty: none)")
    p.add_argument("--ll-tokens", type=_ints, default=[128], help="low-latency mode's T (empty: none)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    shapes = [
        Shape(mode=mode, ranks=r, tokens=t, hidden=args.hidden, experts=args.experts, topk=args.topk)
        for mode, tokens in (("normal", args.normal_tokens), ("ll", args.ll_tokens))
        for r in args.ranks
        for t in tokens
    ]
    rows = []
    for shape in shapes:
        rows.append(measure(shape))
        print(
            f"footprint: {shape.mode}, {shape.ranks} ranks, {shape.tokens} tokens/rank measured", flush=True
        )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(m) for m in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the benchmark sends: the configuration and every rank's inputs.

Every rank (and the MPI workers) rebuilds every rank's inputs from the seed, so
each can check its own results against the reference before timing anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from ubep import reference, routing
from ubep.registry import UBEP
from ubep.schedule import DISTANCE

UBEP_ROW = UBEP.name  # the ubep protocol's row: shared memory (across nodes, the transport auto picks)
SYSTEMS = (UBEP_ROW, "bsp-shm", "bsp-gloo", "mpi", "memcpy-floor")  # the default on one host
# Rows across nodes (the default there): ubep on the default fabric, ubep-gloo and ubep-nixl on those engines.
ACROSS_SYSTEMS = (UBEP_ROW, "ubep-gloo", "ubep-nixl", "hier-bsp", "bsp-gloo")
# Low-latency mode beside normal mode, in the same rounds of a normal-mode run: its "x ubep" is the
# ratio of the two modes on the same workload and host state (one host; --mode ll times it as "ubep").
LL_ROW = "ubep-ll"
# Rows across racks of hosts (--racks): the three-tier schedule, the two-tier one (the ubep row: per
# host only), flat (every peer directly, over the fabric) and hier-bsp.
RACK_SYSTEMS = ("ubep-tiers", UBEP_ROW, "ubep-dist", "hier-bsp")
ALL_SYSTEMS = (*SYSTEMS, *ACROSS_SYSTEMS[1:4], *RACK_SYSTEMS[::2], LL_ROW)
PLACED_SYSTEMS = ("ubep+eplb", "ubep+eplb-global", "ubep+placed")  # experts placed: bench.placed
ROWS = (*ALL_SYSTEMS, "ubep-stats", *PLACED_SYSTEMS)  # every row a run can have ("ubep-stats": --stats)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run; the defaults are DeepSeek-V3 decode on 8 local ranks."""

    ranks: int = 8
    tokens: tuple[int, ...] = (128,)
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    iters: int = 20
    warmup: int = 3
    routing: str = "uniform"
    skew: float = 1.0
    mode: str = "normal"
    dtype: str = "bf16"
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    timeout_s: float = 120.0
    workers: int = 1  # put workers per rank for the ubep row (see ubep.schedule)
    schedule: str = DISTANCE  # the scheduler's policy when workers > 1
    nodes: int = 1  # emulated nodes: ranks are split evenly; traffic between them uses torch.distributed
    namespaces: bool = False  # the nodes are network namespace hosts (bench.hosts), not emulated
    link_rate: str = "25gbit"  # links between namespace hosts (tc's units): a 25 GbE NIC, common
    racks: int = 1  # the hosts stand in this many racks (consecutive hosts), joined by slower uplinks
    rack_link_rate: str = ""  # each rack's uplink (tc's units), with racks > 1
    stats_path: str = ""  # set: add the row "ubep-stats" (ubep recording stats), its merged snapshot here
    slow_rank: int = -1  # >= 0: this rank sleeps delay_us before each call of every Buffer row
    delay_us: float = 0.0
    placements: tuple[str, ...] = ()  # expert placements to run beside the plain ubep row (bench.placed)
    redundant: int | None = None  # redundant expert slots of those rows (None: E / 8, see bench.placed)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        """The config `json.dumps(cfg.as_dict())` wrote (lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()})


@dataclass(frozen=True, slots=True)
class Workload:
    """Every rank's inputs for one token count, and what each rank must receive."""

    xs: list[torch.Tensor]  # [N, H] per rank
    topk_idx: list[torch.Tensor]  # int64 [N, K] per rank
    topk_weights: list[torch.Tensor]  # float32 [N, K] per rank
    expected: list[reference.RefDispatch]
    num_experts: int

    def recv_rows(self, mode: str) -> list[int]:
        """Rows each rank receives: one per (token, rank) in normal mode, per (token, expert) in ll."""
        if mode == "ll":
            return [self.ll_rows_for(r) for r in range(len(self.xs))]
        return [e.recv_x_MH.shape[0] for e in self.expected]

    def ll_rows_for(self, rank: int) -> int:
        """(token, expert) pairs whose expert lives on `rank` (contiguous placement)."""
        per_rank = self.num_experts // len(self.xs)
        return sum(
            int(((idx >= rank * per_rank) & (idx < (rank + 1) * per_rank)).sum()) for idx in self.topk_idx
        )

    def sent_rows(self, rank: int, mode: str) -> int:
        """Rows `rank` gets back in combine: per (token, rank) in normal mode, per valid slot in ll."""
        if mode == "ll":
            return int((self.topk_idx[rank] >= 0).sum())
        return int(sum((e.src_rank_M == rank).sum() for e in self.expected))

    def bytes_per_rank(self, mode: str = "normal") -> float:
        """Mean bytes of token data each rank must receive in a dispatch (= send back in combine)."""
        row_bytes = self.xs[0].shape[1] * self.xs[0].element_size()
        rows = self.recv_rows(mode)
        return sum(rows) / len(rows) * row_bytes


def build(cfg: BenchConfig, tokens: int) -> Workload:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + tokens)
    xs, idxs, ws = [], [], []
    for _ in range(cfg.ranks):
        idxs.append(routing.make(cfg.routing, tokens, cfg.experts, cfg.topk, gen, skew=cfg.skew))
        ws.append(routing.weights(tokens, cfg.topk, gen))
        x_NH = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float32, device=gen.device)
        xs.append(x_NH.to(DTYPES[cfg.dtype]))
    return Workload(xs, idxs, ws, reference.dispatch(xs, idxs, ws, cfg.experts), cfg.experts)


def expected_combine(work: Workload, rank: int) -> torch.Tensor:
    """What rank `rank` must get back when every expert returns its input rows unchanged."""
    ys = [e.recv_x_MH for e in work.expected]
    return reference.combine(ys, work.expected, [x.shape[0] for x in work.xs])[rank]

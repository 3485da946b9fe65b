"""`ubep decode --hosts H --kill-host h --at-step s`: a decode loop you can watch lose a host.

    conductor (this process)                     H emulated hosts x P ranks (LocalLaunch, transport dist)
      draws the model's weights (seeded)   --->    each rank: its sequences, greedy, one token a step;
                                                   every MoE layer dispatch -> experts -> combine
                                                   on_peer_failure="mask", every expert on two hosts
      prints the timeline, the recovery    <---    per step: its time, masked ranks, entries left
      time and the token check                     out and kept, the tokens

A small DeepSeek-V3-shaped MoE stack (an embedding, `layers` MoE layers of `experts` routed experts,
softmax top-k, a residual, an output head; random weights). Host h's ranks SIGKILL (or SIGSTOP:
`--stop`) themselves as step s's first dispatch starts. A survivor's sequences are checked against
the same model run whole on that rank, without faults and without expert parallelism (greedy
tokens equal from the first step to the last). Kept entries are those that selected an expert
with a copy on a masked rank and were not left out: a live copy served them (copies taking over a
dead copy's tokens turn left-out entries into kept ones).

Legend: see `ubep.layout`; B sequences a rank, V vocabulary, F an expert's inner size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ubep.bench.elastic import copied_placement, lost_bounds
from ubep.faults import FaultPlan
from ubep.launcher import LocalLaunch


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    """The model, the hosts, and the fault."""

    hosts: int = 3
    ranks_per_host: int = 2
    kill_host: int = 2
    at_step: int = 10  # 0-based decode step in whose first dispatch the host dies
    stop: bool = False  # SIGSTOP instead of SIGKILL: masked when the deadline passes
    steps: int = 20
    runs: int = 1
    batch: int = 4  # sequences per rank
    hidden: int = 256
    layers: int = 2
    experts: int = 24  # logical; each on two hosts
    topk: int = 4
    inner: int = 128
    vocab: int = 512
    timeout_s: float = 3.0
    seed: int = 0

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def slots(self) -> int:
        """Slots per rank: the most experts a host holds (`copied_placement`), over its ranks, rounded up."""
        H, E = self.hosts, self.experts
        held = max(sum(h in (e % H, (e + 1) % H) for e in range(E)) for h in range(H))
        return -(-held // self.ranks_per_host)

    def validate(self) -> None:
        if self.hosts < 2:
            raise ValueError(f"hosts must be >= 2 (an expert on two hosts), got {self.hosts}")
        if not 0 <= self.kill_host < self.hosts:
            raise ValueError(f"kill_host must lie in [0, {self.hosts}), got {self.kill_host}")
        if not 0 < self.at_step < self.steps:
            raise ValueError(f"at_step must lie in [1, steps={self.steps}), got {self.at_step}")
        if self.ranks_per_host * self.slots > self.experts:
            raise ValueError(
                f"experts ({self.experts}) must fill a host's {self.ranks_per_host * self.slots} slots "
                "without two copies of one expert on a host"
            )
        for name in ("ranks_per_host", "runs", "batch", "hidden", "layers", "experts", "topk", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Model:
    """The weights, the same on every rank (drawn from the seed)."""

    def __init__(self, cfg: ElasticConfig):
        g = torch.Generator().manual_seed(cfg.seed)
        H, E, F, V = cfg.hidden, cfg.experts, cfg.inner, cfg.vocab

        def draw(*shape: int, scale: float) -> torch.Tensor:
            return scale * torch.randn(*shape, generator=g, dtype=torch.float32, device="cpu")

        self.embed_VH = draw(V, H, scale=1.0)
        self.router_HE = draw(H, E, scale=H**-0.5)
        self.w1_LEHF = draw(cfg.layers, E, H, F, scale=H**-0.5)
        self.w2_LEFH = draw(cfg.layers, E, F, H, scale=F**-0.5)
        self.head_HV = draw(H, V, scale=H**-0.5)
        self.topk = cfg.topk

    def route(self, h_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical topk_idx [N, K], weights [N, K] float32): softmax over the router, top-k."""
        w_NK, idx_NK = torch.softmax(h_NH @ self.router_HE, dim=-1).topk(self.topk, dim=-1)
        return idx_NK, w_NK

    def expert(self, layer: int, e: int, x_MH: torch.Tensor) -> torch.Tensor:
        return torch.relu(x_MH @ self.w1_LEHF[layer, e]) @ self.w2_LEFH[layer, e]

    def next_token(self, h_NH: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.layer_norm(h_NH, h_NH.shape[-1:]) @ self.head_HV).argmax(dim=-1)

    def whole(self, tokens_N: torch.Tensor, steps: int) -> list[list[int]]:
        """Greedy tokens of every step, the model run whole here (no EP, no faults): the reference."""
        out = []
        for _ in range(steps):
            h_NH = self.embed_VH[tokens_N]
            for layer in range(self.w1_LEHF.shape[0]):
                idx_NK, w_NK = self.route(h_NH)
                moe_NH = torch.zeros_like(h_NH)
                for n in range(h_NH.shape[0]):
                    for k in range(self.topk):
                        moe_NH[n] += w_NK[n, k] * self.expert(layer, int(idx_NK[n, k]), h_NH[n : n + 1])[0]
                h_NH = h_NH + moe_NH
            tokens_N = self.next_token(h_NH)
            out.append(tokens_N.tolist())
        return out


def _experts(model: Model, layer: int, slots_L: torch.Tensor, got) -> torch.Tensor:
    """Each received row through the local experts it selected, weighted (normal-mode combine sums)."""
    y_MH = torch.zeros_like(got.recv_x)
    for j, e in enumerate(slots_L.tolist()):
        rows_M = (got.recv_topk_idx == j).any(dim=1)
        if rows_M.any():
            w_M = (got.recv_topk_weights * (got.recv_topk_idx == j)).sum(dim=1)[rows_M]
            y_MH[rows_M] += w_M[:, None] * model.expert(layer, e, got.recv_x[rows_M])
    return y_MH


def rank_decode(cfg: ElasticConfig, run: int) -> dict:
    """One rank's decode: per step its start and end (monotonic s), the ranks masked after it,
    entries left out and kept, and its greedy tokens; with the whole model's tokens."""
    import ubep

    torch.set_num_threads(1)
    me = dist.get_rank()
    model = Model(cfg)
    placement = copied_placement(cfg.experts, cfg.hosts, cfg.ranks_per_host, cfg.slots)
    victims = range(cfg.kill_host * cfg.ranks_per_host, (cfg.kill_host + 1) * cfg.ranks_per_host)
    call = 2 * cfg.layers * cfg.at_step + 1  # the step's first dispatch (calls count from 1)
    plan = None
    if me in victims:
        plan = FaultPlan(rank=me, point="dispatch.start", action="stop" if cfg.stop else "kill", call=call)
    g = torch.Generator().manual_seed(cfg.seed * 1000 + run * 100 + me)
    tokens_N = torch.randint(0, cfg.vocab, (cfg.batch,), generator=g, dtype=torch.int64, device="cpu")
    steps = []
    with ubep.Buffer(
        hidden=cfg.hidden,
        num_experts=cfg.ranks * cfg.slots,
        max_tokens_per_rank=cfg.batch,
        max_topk=cfg.topk,
        timeout_s=cfg.timeout_s,
        on_peer_failure="mask",
        transport="dist",
        faults=plan,
    ) as buf:
        buf.set_placement(placement)
        slots_L = placement.local_logical(me)
        now_N = tokens_N
        for _ in range(cfg.steps):
            start, left, kept = time.monotonic(), 0, 0
            h_NH = model.embed_VH[now_N]
            for layer in range(cfg.layers):
                idx_NK, w_NK = model.route(h_NH)
                got = buf.dispatch(h_NH, topk_idx=idx_NK, topk_weights=w_NK)
                combined = buf.combine(_experts(model, layer, slots_L, got), got.handle).combined_x
                left_NK = buf.left_out(idx_NK)
                _, may_NK = lost_bounds(placement, buf.masked_ranks, idx_NK)
                left, kept = left + int(left_NK.sum()), kept + int((may_NK & ~left_NK).sum())
                h_NH = h_NH + combined
            now_N = model.next_token(h_NH)
            steps.append((start, time.monotonic(), list(buf.masked_ranks), left, kept, now_N.tolist()))
    return {"steps": steps, "whole": model.whole(tokens_N, cfg.steps)}


@dataclass(frozen=True, slots=True)
class Step:
    """One decode step over the survivors: the slowest one's time, and what happened in it."""

    step: int
    seconds: float
    masked: list[int]
    left_out: int
    kept: int  # entries whose expert lost a copy, served by a live one
    same: bool  # every survivor's tokens so far equal the whole model's


def timeline(cfg: ElasticConfig, survivors: list[dict]) -> tuple[list[Step], float]:
    """The steps of one run, and the seconds from the start of the fault's step (the host dies as
    its first dispatch starts) to its end on the slowest survivor."""
    rows, same = [], True
    for i in range(cfg.steps):
        mine = [r["steps"][i] for r in survivors]
        same = same and all(s[5] == r["whole"][i] for s, r in zip(mine, survivors, strict=True))
        seconds = max(s[1] - s[0] for s in mine)
        masked = sorted({m for s in mine for m in s[2]})
        rows.append(Step(i, seconds, masked, sum(s[3] for s in mine), sum(s[4] for s in mine), same))
    recovery = max(r["steps"][cfg.at_step][1] for r in survivors) - min(
        r["steps"][cfg.at_step][0] for r in survivors
    )
    return rows, recovery


def run(cfg: ElasticConfig) -> tuple[list[list[Step]], list[float]]:
    """`cfg.runs` decode runs on emulated hosts; each run's timeline and recovery time."""
    cfg.validate()
    victims = set(range(cfg.kill_host * cfg.ranks_per_host, (cfg.kill_host + 1) * cfg.ranks_per_host))
    runs, recoveries = [], []
    for i in range(cfg.runs):
        launch = LocalLaunch(world_size=cfg.ranks, ranks_per_node=cfg.ranks_per_host, timeout_s=300)
        outcomes = launch.outcomes(rank_decode, cfg, i)
        failed = [o for o in outcomes if o.rank not in victims and not o.ok]
        if failed:
            raise RuntimeError(f"rank {failed[0].rank} failed ({failed[0].cause}):\n{failed[0].error}")
        rows, recovery = timeline(cfg, [o.result for o in outcomes if o.rank not in victims])
        runs.append(rows)
        recoveries.append(recovery)
    return runs, recoveries


def print_timeline(cfg: ElasticConfig, runs: list[list[Step]], recoveries: list[float]) -> None:
    how = "stopped (SIGSTOP)" if cfg.stop else "killed (SIGKILL)"
    print(
        f"elastic decode: {cfg.hosts} emulated hosts x {cfg.ranks_per_host} ranks (transport dist), "
        f"{cfg.experts} experts top-{cfg.topk} each on two hosts, {cfg.batch} sequences a rank, "
        f"on_peer_failure=mask, timeout {cfg.timeout_s:g} s; host {cfg.kill_host} {how} at step {cfg.at_step}"
    )
    print(f"{'step':>4} {'ms':>8}  {'masked':<10} {'left out':>8} {'kept':>6}  same tokens as no faults")
    for row in runs[-1]:
        event = "  <- host dies" if row.step == cfg.at_step else ""
        masked = ",".join(map(str, row.masked)) or "-"
        print(
            f"{row.step:4d} {1e3 * row.seconds:8.1f}  {masked:<10} {row.left_out:8d} "
            f"{row.kept:6d}  {'yes' if row.same else 'NO'}{event}"
        )
    clean = [r.seconds for rows in runs for r in rows if r.step != cfg.at_step and r.step > 0]
    print(
        f"death to the end of its step (slowest survivor), {len(recoveries)} run(s): median "
        f"{statistics.median(recoveries):.3f} s, worst {max(recoveries):.3f} s; other steps median "
        f"{statistics.median(clean):.3f} s"
    )


def plot(path: str, cfg: ElasticConfig, rows: list[Step]) -> None:
    """Step time against step, the death and the mask marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([r.step for r in rows], [1e3 * r.seconds for r in rows], marker="o", markersize=3)
    ax.axvline(cfg.at_step, color="red", linestyle="--", label=f"host {cfg.kill_host} dies, masked")
    lost = [r.step for r in rows if not r.same]
    if lost:
        ax.axvspan(lost[0] - 0.5, rows[-1].step + 0.5, color="orange", alpha=0.15, label="tokens differ")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("step time, ms (slowest survivor)")
    ax.set_title(f"{cfg.hosts} emulated hosts x {cfg.ranks_per_host} ranks, on_peer_failure=mask", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

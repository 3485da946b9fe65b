"""Elastic EP episodes (issue 43, item 7): a rank or a whole emulated host killed (SIGKILL) or
stopped (SIGSTOP) at a drawn moment of a dispatch, a combine or a low-latency call, episode after
episode, on 6 shared-memory ranks and on `dist` over the fabric with 3 emulated hosts of 2 ranks,
at DeepSeek-V3's decode shape (hidden 7168, 256 experts, top-8, a few tokens a rank), every expert
copied on two hosts (`copied_placement`, set before the fault), on_peer_failure="mask".

Every result a survivor gets is checked against the reference fed the same membership, the mask
applied as the library says: the entries `Buffer.left_out` names contribute nothing, and those
must include every entry whose copies are all masked and only entries with a masked copy
(`lost_bounds`; exact whether or not live copies take over a dead copy's tokens). Each episode
counts hangs (its launch's deadline), wrong results, crashes, calls raised, entries dropped, and
the time from the start of the pair the fault fell in to the first pair each survivor completed
after it. UBEP_EPISODES (default 1) sets the episodes per transport; docs/reliability.md records
a long run.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep.bench.elastic import copied_placement, lost_bounds
from ubep.errors import UbepError
from ubep.faults import FaultPlan

WORLD, PER_HOST, SLOTS = 6, 2, 86  # 516 slots for 256 experts: every one on two hosts, a few on three
HIDDEN, LOGICAL, TOPK, TOKENS = 7168, 256, 8, 2
PAIRS = 6  # call pairs an episode: even ones normal mode, odd ones low latency
TIMEOUT_S = 4.0  # every wait's deadline: a stopped rank is masked when it passes
EPISODE_S = 150.0  # the whole launch's deadline: past it, the episode hung
EPISODES = int(os.environ.get("UBEP_EPISODES", "1"))
BEFORE = "before"  # the victim faults just before the pair's first call (its own, not a library point)
POINTS = {  # where a fault can fall, per transport and mode (dist's fabric has no mid-call points)
    ("shm", "normal"): ("dispatch.start", "dispatch.sent", "dispatch.end", "combine.start", "combine.mid"),
    ("shm", "ll"): (BEFORE, "ll_combine.put"),
    ("dist", "normal"): ("dispatch.start", "dispatch.end", "combine.start"),
    ("dist", "ll"): (BEFORE,),
}


@dataclass(frozen=True, slots=True)
class Fault:
    """What an episode does: `victims` (one rank or a host's two) `action` at `point` of pair `pair`."""

    victims: tuple[int, ...]
    action: str
    pair: int
    point: str

    def plan(self, rank: int) -> FaultPlan | None:
        """This rank's library fault plan (calls count from 1, dispatch then combine)."""
        if rank not in self.victims or self.point == BEFORE:
            return None
        call = 2 * self.pair + (2 if self.point.startswith(("combine", "ll_combine")) else 1)
        return FaultPlan(rank=rank, point=self.point, action=self.action, call=call)


def draw(seed: int, transport: str) -> Fault:
    """Episode `seed`'s fault: a rank or a host, kill or stop, a pair after two clean ones."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        host = rng.randrange(WORLD // PER_HOST)
        victims = tuple(range(host * PER_HOST, (host + 1) * PER_HOST))
    else:
        victims = (rng.randrange(WORLD),)
    pair = rng.randrange(2, PAIRS - 2)
    point = rng.choice(POINTS[(transport, "normal" if pair % 2 == 0 else "ll")])
    return Fault(victims, rng.choice(("kill", "stop")), pair, point)


def inputs(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's (x float32 [n, H] small integers, logical topk_idx [n, K] with some -1, dyadic
    weights [n, K]): every sum below is exact, in whatever order a path adds."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(WORLD):
        n = int(torch.randint(1, TOKENS + 1, (1,), generator=g))
        idx = torch.stack([torch.randperm(LOGICAL, generator=g)[:TOPK] for _ in range(n)])
        idx[torch.rand(n, TOPK, generator=g) < 0.1] = -1
        xs.append(torch.randint(-8, 9, (n, HIDDEN), generator=g).float())
        idxs.append(idx)
        ws.append(2.0 ** -torch.randint(1, 4, (n, TOPK), generator=g).float())
    return xs, idxs, ws


def expert(logical_MK: torch.Tensor, w_MK: torch.Tensor, x_MH: torch.Tensor) -> torch.Tensor:
    """The experts' stand-in: row m sums w[m, k] * (logical expert + 1) * x[m] over its valid k."""
    y_MH = torch.zeros_like(x_MH)
    for k in range(logical_MK.shape[1]):
        scale_M = torch.where(logical_MK[:, k] >= 0, w_MK[:, k] * (logical_MK[:, k] + 1).float(), 0.0)
        y_MH += scale_M[:, None] * x_MH
    return y_MH


def checked_pair(buf: ubep.Buffer, placement, seed: int, low_latency: bool) -> tuple[list[str], int]:
    """One dispatch and combine (normal or low latency) on this rank: what was wrong, and how many
    of its entries were left out."""
    me = buf.rank
    xs, idxs, ws = inputs(seed)
    slots_L = placement.local_logical(me)
    wrong = []
    if low_latency:
        got = buf.low_latency_dispatch(xs[me], idxs[me], TOKENS, LOGICAL)
        y = got.recv_x * (slots_L + 1.0)[:, None, None]
        out = buf.low_latency_combine(y, idxs[me], ws[me], got.handle).combined_x
    else:
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        src_M, tok_M = got.handle.recv_src_rank_M, got.handle.recv_src_token_M
        starts = torch.tensor([0] + [x.shape[0] for x in xs], dtype=torch.int64, device="cpu").cumsum(0)
        if not torch.equal(got.recv_x, torch.cat(xs)[starts[src_M] + tok_M]):
            wrong.append("dispatch rows")
        local_MK = got.recv_topk_idx
        logical_MK = torch.where(local_MK >= 0, slots_L[local_MK.clamp(min=0)], -1)
        out = buf.combine(expert(logical_MK, got.recv_topk_weights, got.recv_x), got.handle).combined_x
    left_NK = buf.left_out(idxs[me])
    must_NK, may_NK = lost_bounds(placement, buf.masked_ranks, idxs[me])
    if not torch.equal(out, expert(idxs[me].masked_fill(left_NK, -1), ws[me], xs[me])):
        wrong.append("combined rows")
    if bool((must_NK & ~left_NK).any()) or bool((left_NK & ~may_NK).any()):
        wrong.append(f"left_out outside its bounds (masked {list(buf.masked_ranks)})")
    return wrong, int(left_NK.sum())


def episode_rank(seed: int, transport: str, fault: Fault) -> dict:
    """Every rank: PAIRS checked pairs, `fault` falling in one; the survivors' tallies. The lowest
    survivor ends stopped victims afterwards."""
    me = dist.get_rank()
    pids: list[int] = [0] * WORLD
    dist.all_gather_object(pids, os.getpid())
    placement = copied_placement(LOGICAL, WORLD // PER_HOST, PER_HOST, SLOTS)
    tally: dict = {"wrong": [], "raised": [], "dropped": 0, "pairs": []}
    with ubep.Buffer(
        hidden=HIDDEN,
        num_experts=WORLD * SLOTS,
        max_tokens_per_rank=TOKENS,
        max_topk=TOPK,
        timeout_s=TIMEOUT_S,
        low_latency=True,
        on_peer_failure="mask",
        transport=transport,
        faults=fault.plan(me),
    ) as buf:
        buf.set_placement(placement)
        for pair in range(PAIRS):
            if pair == fault.pair and me in fault.victims and fault.point == BEFORE:
                os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
            started = time.monotonic()
            try:
                wrong, dropped = checked_pair(buf, placement, seed * 100 + pair, low_latency=pair % 2 == 1)
            except UbepError as error:  # the documented raise: survivors that failed different calls
                tally["raised"].append(f"pair {pair}: {type(error).__name__}: {str(error)[:160]}")
                continue
            tally["wrong"] += [f"pair {pair}: {w}" for w in wrong]
            tally["dropped"] += dropped
            tally["pairs"].append((pair, started, time.monotonic(), list(buf.masked_ranks)))
        tally["masked"] = list(buf.masked_ranks)
    if fault.action == "stop" and me == min(set(range(WORLD)) - set(fault.victims)):
        for victim in fault.victims:
            os.kill(pids[victim], signal.SIGKILL)
    return tally


def recovery_s(fault: Fault, tally: dict) -> float | None:
    """Seconds from the start of the pair the fault fell in (the earliest the death can be) to the
    end of the first pair this survivor completed with the victims masked."""
    start = next((s for p, s, _, _ in tally["pairs"] if p == fault.pair), None)
    done = next((e for p, _, e, m in tally["pairs"] if p >= fault.pair and m), None)
    if start is None:  # the fault's pair raised here: time it from the end of the pair before
        start = next((e for p, _, e, _ in reversed(tally["pairs"]) if p < fault.pair), None)
    return None if start is None or done is None else done - start


def run_episodes(transport: str, episodes: int, first_seed: int = 0) -> dict:
    """`episodes` launches of WORLD ranks, each with its drawn fault; the counts over all of them."""
    counts: dict = {"episodes": 0, "hangs": 0, "wrong": [], "crashes": [], "raised": 0, "dropped": 0}
    counts["recovery_s"] = []
    per_node = PER_HOST if transport == "dist" else None
    for seed in range(first_seed, first_seed + episodes):
        fault = draw(seed, transport)
        launch = ubep.LocalLaunch(world_size=WORLD, ranks_per_node=per_node, timeout_s=EPISODE_S)
        outcomes = launch.outcomes(episode_rank, seed, transport, fault)
        counts["episodes"] += 1
        where = f"episode {seed} {fault}"
        said = [
            (o.error or "").strip().splitlines()[-1:]
            for o in outcomes
            if not o.ok and o.rank not in fault.victims
        ]
        print(
            where, [o.cause for o in outcomes], said[:1], flush=True
        )  # a long run's log, episode by episode
        for o in outcomes:
            if o.rank in fault.victims:
                if o.cause != "died":
                    counts["crashes"].append(f"{where}: victim {o.rank} {o.cause}")
                continue
            if o.cause == "deadline":
                counts["hangs"] += 1
            elif not o.ok:
                counts["crashes"].append(f"{where}: rank {o.rank} {o.cause}: {(o.error or '')[-600:]}")
            elif sorted(o.result["masked"]) != list(fault.victims):
                counts["crashes"].append(f"{where}: rank {o.rank} masked {o.result['masked']}")
            else:
                counts["wrong"] += [f"{where}: rank {o.rank} {w}" for w in o.result["wrong"]]
                counts["raised"] += len(o.result["raised"])
                counts["dropped"] += o.result["dropped"]
                if (seconds := recovery_s(fault, o.result)) is not None:
                    counts["recovery_s"].append((fault.action, seconds))
        print(where, "crashes so far:", counts["crashes"][-3:], flush=True)
        print(summary(transport, counts), flush=True)
    return counts


def summary(transport: str, counts: dict) -> str:
    """One line of counts, and the recovery times (median, worst) per action."""
    times = {a: [s for b, s in counts["recovery_s"] if b == a] for a in ("kill", "stop")}
    said = ", ".join(
        f"{a}: median {statistics.median(t):.2f} s, worst {max(t):.2f} s" for a, t in times.items() if t
    )
    return (
        f"{transport}: {counts['episodes']} episodes, {counts['hangs']} hangs, {len(counts['wrong'])} wrong, "
        f"{len(counts['crashes'])} crashes, {counts['raised']} calls raised, {counts['dropped']} entries "
        f"dropped; death to the next step ({TIMEOUT_S:g} s deadline): {said}"
    )


@pytest.mark.timeout(EPISODE_S * EPISODES + 60)
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_survivors_of_killed_and_stopped_ranks_and_hosts_stay_exact(transport):
    counts = run_episodes(transport, EPISODES, first_seed=int(os.environ.get("UBEP_EPISODE_SEED", "0")))
    print(summary(transport, counts))
    assert counts["hangs"] == 0 and counts["crashes"] == [] and counts["wrong"] == [], counts


def test_every_expert_is_on_two_hosts_and_a_dead_host_loses_none():
    """The placement the episodes hold: each expert's copies on two hosts, at most one a rank."""
    p = copied_placement(LOGICAL, WORLD // PER_HOST, PER_HOST, SLOTS)
    host_U = p.rank_of_physical_U // PER_HOST
    for e in range(LOGICAL):
        hosts = set(host_U[p.logical_of_physical_U == e].tolist())
        assert {e % 3, (e + 1) % 3} <= hosts, (e, hosts)
    for r in range(WORLD):
        assert p.local_logical(r).unique().numel() == SLOTS, r
    every_NK = torch.arange(LOGICAL, dtype=torch.int64, device="cpu").view(-1, 8)
    for host in range(WORLD // PER_HOST):
        must, may = lost_bounds(p, [2 * host, 2 * host + 1], every_NK)
        assert not must.any()  # a live copy of every expert
        held = set(p.logical_of_physical_U[2 * host * SLOTS : 2 * (host + 1) * SLOTS].tolist())
        assert set(every_NK[may].tolist()) == held

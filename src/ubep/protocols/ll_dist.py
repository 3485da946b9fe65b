"""Low-latency dispatch/combine over torch.distributed (between hosts; gloo on CPU).

Dispatch: one small all-to-all carries each rank's header to every peer (status,
dtype code, row width, T, and the pair count per local expert of that peer);
then the rows and their (token, top-k slot) metadata leave as asynchronous
`all_to_all_single` operations. That is the send half; the receive half waits
for them and places the rows expert-major. Combine needs no header: the expert
rank knows from the handle what it returns to each home, and the home knows from
its own routing what comes back (ordered by expert rank, local expert, token),
so the send half is one asynchronous all-to-all.

A rank that rejects its dispatch input still joins the header all-to-all with a
"rejected" status, so its peers raise PeerAbortedError instead of waiting for a
collective it will never join. (A rejected combine cannot be announced that way:
peers time out in the process group, as for normal mode on this transport.)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.calls import CallId
from ubep.deadlines import PeerPids, collective_deadline
from ubep.engine import Engine
from ubep.errors import PeerDataError
from ubep.protocols.base import Sizing
from ubep.protocols.ll_base import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    gather_rows,
    place_all,
    reduce_returned,
    returned_rows,
)
from ubep.waiting import AbortNotice, PeerAbortedError

H_STATUS, H_DTYPE, H_WIDTH, H_T, H_COUNTS = 0, 1, 2, 3, 4
OK, REJECTED = 1, 2


class LLDist:
    """Low-latency halves as collectives on a process group."""

    name = "dist-ll"

    def __init__(self, group: dist.ProcessGroup, rank: int, sizing: Sizing, engine: Engine, timeout_s: float):
        self.group = group
        self.me = rank
        self.R = sizing.num_ranks
        self.L = sizing.placement.num_local_experts
        self.engine = engine
        self.timeout_s = timeout_s
        with collective_deadline(group, timeout_s, "Buffer construction (pid exchange)"):
            self._pids = PeerPids.gather(group, rank, self.R)

    def _deadline(self, phase: str):
        """Every collective of this path, and every wait for one, runs under the Buffer's deadline."""
        return collective_deadline(self.group, self.timeout_s, phase, self._pids)

    def _headers(self, send_RW: torch.Tensor) -> torch.Tensor:
        recv_RW = torch.empty_like(send_RW)
        with self._deadline("low-latency dispatch (headers)"):
            dist.all_to_all_single(recv_RW, send_RW, group=self.group)
        return recv_RW

    def _finish(self, phase: str, works: list) -> None:
        """Wait for asynchronous collectives, at most `timeout_s` (a stalled peer is named)."""
        with self._deadline(phase):
            for work in works:
                if not work.wait(timedelta(seconds=self.timeout_s)):
                    raise RuntimeError(f"{phase}: timed out after {self.timeout_s} s")

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        width = plan.rows_NB.shape[1]
        fixed = torch.tensor([OK, plan.code, width, plan.max_tokens], dtype=torch.int64)
        recv_RW = self._headers(torch.cat([fixed.expand(self.R, -1), plan.counts_RL], dim=1))
        self._check_headers(recv_RW, fixed)
        counts_SL = recv_RW[:, H_COUNTS:]
        send, recv = plan.counts_RL.sum(dim=1).tolist(), counts_SL.sum(dim=1).tolist()
        rows_PB = gather_rows(plan.rows_NB, plan.pair_token_P)
        meta_P2 = torch.stack([plan.pair_token_P, plan.pair_k_P], dim=1)
        rows_MB = rows_PB.new_empty((sum(recv), width))
        meta_M2 = meta_P2.new_empty((sum(recv), 2))
        with self._deadline("low-latency dispatch (tokens)"):
            works = [
                dist.all_to_all_single(rows_MB, rows_PB, recv, send, group=self.group, async_op=True),
                dist.all_to_all_single(meta_M2, meta_P2, recv, send, group=self.group, async_op=True),
            ]

        def receive() -> None:
            self._finish("low-latency dispatch (tokens)", works)
            place_all(self.engine, out, counts_SL, rows_MB, meta_M2[:, 0], meta_M2[:, 1])

        return receive

    def _check_headers(self, recv_RW: torch.Tensor, fixed: torch.Tensor) -> None:
        """Every rank sees every header, so every rank reaches the same verdict."""
        rejected = torch.nonzero(recv_RW[:, H_STATUS] != OK).flatten().tolist()
        if rejected:
            notice = AbortNotice(f"rank(s) {rejected} rejected their input; see their error")
            raise PeerAbortedError("low-latency dispatch", rejected[0], notice)
        if not torch.equal(recv_RW[:, :H_COUNTS], fixed.expand(self.R, -1)):
            raise PeerDataError(
                "low-latency dispatch: ranks disagree on T, dtype or use_fp8 "
                f"(per rank [status, dtype, width, T]: {recv_RW[:, :H_COUNTS].tolist()})"
            )

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        rows_QB = returned_rows(plan)  # ordered by home rank
        send = plan.send_counts_R.tolist()
        recv = [plan.expected_from(r) for r in range(self.R)]
        rows_PB = rows_QB.new_empty((sum(recv), rows_QB.shape[1]))
        with self._deadline("low-latency combine"):
            work = dist.all_to_all_single(rows_PB, rows_QB, recv, send, group=self.group, async_op=True)

        def receive() -> None:
            self._finish("low-latency combine", [work])
            reduce_returned(self.engine, plan, rows_PB, out_NH)

        return receive

    def abort(self, call: CallId, kind: str) -> None:
        if kind == "dispatch":
            header = torch.zeros(self.R, H_COUNTS + self.L, dtype=torch.int64)
            header[:, H_STATUS] = REJECTED
            try:
                self._headers(header)
            except Exception:
                pass  # the caller is already raising the reason this rank gave up

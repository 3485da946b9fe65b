"""Low-latency dispatch/combine over torch.distributed (between hosts; gloo on CPU).

Dispatch: the call header (`ubep.across.call_header`: status, dtype, T, and
per peer the pair count for each of its local experts) goes to every
peer in one all-to-all of fixed size; then the rows and their (token, top-k
slot) metadata leave as asynchronous `all_to_all_single` operations. That is
the send half; the receive half waits for them and places the rows
expert-major. Combine sends the call header too (the dispatch its handle
names, dtype), then needs no counts: the expert rank knows from the
handle what it returns to each home, and the home knows from its own routing
what comes back (ordered by expert rank, local expert, token), so the rest of
the send half is one asynchronous all-to-all.

Ranks whose calls differ raise on every rank at the header, before any
variable-size collective; a rank that rejects its input (dispatch or combine)
joins the header as REJECTED, so its peers raise PeerAbortedError at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.across.call_header import CallHeader, CallHeaders
from ubep.calls import CallId
from ubep.deadlines import PeerPids, collective_deadline, construction_s
from ubep.engine import Engine
from ubep.errors import PeerDataError
from ubep.protocols.base import LowLatencyExchange, Sizing
from ubep.protocols.ll.plans import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    gather_rows,
    place_all,
    reduce_returned,
    returned_rows,
)


class LLDist(LowLatencyExchange):
    """Low-latency halves as collectives on a process group."""

    name = "dist-ll"

    def __init__(self, group: dist.ProcessGroup, rank: int, sizing: Sizing, engine: Engine, timeout_s: float):
        self.group = group
        self.me = rank
        self.R = sizing.num_ranks
        self.L = sizing.placement.num_local_experts
        self.engine = engine
        self.timeout_s = timeout_s
        with collective_deadline(group, construction_s(timeout_s), "Buffer construction (pid exchange)"):
            self._pids = PeerPids.gather(group, rank, self.R)
        # Every collective of this path, and every wait for one, runs under the Buffer's deadline; a
        # partial, not a bound method, so no reference cycle keeps the group alive after close.
        self._deadline = functools.partial(collective_deadline, group, timeout_s, peers=self._pids)
        self.headers = CallHeaders(group, self.R, self.L, self._deadline)

    def _finish(self, phase: str, works: list) -> None:
        """Wait for asynchronous collectives, at most `timeout_s` (a stalled peer is named)."""
        with self._deadline(phase):
            for work in works:
                if not work.wait(timedelta(seconds=self.timeout_s)):
                    raise RuntimeError(f"{phase}: timed out after {self.timeout_s} s")

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        width = plan.rows_NB.shape[1]
        header = CallHeader.of(call, dtype=plan.code, tokens=plan.max_tokens)
        counts_SL = self.headers.exchange(call, header, plan.counts_RL)
        bad_S = ((counts_SL < 0) | (counts_SL > plan.max_tokens)).any(dim=1)
        if bad_S.any():
            src = int(torch.nonzero(bad_S)[0])
            raise PeerDataError(
                f"low-latency dispatch: rank {src} announced pair counts {counts_SL[src].tolist()}, "
                f"each must lie in [0, {plan.max_tokens}]"
            )
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

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        header = CallHeader.of(call, handle=plan.handle_seq, dtype=plan.code)
        self.headers.exchange(call, header)
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
        """Join the call's header exchange as REJECTED (once), so the peers fail at once."""
        self.headers.abort(call)

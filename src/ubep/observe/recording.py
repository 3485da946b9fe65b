"""Recording what each call does, around the exchange a Buffer built, when stats are on.

    Buffer -> [RecordedExchange / RecordedLowLatency] -> protocol's exchange -> engine -> transport

The wrappers stand between the Buffer and its exchanges only when `Buffer(stats=True)`
(or `UBEP_STATS=1`, or the `ubep` logger at DEBUG); otherwise they are not there at all,
so a Buffer without stats runs exactly the code it ran before. Everything recorded is known
in Python before or after the call: the rows per destination from the send plan, tokens
per expert from the routing, and three timestamps (ready, sent, end). Nothing enters the
compiled halves. `Recorder.snapshot()` turns the counters into a `ubep.stats.Stats`.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection

import numpy as np
import torch

from ubep.calls import CallId
from ubep.protocols.base import Exchange, LowLatencyExchange, Received, SendPlan
from ubep.protocols.ll.plans import LLCombinePlan, LLDispatchOut, LLDispatchPlan
from ubep.results import DispatchHandle
from ubep.stats import KINDS, CallRecord, Stats, StatsOptions
from ubep.transport.base import Agreement

ROUTING_BYTES = 8 + 4  # a dispatched row's top-k entry: expert id (int64) and weight (float32)
SCALE_BYTES = 4  # an FP8 row's scale per 128 values (float32)


# How a call's counts tensor gives the rows it sent to each rank.
ROWS, PREFIX, PER_EXPERT = 0, 1, 2  # [R] as is; [R + 1] prefix sums; [R, L] summed over L
FOLD_ROUTINGS = 64  # routings counted into the expert load at once (a snapshot counts any left)


class Recorder:
    """One Buffer's counters and its recent calls.

    A call's own work is a few list operations on R numbers; the expert load, the one
    count over every top-k entry, waits until FOLD_ROUTINGS routings are pending and then
    takes one bincount over all of them. A lock makes a scrape from another thread
    (`snapshot`) see whole calls.
    """

    def __init__(
        self, rank: int, num_ranks: int, num_experts: int, options: StatsOptions, log: logging.Logger
    ):
        self.rank, self.R, self.E = rank, num_ranks, num_experts
        self.options, self.log = options, log
        self._lock = threading.Lock()
        self._calls = dict.fromkeys(KINDS, 0)
        self._time_ns = dict.fromkeys(KINDS, 0)
        self._rows_R = [0] * num_ranks
        self._bytes_R = [0] * num_ranks
        self._load_LE = np.zeros((options.layers, num_experts), dtype=np.int64)
        self._routings: list[tuple[int, np.ndarray]] = []  # (layer slot, top-k ids) not yet counted
        self._routed = 0  # dispatches with routing so far: the next one's layer slot
        self._recent: deque[CallRecord] = deque(maxlen=options.recent)

    def record(
        self,
        call: CallId,
        times: tuple[int, int, int],
        counts: torch.Tensor,
        how: int,
        row_bytes: int,
        tokens: int,
        recv_rows: int,
        topk_idx_NK: torch.Tensor | None = None,
    ) -> None:
        """One finished call: times (ready, sent, end) in ns; the rows it sent to each rank as
        `counts` read `how` (ROWS, PREFIX, PER_EXPERT), each of `row_bytes`; the routing it
        dispatched (None: no routing, as in combine or a cached dispatch)."""
        rows = _rows(counts, how)
        ready, sent, end = times
        rec = CallRecord(
            call.seq, call.kind, self.rank, ready, sent, end, tuple(rows), row_bytes, tokens, recv_rows
        )
        # a copy of the routing: the caller may reuse its tensor before the load is counted
        idx = None if topk_idx_NK is None else topk_idx_NK.cpu().numpy().ravel().copy()
        with self._lock:
            self._calls[call.kind] += 1
            self._time_ns[call.kind] += end - ready
            rows_R, bytes_R = self._rows_R, self._bytes_R
            for r, n in enumerate(rows):
                rows_R[r] += n
                bytes_R[r] += n * row_bytes
            self._recent.append(rec)
            if idx is not None:
                self._routings.append((self._routed % self.options.layers, idx))
                self._routed += 1
                if len(self._routings) >= FOLD_ROUTINGS:
                    self._count_load()
        if self.log.isEnabledFor(logging.DEBUG):
            self.log.debug(
                "rank %d %s #%d: %d %s in, sent %d rows (%d bytes) [per rank %s], received %s rows, "
                "%.1f us in the call (%.1f us after its send half)",
                self.rank, call.kind, call.seq, tokens, "tokens" if "dispatch" in call.kind else "rows",
                sum(rows), sum(rows) * row_bytes, ",".join(map(str, rows)),
                recv_rows if recv_rows >= 0 else "?", (end - ready) / 1e3, (end - sent) / 1e3,
            )  # fmt: skip

    def _count_load(self) -> None:
        """The pending routings into the expert load, one bincount per layer slot (under the lock)."""
        slots: dict[int, list[np.ndarray]] = {}
        for slot, idx in self._routings:
            slots.setdefault(slot, []).append(idx)
        self._routings = []
        for slot, parts in slots.items():
            every = np.concatenate(parts)
            self._load_LE[slot] += np.bincount(every[every >= 0], minlength=self.E)

    def snapshot(self) -> Stats:
        """This rank's counters and recent calls (copies)."""
        with self._lock:
            self._count_load()
            rows_RR = torch.zeros(self.R, self.R, dtype=torch.int64, device="cpu")
            bytes_RR = torch.zeros(self.R, self.R, dtype=torch.int64, device="cpu")
            rows_RR[self.rank] = torch.tensor(self._rows_R, dtype=torch.int64, device="cpu")
            bytes_RR[self.rank] = torch.tensor(self._bytes_R, dtype=torch.int64, device="cpu")
            kinds = [k for k in KINDS if self._calls[k]]
            return Stats(
                ranks=(self.rank,),
                num_ranks=self.R,
                num_experts=self.E,
                calls={k: self._calls[k] for k in kinds},
                time_ns={k: (self._time_ns[k],) for k in kinds},
                traffic_rows_RR=rows_RR,
                traffic_bytes_RR=bytes_RR,
                expert_load_LE=torch.from_numpy(self._load_LE.copy()),
                recent=tuple(self._recent),
            )


def _rows(counts: torch.Tensor, how: int) -> list[int]:
    """Rows sent to each rank, from a call's counts (R numbers: plain lists beat numpy here)."""
    c = counts.tolist()
    if how == PREFIX:
        return [b - a for a, b in itertools.pairwise(c)]
    return [sum(row) for row in c] if how == PER_EXPERT else c


def _row_bytes(x: torch.Tensor, scales: torch.Tensor | None, topk: int) -> int:
    """Bytes one row carries: its values, its FP8 scales, its top-k entries (ids and weights)."""
    S = 0 if scales is None else scales.shape[1]
    return x.shape[1] * x.element_size() + S * SCALE_BYTES + topk * ROUTING_BYTES


class RecordedExchange(Exchange):
    """A normal-mode exchange that records each call, then answers as the exchange it wraps."""

    def __init__(self, inner: Exchange, recorder: Recorder):
        self._inner, self._rec = inner, recorder
        self.name, self.halves, self.across_hosts = inner.name, inner.halves, inner.across_hosts
        self.layout_by_send = inner.layout_by_send

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        ready = time.time_ns()
        got = self._inner.dispatch(call, plan, handle)
        end = time.time_ns()
        idx = plan.topk_idx_NK
        K = 0 if idx is None else idx.shape[1]
        self._rec.record(
            call, (ready, ready, end), plan.send_counts_R, ROWS, _row_bytes(plan.x_NH, plan.scales_NS, K),
            plan.x_NH.shape[0], got.recv_x_MH.shape[0], idx,
        )  # fmt: skip
        return got

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        ready = time.time_ns()
        out = self._inner.combine(call, x_MH, handle, topk_weights_MK)
        end = time.time_ns()
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        row_bytes = x_MH.shape[1] * x_MH.element_size() + K * 4
        prefix = handle.recv.prefix_R1  # rows that came from each home go back to it
        self._rec.record(
            call, (ready, ready, end), prefix, PREFIX, row_bytes, x_MH.shape[0], handle.num_tokens
        )
        return out

    def abort(self, call: CallId) -> None:
        self._inner.abort(call)

    def close(self) -> None:
        self._inner.close()

    def check(self) -> None:
        self._inner.check()

    def mask(self, ranks: Collection[int], seq: int) -> int:
        return self._inner.mask(ranks, seq)

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        return self._inner.agree_to_mask(error, seq)

    def agree(self, value: int, phase: str) -> dict[int, int]:
        return self._inner.agree(value, phase)

    def admissions(self, seq: int, boundary: bool) -> frozenset[int]:
        return self._inner.admissions(seq, boundary)

    def admit(self, ranks: Collection[int], seq: int) -> frozenset[int]:
        return self._inner.admit(ranks, seq)

    def join(self, deadline_s: float, stamp: Callable[[str], None]) -> Agreement:
        return self._inner.join(deadline_s, stamp)


class RecordedLowLatency(LowLatencyExchange):
    """A low-latency exchange that records each call once its receive half has run."""

    def __init__(self, inner: LowLatencyExchange, recorder: Recorder):
        self._inner, self._rec = inner, recorder
        self.name, self.halves, self.on_device = inner.name, inner.halves, inner.on_device
        self.routes_in_halves, self.finishes_combine = inner.routes_in_halves, inner.finishes_combine

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut):
        ready = time.time_ns()
        receive = self._inner.dispatch_send(call, plan, out)
        sent = time.time_ns()
        counts_RL, row_bytes, handle = plan.counts_RL, plan.rows_NB.shape[1], out.handle

        def received() -> None:
            receive()
            self._rec.record(
                call, (ready, sent, time.time_ns()), counts_RL, PER_EXPERT, row_bytes, handle.num_tokens,
                int(handle.recv_count_L.sum()), handle.topk_idx_NK,
            )  # fmt: skip

        return received

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor):
        ready = time.time_ns()
        receive = self._inner.combine_send(call, plan, out_NH)
        sent = time.time_ns()
        counts_R, row_bytes, rows = plan.send_counts_R, plan.x_LMB.shape[-1], plan.local_Q.shape[0]

        def received() -> None:
            receive()
            self._rec.record(call, (ready, sent, time.time_ns()), counts_R, ROWS, row_bytes, rows, -1)

        return received

    def combine_rows(self, call: CallId, x_LMH, w_NK, handle, out_NH, idx_NK) -> Callable[[], None]:
        return self._inner.combine_rows(call, x_LMH, w_NK, handle, out_NH, idx_NK)

    def abort(self, call: CallId, kind: str) -> None:
        self._inner.abort(call, kind)

    def check(self) -> None:
        self._inner.check()

    def resume(self, seq: int) -> None:
        self._inner.resume(seq)

    def finish_combine(self, call: CallId, got) -> None:
        self._inner.finish_combine(call, got)

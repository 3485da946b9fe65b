"""Low-latency mode across hosts: every peer reached over the fabric (`ubep.across.fabric`), no collective
inside a call (transport "dist").

    dispatch  send     to every live peer, one message: the call header, its row count per local
                       expert, then each (token, expert) row bound there and its (token, top-k slot)
              receive  as each peer's message lands: check it; place its rows expert-major as soon as
                       the ranks before it are placed (each expert's rows stay in source order)
    combine   send     to every home, one message: the header, then the rows it returns there
              receive  as each expert rank's message lands, its rows go to their place (known from the
                       home's own routing); once all are in, the weighted sum over k ascending

The fixed slots of low-latency mode become fixed inboxes: every (lane, peer)
has one per call (seq) parity, so a dispatch may be sent while the previous one's
receive half is still pending (two calls of a kind in flight, as DeepEP allows).
The counts travel with the rows; a late peer holds up only its own rows.

Legend: see `ubep.protocols.ll.plans`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple

import torch

from ubep.across.call_header import WORDS, CallHeader, check_message, other_call_check
from ubep.across.fabric.base import Fabric, Lane
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import PeerDataError, UbepError
from ubep.layout import prefix_offsets
from ubep.protocols.base import LowLatencyExchange, Sizing
from ubep.protocols.ll.plans import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    gather_rows,
    per_writer,
    place_source,
    reduce_returned,
    returned_rows,
)
from ubep.timers import lap, timed
from ubep.waiting import blame_of


def lanes(s: Sizing) -> tuple[Lane, ...]:
    """The fabric's lanes for low-latency mode: T tokens a peer, each at most once per local expert."""
    T, L, B = s.capacity, s.placement.num_local_experts, s.row_bytes
    pairs = T * min(s.max_topk, L)  # rows one source sends one destination (`per_writer`)
    return (
        Lane("ll_dispatch", WORDS + L, pairs * (16 + B)),
        Lane("ll_combine", WORDS + 1, per_writer(s) * B),
    )


class LLFabric(LowLatencyExchange):
    """Low-latency halves with every peer over a fabric."""

    name = "ubep-ll"
    halves = "step by step in Python: one message per peer and call half, handled as it lands"

    def __init__(self, fabric: Fabric, engine: Engine, sizing: Sizing):
        self.fabric, self.engine, self.sizing = fabric, engine, sizing
        self.me, self.R = fabric.rank, sizing.num_ranks
        self.L = sizing.placement.num_local_experts
        self._aborted = 0

    def _peers(self) -> list[int]:
        return [p for i in range(1, self.R) if (p := (self.me + i) % self.R) in self.fabric.live]

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        mine = torch.tensor(
            astuple(CallHeader.of(call, dtype=plan.code, tokens=plan.max_tokens)),
            dtype=torch.int64,
            device="cpu",
        )
        rows_PB = gather_rows(plan.rows_NB, plan.pair_token_P)
        meta_P2 = torch.stack([plan.pair_token_P, plan.pair_k_P], dim=1)
        offsets = prefix_offsets(plan.counts_RL.sum(dim=1))
        self.fabric.begin(call)
        lap(call.timers, "between")
        try:
            for peer in self._peers():
                a, z = int(offsets[peer]), int(offsets[peer + 1])
                self._send(
                    call, "ll_dispatch", peer, mine, plan.counts_RL[peer], [meta_P2[a:z], rows_PB[a:z]]
                )
        except UbepError as error:
            self._give_up(call, error)
            raise
        lap(call.timers, "send")
        a, z = int(offsets[self.me]), int(offsets[self.me + 1])
        own = (plan.counts_RL[self.me], rows_PB[a:z], meta_P2[a:z])
        return lambda: self._receive_rows(call, plan, out, mine, own)

    def _send(self, call: CallId, lane: str, peer: int, mine, counts, parts: list[torch.Tensor]) -> None:
        """One message: the header, `counts` (int64 words after it), then the parts' bytes in turn."""
        blocks = [part.contiguous().view(torch.uint8).view(-1) for part in parts]
        out = self.fabric.outbox(lane, peer, call, WORDS + counts.numel(), sum(b.numel() for b in blocks))
        out.header[:WORDS], out.header[WORDS:] = mine, counts
        at = 0
        for block in blocks:
            out.payload[at : at + block.numel()].copy_(block)
            at += block.numel()
        self.fabric.send(out)

    def _receive_rows(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut, mine, own) -> None:
        """Every live source's rows, expert-major, each source placed once those before it are."""
        landed = {self.me: own}
        begin_L = torch.zeros(self.L, dtype=torch.int64, device="cpu")
        turn = 0  # the next source in rank order

        def place_ready() -> None:
            nonlocal turn, begin_L
            while turn < self.R and (turn not in self.fabric.live or turn in landed):
                counts_L = torch.zeros(
                    self.L, dtype=torch.int64, device="cpu"
                )  # a masked rank places nothing
                if turn in self.fabric.live:
                    counts_L, rows_nB, meta_n2 = landed.pop(turn)
                    token_n, k_n = meta_n2[:, 0], meta_n2[:, 1]
                    place_source(self.engine, out, turn, begin_L, counts_L, rows_nB, token_n, k_n)
                    if turn != self.me:
                        self.fabric.release("ll_dispatch", turn, call)
                else:
                    out.handle.layout_range_LR2[:, turn, 0], out.handle.layout_range_LR2[:, turn, 1] = (
                        begin_L,
                        0,
                    )
                begin_L = begin_L + counts_L
                turn += 1

        phase, differ = "low-latency dispatch (tokens)", other_call_check(call, self.me, mine)
        try:
            place_ready()
            lap(call.timers, "receive")  # the own rows
            arrivals = self.fabric.arrivals("ll_dispatch", call, self._peers(), phase, differ)
            for msg in timed(arrivals, call.timers):
                landed[msg.peer] = self._check_sent(call, msg, mine, plan.max_tokens, out.row_width)
                place_ready()
                lap(call.timers, "receive")
        except UbepError as error:
            self._give_up(call, error)
            raise
        out.handle.recv_count_L.copy_(begin_L)

    def _check_sent(self, call: CallId, msg, mine, T: int, B: int):
        """(counts [L], rows uint8 [n, B], (token, k) int64 [n, 2]) of a landed dispatch message,
        checked: the peer's call, its counts, its sizes, its tokens' bounds (read once)."""
        peer, h, K = msg.peer, msg.header, self.sizing.max_topk
        check_message(call, self.me, mine, peer, h, WORDS + self.L)
        counts_L = h[WORDS:]
        if counts_L.min() < 0 or counts_L.max() > T:
            said = f"announced pair counts {counts_L.tolist()}, each must lie in [0, {T}]"
            raise self._bad(call, peer, f"low-latency dispatch: rank {peer} {said}")
        n = int(counts_L.sum())
        if msg.payload.numel() != n * (16 + B):
            said = f"sent {msg.payload.numel()} bytes for {n} rows"
            raise self._bad(call, peer, f"low-latency dispatch: rank {peer} {said}")
        meta_n2 = msg.payload[: 16 * n].view(torch.int64).view(n, 2).clone()
        token_n, k_n = meta_n2[:, 0], meta_n2[:, 1]
        if n and (token_n.min() < 0 or token_n.max() >= T or k_n.min() < 0 or k_n.max() >= K):
            raise self._bad(call, peer, f"low-latency dispatch: rank {peer} sent token indices out of range")
        return counts_L, msg.payload[16 * n :].view(n, B), meta_n2

    # -- combine ----------------------------------------------------------------------------------

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        mine = torch.tensor(
            astuple(CallHeader.of(call, handle=plan.handle_seq, dtype=plan.code)),
            dtype=torch.int64,
            device="cpu",
        )
        rows_QB = returned_rows(plan)  # ordered by home rank
        offsets = prefix_offsets(plan.send_counts_R)
        self.fabric.begin(call)
        lap(call.timers, "between")
        try:
            for peer in self._peers():
                a, z = int(offsets[peer]), int(offsets[peer + 1])
                self._send(
                    call,
                    "ll_combine",
                    peer,
                    mine,
                    torch.tensor([z - a], dtype=torch.int64, device="cpu"),
                    [rows_QB[a:z]],
                )
        except UbepError as error:
            self._give_up(call, error)
            raise
        lap(call.timers, "send")
        a, z = int(offsets[self.me]), int(offsets[self.me + 1])
        return lambda: self._reduce(call, plan, out_NH, mine, rows_QB[a:z])

    def _reduce(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor, mine, own_QB) -> None:
        """Each expert rank's rows into their place (by expert rank, as `reduce_returned` takes them) as
        they land; then the weighted sum."""
        B = plan.x_LMB.shape[2]
        expected = [plan.expected_from(r) if r in self.fabric.live else 0 for r in range(self.R)]
        at = prefix_offsets(torch.tensor(expected, dtype=torch.int64, device="cpu"))
        rows_PB = torch.empty(int(at[-1]), B, dtype=torch.uint8, device="cpu")
        rows_PB[int(at[self.me]) : int(at[self.me + 1])] = own_QB
        try:
            phase, differ = "low-latency combine", other_call_check(call, self.me, mine)
            arrivals = self.fabric.arrivals("ll_combine", call, self._peers(), phase, differ)
            for msg in timed(arrivals, call.timers):
                peer = msg.peer
                check_message(call, self.me, mine, peer, msg.header, WORDS + 1)
                count = int(msg.header[WORDS])
                if count != expected[peer] or msg.payload.numel() != count * B:
                    said = f"returned {count} rows, expected {expected[peer]}"
                    raise self._bad(call, peer, f"low-latency combine: rank {peer} {said}")
                rows_PB[int(at[peer]) : int(at[peer + 1])] = msg.payload.view(count, B)
                self.fabric.release("ll_combine", peer, call)
                lap(call.timers, "receive")
        except UbepError as error:
            self._give_up(call, error)
            raise
        reduce_returned(self.engine, plan, rows_PB, out_NH)
        lap(call.timers, "receive")

    # -- failures ---------------------------------------------------------------------------------

    def _bad(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        self.fabric.abort(call, culprit)
        self._aborted = call.seq
        return PeerDataError(message, culprit=culprit)

    def _give_up(self, call: CallId, error: UbepError) -> None:
        self._abort(call, blame_of(error), rejected=False)

    def abort(self, call: CallId, kind: str) -> None:
        """The Buffer gives up on `call` outside the halves (it rejected this rank's input): tell the
        peers, unless a half already has."""
        self._abort(call, None, rejected=True)

    def _abort(self, call: CallId, culprit: int | None, rejected: bool) -> None:
        if self._aborted != call.seq:
            self._aborted = call.seq
            self.fabric.abort(call, culprit, rejected)

"""The UBEP protocol across hosts: every peer reached over the fabric (`ubep.across.fabric`), no collective
inside a call (transport "dist").

    dispatch  send     to every live peer, one message: the call header, its row count and this
                       rank's token count, then each row's routing (source token, local top-k as the
                       peer sees it, weights) and the row itself
              receive  as each peer's message lands (any order): check it; place its rows as soon
                       as the blocks of the ranks before it are placed (rows stay in rank order)
    combine   send     to every home, one message: the header, then the weights (if any) and the rows
                       it sent here, in the order they came (weights first: they need 4-byte alignment)
              reduce   as each expert rank's message lands: add its rows into the float32 sums, in
                       ascending rank order (the reference's), rounding once at the end

The counts travel with the rows: there is no count round and no barrier, and a
late peer holds up only the rows that need its own. A rank sends itself nothing:
its own rows go straight into place. A cached dispatch sends rows only; the
handle says where they go, so they are placed the moment they land.

Every message opens with the call header of `ubep.across.call_header`: a
peer whose call differs is named, and a peer that rejected its input tells every
rank (`Fabric.abort`), so each raises in that call and the next call is exact.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import astuple

import torch

from ubep.across.call_header import NONE, WORDS, CallHeader, check_message, other_call_check
from ubep.across.fabric.base import Fabric, Lane, Message
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import PeerDataError, UbepError
from ubep.layout import destination_major, localize_for_destinations
from ubep.protocols.base import DTYPE_CODES, Exchange, Received, SendPlan, Sizing
from ubep.registry import UBEP
from ubep.results import DispatchHandle, RecvRoute
from ubep.timers import lap, timed
from ubep.transport.base import Agreement
from ubep.waiting import blame_of

COUNT, TOKENS = WORDS, WORDS + 1  # header words after the call header: rows in this message, tokens sent


def lanes(s: Sizing) -> tuple[Lane, ...]:
    """The fabric's lanes for normal mode: at most T rows a message, routing beside each."""
    T, K, B = s.capacity, s.max_topk, s.row_bytes
    return (
        Lane("dispatch", WORDS + 2, T * (meta_bytes(K) + B)),
        Lane("combine", WORDS + 1, T * (B + 4 * K)),
    )


def meta_bytes(K: int) -> int:
    """Bytes of one row's routing: source token, K local ids (int64), K weights (float32 bits, int64)."""
    return 8 * (1 + 2 * K)


class UbepFabric(Exchange):
    """UBEP dispatch/combine with every peer over a fabric."""

    name = UBEP.name

    def __init__(self, fabric: Fabric, engine: Engine, sizing: Sizing, reason: str = ""):
        self.fabric, self.engine, self.sizing = fabric, engine, sizing
        self.across_hosts = (
            f"every peer over the {fabric.name} fabric ({reason}), no collective inside a call"
        )
        self.me, self.R = fabric.rank, sizing.num_ranks
        self._aborted = 0  # the last call this rank told its peers it gave up on

    halves = "step by step in Python: one message per peer and call half, handled as it lands"

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        x_NX = plan.packed_rows()  # one tensor of rows: an FP8 pair travels as byte rows
        cached = handle is not None
        K = 0 if cached else plan.topk_idx_NK.shape[1]
        mine = self._header(call, handle, x_NX.dtype, K)
        tokens = list(plan.send_tokens()) if not cached else list(handle_tokens(handle))
        self.fabric.begin(call)
        meta_RX = None if cached else self._routing(plan, tokens)
        try:
            lap(call.timers, "between")
            for peer in self._peers():
                self._send_rows(call, "dispatch", peer, mine, x_NX, tokens, meta_RX, plan.x_NH.shape[0])
            lap(call.timers, "send")
            received = self._receive_rows(call, plan, handle, mine, x_NX, tokens, meta_RX, K)
            self.fabric.sent()
            return received
        except UbepError as error:
            self._give_up(call, error)
            raise

    def _header(
        self, call: CallId, handle: DispatchHandle | None, dtype: torch.dtype, K: int
    ) -> torch.Tensor:
        header = CallHeader.of(
            call, handle=NONE if handle is None else handle.seq, dtype=DTYPE_CODES[dtype], topk=K or NONE
        )
        return torch.tensor(astuple(header), dtype=torch.int64, device="cpu")

    def _routing(self, plan: SendPlan, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per destination, int64 [n, 1 + 2K]: each row's source token, local ids as the
        destination sees them, and weights (float32 bits)."""
        dest_n, token_n = destination_major(plan.is_token_in_rank_NR)
        local_nK, w_nK = localize_for_destinations(
            plan.topk_idx_NK[token_n], plan.topk_weights_NK[token_n], dest_n, self.sizing.placement
        )
        meta_nX = torch.cat([token_n[:, None], local_nK, w_nK.view(torch.int32).to(torch.int64)], dim=1)
        return list(meta_nX.split([t.numel() for t in tokens]))

    def _peers(self) -> list[int]:
        """The live peers, from the next rank on (so not every rank sends to rank 0 first)."""
        return [p for i in range(1, self.R) if (p := (self.me + i) % self.R) in self.fabric.live]

    def _send_rows(self, call, lane, peer, mine, rows_NX, tokens, meta_RX, num_tokens) -> None:
        """One message to `peer`: the header, its rows' routing (meta_RX[peer], unless None), its rows."""
        index_n = tokens[peer]
        n, row_bytes = index_n.numel(), rows_NX.shape[1] * rows_NX.element_size()
        meta = 0 if meta_RX is None else meta_RX[peer].shape[1] * 8
        out = self.fabric.outbox(lane, peer, call, WORDS + 2, n * (meta + row_bytes))
        out.header[:WORDS] = mine
        out.header[COUNT], out.header[TOKENS] = n, num_tokens
        if meta:
            out.payload[: n * meta].view(torch.int64).view(n, meta // 8).copy_(meta_RX[peer])
        rows_nX = out.payload[n * meta :].view(rows_NX.dtype).view(n, rows_NX.shape[1])
        self.engine.copy_rows(rows_NX, index_n, rows_nX, None)
        self.fabric.send(out)

    def _receive_rows(self, call, plan, handle, mine, x_NX, tokens, meta_RX, K: int) -> Received:
        """Every live peer's rows, each placed as soon as its place is known: at once for a cached
        dispatch (the handle's), else once the blocks of the ranks before it are placed."""
        cached, X = handle is not None, x_NX.shape[1]
        prefix_R1 = (
            handle.recv_prefix_R1 if cached else torch.zeros(self.R + 1, dtype=torch.int64, device="cpu")
        )
        live = self.fabric.live
        rows_out = int(prefix_R1[-1]) if cached else self.sizing.capacity * len(live)  # the most it can be
        out = _Outputs(x_NX, rows_out, K, cached)
        order = None if cached else _InOrder(self.R, self.fabric.live, prefix_R1)
        landed = {self.me: (tokens[self.me].numel(), None, None)}

        def place(src: int, count: int) -> None:
            ready = [(src, int(prefix_R1[src]))] if order is None else order.land(src, count)
            self._place(ready, landed, out, x_NX, tokens, meta_RX)
            for done, _ in ready:
                if done != self.me:
                    self.fabric.release("dispatch", done, call)

        place(self.me, landed[self.me][0])
        lap(call.timers, "receive")  # the own rows
        differ = other_call_check(call, self.me, mine)
        arrivals = self.fabric.arrivals("dispatch", call, self._peers(), "dispatch (tokens)", differ)
        for msg in timed(arrivals, call.timers):
            count, meta_nX, rows_nX = self._check_dispatch(call, msg, mine, X, x_NX.dtype, K, handle)
            landed[msg.peer] = (count, meta_nX, rows_nX)
            place(msg.peer, count)
            lap(call.timers, "receive")
        M = int(prefix_R1[-1])
        if cached:
            return Received.unpacking(plan, out.x_MX, None, None, handle.recv)
        route = RecvRoute.of(out.src_token_M[:M].clone(), prefix_R1)
        return Received.unpacking(plan, out.x_MX[:M], out.idx_MK[:M], out.w_MK[:M], route)

    def _check_dispatch(self, call, msg: Message, mine, X: int, dtype, K: int, handle):
        """(row count, routing [n, 1 + 2K] or None, rows [n, X]) of a landed message,
        checked: the peer's call, its counts, its routing's bounds. A bad one blames the peer."""
        peer, h, T = msg.peer, msg.header, self.sizing.capacity
        check_message(call, self.me, mine, peer, h, WORDS + 2)
        count, sent = int(h[COUNT]), int(h[TOKENS])
        if not 0 <= sent <= T or not 0 <= count <= sent:
            raise self._bad(
                call, peer, f"dispatch: rank {peer} announced {count} rows of {sent} tokens, capacity is {T}"
            )
        meta = 0 if handle is not None else meta_bytes(K)
        row_bytes = X * dtype.itemsize
        if msg.payload.numel() != count * (meta + row_bytes):
            raise self._bad(
                call, peer, f"dispatch: rank {peer} sent {msg.payload.numel()} bytes for {count} rows"
            )
        rows = msg.payload[count * meta :].view(dtype).view(count, X)
        if handle is not None:
            expected = int(handle.recv_prefix_R1[peer + 1] - handle.recv_prefix_R1[peer])
            if count != expected:
                raise self._bad(
                    call, peer, f"dispatch: rank {peer} sends {count} rows here, this rank's handle expects "
                    f"{expected} (all ranks must pass handles of the same dispatch)",
                )  # fmt: skip
            a = int(handle.recv_prefix_R1[peer])
            if count and int(handle.recv_src_token_M[a : a + count].max()) >= sent:
                raise self._bad(
                    call, peer, f"dispatch: rank {peer} sent {sent} tokens, fewer than routed here"
                )
            return count, None, rows
        meta_nX = msg.payload[: count * meta].view(torch.int64).view(count, 1 + 2 * K).clone()  # read once
        token_n, local_nK = meta_nX[:, 0], meta_nX[:, 1 : 1 + K]
        L = self.sizing.placement.num_local_experts
        if count and (token_n.min() < 0 or token_n.max() >= sent):
            raise self._bad(call, peer, f"dispatch: rank {peer} listed tokens outside [0, {sent})")
        if count and (local_nK.min() < -1 or local_nK.max() >= L):
            raise self._bad(call, peer, f"dispatch: rank {peer} routed to local expert ids outside [-1, {L})")
        if count and not bool((local_nK >= 0).any(dim=1).all()):
            raise self._bad(
                call,
                peer,
                f"dispatch: rank {peer} listed a token for this rank that selects none of its experts",
            )
        return count, meta_nX, rows

    def _place(self, ready, landed, out: _Outputs, x_NX, tokens, meta_RX) -> None:
        """Copy each ready source's rows (and routing) into place: `ready` is [(source, row offset)]."""
        for src, at in ready:
            count, meta_nX, rows_nX = landed.pop(src)
            if src == self.me:  # own rows: straight from x
                rows_nX, meta_nX = x_NX[tokens[src]], (None if meta_RX is None else meta_RX[src])
            self.engine.copy_rows(rows_nX, None, out.x_MX[at : at + count], None)
            if meta_nX is not None:
                K = (meta_nX.shape[1] - 1) // 2
                out.src_token_M[at : at + count] = meta_nX[:, 0]
                out.idx_MK[at : at + count] = meta_nX[:, 1 : 1 + K]
                out.w_MK[at : at + count] = meta_nX[:, 1 + K :].to(torch.int32).view(torch.float32)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK):
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        mine = self._header(call, handle, x_MH.dtype, K)  # names the dispatch: every rank must agree
        self.fabric.begin(call)
        try:
            lap(call.timers, "between")
            for peer in self._peers():
                self._send_back(call, peer, mine, x_MH, topk_weights_MK, handle)
            lap(call.timers, "send")
            reduced = self._reduce(call, mine, x_MH, topk_weights_MK, handle)
            self.fabric.sent()
            return reduced
        except UbepError as error:
            self._give_up(call, error)
            raise

    def _send_back(self, call, peer, mine, x_MH, w_MK, handle) -> None:
        """One message to home `peer`: the weights of the rows it sent here, then the rows, in the order
        they came. Weights first: float32 needs 4-byte alignment, which n bf16 rows of an odd H break."""
        a, z = int(handle.recv_prefix_R1[peer]), int(handle.recv_prefix_R1[peer + 1])
        n, H, K = z - a, x_MH.shape[1], 0 if w_MK is None else w_MK.shape[1]
        out = self.fabric.outbox("combine", peer, call, WORDS + 1, n * (H * x_MH.element_size() + 4 * K))
        out.header[:WORDS], out.header[COUNT] = mine, n
        if K:
            out.payload[: 4 * n * K].view(torch.float32).view(n, K).copy_(w_MK[a:z])
        out.payload[4 * n * K :].view(x_MH.dtype).view(n, H).copy_(x_MH[a:z])
        self.fabric.send(out)

    def _reduce(self, call, mine, x_MH, w_MK, handle):
        """(combined [N, H] in x's dtype, summed weights [N, K] or None): every expert rank's rows added
        in float32, ranks ascending, each as soon as the ranks before it are added."""
        N, H, dtype = handle.num_tokens, x_MH.shape[1], x_MH.dtype
        K = 0 if w_MK is None else w_MK.shape[1]
        tokens = handle_tokens(handle)
        acc_NH = torch.zeros(N, H, dtype=torch.float32, device="cpu")
        acc_NK = torch.zeros(N, K, dtype=torch.float32, device="cpu") if K else None
        added = _InOrder(self.R, self.fabric.live, torch.zeros(self.R + 1, dtype=torch.int64, device="cpu"))
        blocks = {}

        def add(src: int, count: int) -> None:
            for ready, _ in added.land(src, count):
                rows_nH, w_nK = blocks.pop(ready)
                self.engine.accumulate_rows(acc_NH, rows_nH, tokens[ready])
                if K:
                    self.engine.accumulate_rows(acc_NK, w_nK, tokens[ready])
                if ready != self.me:
                    self.fabric.release("combine", ready, call)

        a, z = int(handle.recv_prefix_R1[self.me]), int(handle.recv_prefix_R1[self.me + 1])
        blocks[self.me] = (x_MH[a:z], None if w_MK is None else w_MK[a:z])
        add(self.me, z - a)
        lap(call.timers, "receive")  # the own rows
        arrivals = self.fabric.arrivals(
            "combine", call, self._peers(), "combine", other_call_check(call, self.me, mine)
        )
        for msg in timed(arrivals, call.timers):
            peer = msg.peer
            check_message(call, self.me, mine, peer, msg.header, WORDS + 1)
            count, want = int(msg.header[COUNT]), int(handle.send_counts_R[peer])
            row_bytes = H * dtype.itemsize
            if count != want or msg.payload.numel() != count * (row_bytes + 4 * K):
                raise self._bad(call, peer, f"combine: rank {peer} returned {count} rows, expected {want}")
            w_nK = msg.payload[: 4 * count * K].view(torch.float32).view(count, K) if K else None
            rows_nH = msg.payload[4 * count * K :].view(dtype).view(count, H)
            blocks[peer] = (rows_nH, w_nK)
            add(peer, count)
            lap(call.timers, "receive")
        return acc_NH.to(dtype), acc_NK

    # -- failures and membership -------------------------------------------------------------------

    def _bad(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        """Blame `culprit` for a value that failed a check: every peer learns it at once."""
        self.fabric.abort(call, culprit)
        self._aborted = call.seq
        return PeerDataError(message, culprit=culprit)

    def _give_up(self, call: CallId, error: UbepError) -> None:
        """This rank leaves `call` on `error`: tell the peers (passing on the blame), once."""
        self._abort(call, blame_of(error), rejected=False)

    def abort(self, call: CallId) -> None:
        """The Buffer gives up on `call` outside the halves (it rejected this rank's input): tell the
        peers, unless a half already has."""
        self._abort(call, None, rejected=True)

    def _abort(self, call: CallId, culprit: int | None, rejected: bool) -> None:
        if self._aborted != call.seq:
            self._aborted = call.seq
            self.fabric.abort(call, culprit, rejected)

    def mask(self, ranks: Collection[int], seq: int) -> int:
        """Leave `ranks` out of every later call (`Fabric.mask`); low-latency mode shares the fabric."""
        return self.fabric.mask(ranks, seq)

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        return self.fabric.agree_to_mask(error, seq)

    def agree(self, value: int, phase: str) -> dict[int, int]:
        return self.fabric.agree(value, phase)

    def close(self) -> None:
        self.fabric.close()


def handle_tokens(handle: DispatchHandle) -> tuple[torch.Tensor, ...]:
    """Per destination rank, the ascending indices of this rank's tokens that went there."""
    _, token_n = destination_major(handle.is_token_in_rank_NR)
    return torch.split(token_n, handle.send_counts_R.tolist())


class _Outputs:
    """A dispatch's outputs, `rows` long (the most it can receive; returned narrowed to what came)."""

    def __init__(self, x_NX: torch.Tensor, rows: int, K: int, cached: bool):
        self.x_MX = x_NX.new_empty((rows, x_NX.shape[1]))
        self.src_token_M = torch.empty(0 if cached else rows, dtype=torch.int64, device="cpu")
        self.idx_MK = torch.empty(0 if cached else rows, K, dtype=torch.int64, device="cpu")
        self.w_MK = torch.empty(0 if cached else rows, K, dtype=torch.float32, device="cpu")


class _InOrder:
    """Blocks that must be taken in rank order, landing in any order: `land(src, rows)` returns the
    sources whose turn has come, with their row offsets (prefix_R1 [R + 1] is filled as they go;
    masked ranks take no rows)."""

    def __init__(self, R: int, live: tuple[int, ...], prefix_R1: torch.Tensor):
        self.live, self.prefix_R1 = set(live), prefix_R1
        self.rows: dict[int, int] = {}
        self.next, self.R = 0, R

    def land(self, src: int, rows: int) -> list[tuple[int, int]]:
        self.rows[src] = rows
        ready = []
        while self.next < self.R and (self.next not in self.live or self.next in self.rows):
            r = self.next
            self.prefix_R1[r + 1] = self.prefix_R1[r] + self.rows.get(r, 0)
            if r in self.live:
                ready.append((r, int(self.prefix_R1[r])))
            self.next += 1
        return ready

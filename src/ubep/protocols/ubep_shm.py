"""The UBEP protocol on the shared-memory heap: no global barrier, data as flag.

Dispatch, on rank `me` for call epoch e (buffers double-buffered by e % 2):
  1. routing role: write own topk rows, token count and dtype into own segment,
     then stamp META = e. The counts travel with the routing: no count round.
  2. token role: copy own x into own segment once, then stamp DATA = e.
  3. as each peer's META lands: derive from its routing which of its tokens
     come here (vectorised over all sources), their offsets and local expert ids.
  4. as each peer's DATA lands (in any order): gather its rows straight from
     its segment into their final place in recv_x. No source waits for another.

Combine mirrors it with puts: each rank writes the rows it holds for source s
straight into their final place in s's combine buffer (s's rows come back
destination-major, so the block from rank d starts after the rows s sent to
ranks below d, an offset known from s's routing), then stamps its header row
there. s waits for every stamp, in any order, and reduces all rows in one pass
(`ubep.reduce`).

Why get (pull) for dispatch and put (push) for combine: a dispatched token goes
to ~5 ranks on average, and pulling lets each rank write its tokens once and
each receiver write each row once, into its final place (N + M row copies per
rank, against 2M for pushing into staging slots and then reordering). Combine
rows are consumed by a reduction, so a put into the home rank is already minimal.

Why no barrier is needed between calls: a rank starts call e+2 (which reuses
e's half) only after finishing call e+1, which needed every peer's e+1 stamp,
which every peer writes only after finishing call e. See docs/design.md.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ubep import schedule, topology
from ubep.errors import PeerDataError
from ubep.layout import localize_topk, prefix_offsets, token_in_rank
from ubep.protocols.base import (
    CODE_DTYPES,
    DTYPE_CODES,
    CallId,
    Received,
    SendPlan,
    ShmPeers,
    Sizing,
    new_layout,
)
from ubep.protocols.rows import put_back, reduce_back, rows_view
from ubep.results import DispatchHandle
from ubep.shm import SegmentLayout

# Dispatch header words.
META, DATA, NUM_TOKENS, DTYPE, TOPK, HDR_WORDS = 0, 1, 2, 3, 4, 8
# Combine slot header words (one row per expert rank writing into this segment).
SLOT_FLAG, SLOT_DTYPE, SLOT_COUNT = 0, 1, 2


def ubep_layout(s: Sizing) -> SegmentLayout:
    layout = new_layout()
    R, T, K = s.num_ranks, s.capacity, s.max_topk
    for p in (0, 1):
        layout.add(f"d{p}.hdr", (HDR_WORDS,), torch.int64)
        layout.add(f"d{p}.topk", (T * K,), torch.int64)
        layout.add(f"d{p}.w", (T * K,), torch.float32)
        layout.add(f"d{p}.x", (T * s.row_bytes,), torch.uint8)
        layout.add(f"c{p}.hdr", (R, 4), torch.int64)  # one row per expert rank writing here
        layout.add(f"c{p}.x", (R * T * s.row_bytes,), torch.uint8)  # rows back, destination-major
        layout.add(f"c{p}.w", (R * T * K,), torch.float32)
    return layout


class UbepShm:
    """UBEP dispatch/combine among the ranks of one host."""

    name = "ubep"

    def __init__(self, peers: ShmPeers, workers: int = 1, policy: str = "ubep"):
        self.peers = peers
        self.sizing: Sizing = peers.sizing
        self.me = peers.rank
        self.R = peers.num_ranks
        self.workers = workers
        self.policy = policy
        self.topology = topology.host(cores=max(self.R, os.cpu_count() or 1)) if workers > 1 else None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ubep-put") if workers > 1 else None

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        self._publish(call, plan)
        self.peers.faults.at("dispatch.sent", call)
        if handle is None:
            routing = self._gather_routing(call, plan)
        else:
            routing = (None, None, handle.recv_src_token_M, handle.recv_prefix_R1, handle.recv_home_offset_R)
        recv_topk_idx, recv_topk_w, src_token_M, prefix_R1, home_offset_R = routing
        x_NH = plan.x_NH
        recv_x_MH = torch.empty(int(prefix_R1[-1]), x_NH.shape[1], dtype=x_NH.dtype)
        self._gather_rows(call, x_NH, recv_x_MH, src_token_M, prefix_R1)
        return Received(recv_x_MH, recv_topk_idx, recv_topk_w, src_token_M, prefix_R1, home_offset_R)

    def _publish(self, call: CallId, plan: SendPlan) -> None:
        heap, p = self.peers.heap, call.parity
        hdr = heap.words(self.me, f"d{p}.hdr")
        N, H = plan.x_NH.shape
        if plan.topk_idx_NK is not None:
            K = plan.topk_idx_NK.shape[1]
            heap.tensor(self.me, f"d{p}.topk")[: N * K].copy_(plan.topk_idx_NK.flatten())
            heap.tensor(self.me, f"d{p}.w")[: N * K].copy_(plan.topk_weights_NK.flatten())
            hdr[TOPK] = K
        hdr[NUM_TOKENS] = self.peers.faults.count("dispatch.count", call, N)
        hdr[DTYPE] = DTYPE_CODES[plan.x_NH.dtype]
        hdr[META] = call.epoch  # routing and counts are visible from here on
        rows_view(heap.tensor(self.me, f"d{p}.x"), N, H, plan.x_NH.dtype).copy_(plan.x_NH)
        hdr[DATA] = call.epoch  # the payload is visible from here on
        self.peers.ring_all()  # one ring for both stamps: a blocked reader needs both

    def _source_header(self, call: CallId, src: int, x_NH: torch.Tensor) -> tuple[int, int]:
        """A landed source's (token count, top-k), checked against this rank's bounds."""
        hdr = self.peers.heap.words(src, f"d{call.parity}.hdr")
        n, k, code = int(hdr[NUM_TOKENS]), int(hdr[TOPK]), int(hdr[DTYPE])
        if not 0 <= n <= self.sizing.capacity:
            raise self.peers.bad_data(
                call, src, f"dispatch: rank {src} announced {n} tokens, capacity is {self.sizing.capacity}"
            )
        if CODE_DTYPES.get(code) != x_NH.dtype:
            message = f"dispatch: rank {src} sent {CODE_DTYPES.get(code)}, this rank {x_NH.dtype}"
            raise self.peers.bad_data(call, src, message)
        return n, k

    def _gather_routing(self, call: CallId, plan: SendPlan):
        """Wait for every source's routing; derive what comes here, in final order."""
        heap, p, K = self.peers.heap, call.parity, plan.topk_idx_NK.shape[1]
        metas = [heap.words(s, f"d{p}.hdr")[META : META + 1].reshape(()) for s in range(self.R)]
        self.peers.wait_words("dispatch (routing)", call, metas, call.epoch, range(self.R))
        idx_rows, w_rows, counts = [], [], []
        for src in range(self.R):
            n, k = self._source_header(call, src, plan.x_NH)
            if k != K:
                raise PeerDataError(f"dispatch: rank {src} routed with top-k {k}, this rank with {K}")
            idx_rows.append(heap.tensor(src, f"d{p}.topk")[: n * K].view(n, K))
            w_rows.append(heap.tensor(src, f"d{p}.w")[: n * K].view(n, K))
            counts.append(n)
        idx_SK = torch.cat(idx_rows)  # S = all sources' tokens, source-major
        if idx_SK.numel() and (idx_SK.min() < -1 or idx_SK.max() >= self.sizing.placement.num_experts):
            raise PeerDataError("dispatch: a peer's routing holds expert ids out of range")
        local_SK, w_SK = localize_topk(idx_SK, torch.cat(w_rows), self.sizing.placement, self.me)
        here_S = (local_SK >= 0).any(dim=1)
        counts_R = torch.tensor(counts, dtype=torch.int64)
        starts_R = prefix_offsets(counts_R)[:-1]
        src_S = torch.repeat_interleave(torch.arange(self.R), counts_R)
        rows_M = torch.nonzero(here_S).flatten()
        src_token_M = rows_M - starts_R[src_S[rows_M]]
        prefix_R1 = prefix_offsets(torch.bincount(src_S[rows_M], minlength=self.R))
        # Rows each source sent to ranks below this one: where this rank's block goes back.
        to_lower_S = token_in_rank(idx_SK, self.sizing.placement)[:, : self.me].sum(dim=1)
        home_offset_R = torch.bincount(src_S, weights=to_lower_S.double(), minlength=self.R).long()
        return local_SK[rows_M], w_SK[rows_M], src_token_M, prefix_R1, home_offset_R

    def _gather_rows(self, call, x_NH, recv_x_MH, src_token_M, prefix_R1) -> None:
        """Copy each source's rows from its segment as soon as its payload lands."""
        heap, p, H = self.peers.heap, call.parity, x_NH.shape[1]
        hdrs = [heap.words(s, f"d{p}.hdr") for s in range(self.R)]
        prefix = prefix_R1.tolist()
        waiter = self.peers.waiter("dispatch (tokens)", call)
        pending = [(self.me + i) % self.R for i in range(self.R)]  # start with own rows
        while pending:
            landed = [s for s in pending if hdrs[s][DATA] == call.epoch]
            for src in landed:
                a, b = prefix[src], prefix[src + 1]
                if a == b:
                    continue
                n, _ = self._source_header(call, src, x_NH)
                rows = src_token_M[a:b]
                if rows[-1] >= n:  # rows ascend: the last is the largest
                    message = f"dispatch: rank {src} sent {n} tokens, fewer than routed here"
                    raise self.peers.bad_data(call, src, message)
                source_NH = rows_view(heap.tensor(src, f"d{p}.x"), n, H, x_NH.dtype)
                torch.index_select(source_NH, 0, rows, out=recv_x_MH[a:b])
            pending = [s for s in pending if s not in landed]
            if pending and not landed:
                waiter.pause(pending)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        heap, p, H = self.peers.heap, call.parity, x_MH.shape[1]
        prefix, home_offset = handle.recv_prefix_R1.tolist(), handle.recv_home_offset_R.tolist()
        K = None if topk_weights_MK is None else topk_weights_MK.shape[1]

        def put(pieces: list[tuple[int, int, int]]) -> None:
            """Rows [begin, end) of those held for `home` go to their final place there."""
            for home, begin, end in pieces:
                a, b = prefix[home] + begin, prefix[home] + end
                w = None if K is None else topk_weights_MK[a:b]
                put_back(heap, f"c{p}", home, home_offset[home] + begin, x_MH[a:b], w)

        per_worker = self._put_pieces(handle, H * x_MH.element_size())
        if self._pool is None:
            put(per_worker[0])
        else:
            list(self._pool.map(put, per_worker))  # torch's copies release the GIL
        for i in range(self.R):  # every block is in place: stamp each home's header row
            home = (self.me + i) % self.R
            slot = heap.words(home, f"c{p}.hdr")[self.me]
            slot[SLOT_DTYPE] = DTYPE_CODES[x_MH.dtype]
            slot[SLOT_COUNT] = prefix[home + 1] - prefix[home]
            slot[SLOT_FLAG] = call.epoch  # this block is visible from here on
            self.peers.ring(home)
            if i == 1:
                self.peers.faults.at("combine.mid", call)
        return self._reduce(call, x_MH.dtype, H, handle, K)

    def _put_pieces(self, handle: DispatchHandle, row_bytes: int) -> list[list[tuple[int, int, int]]]:
        """Per worker, its (home, begin, end) row slices in order, from the token scheduler.

        One worker puts whole blocks in rotation order (me+1, me+2, ...), which is what
        the scheduler's plan reduces to on one host; with several, `schedule.plan_rank`
        cuts the blocks into equal token slices, slowest first within each worker.
        """
        counts = handle.recv_counts().tolist()
        if self.workers == 1:
            rotation = [(self.me + i) % self.R for i in range(1, self.R + 1)]
            return [[(home, 0, counts[home]) for home in rotation]]
        plan = schedule.plan_rank(
            counts, self.me, self.topology, workers=self.workers, row_bytes=row_bytes, policy=self.policy
        )
        return [[(d, sl.start, sl.stop) for d, sl, _ in plan.pieces(w)] for w in range(self.workers)]

    def _reduce(self, call: CallId, dtype: torch.dtype, H: int, handle: DispatchHandle, K: int | None):
        """Once every expert rank's block has landed, sum each token's rows in float32."""
        heap, p = self.peers.heap, call.parity
        hdr = heap.words(self.me, f"c{p}.hdr")
        flags = [hdr[d, SLOT_FLAG : SLOT_FLAG + 1].reshape(()) for d in range(self.R)]
        self.peers.wait_words("combine", call, flags, call.epoch, range(self.R))
        sent_R = handle.send_counts_R.tolist()
        for src in range(self.R):
            self._check_slot(src, hdr[src], sent_R[src], dtype)
        return reduce_back(heap, self.me, f"c{p}", dtype, H, handle, K)

    @staticmethod
    def _check_slot(src: int, slot, expected: int, dtype: torch.dtype) -> None:
        if int(slot[SLOT_COUNT]) != expected:
            raise PeerDataError(
                f"combine: rank {src} returned {int(slot[SLOT_COUNT])} rows, expected {expected}"
            )
        if CODE_DTYPES.get(int(slot[SLOT_DTYPE])) != dtype:
            sent = CODE_DTYPES.get(int(slot[SLOT_DTYPE]))
            raise PeerDataError(f"combine: rank {src} returned {sent}, this rank holds {dtype}")

    def abort(self, call: CallId) -> None:
        self.peers.abort(call)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.peers.close()

"""The BSP baseline on the shared-memory heap: the same work as UBEP, in phases
separated by global barriers, as vendor EP libraries and Megatron structure it.

Dispatch: layout -> count exchange -> barrier -> token send (push into the
receiver's per-source staging slot) -> barrier -> flag verification -> prefix
sums -> barrier -> reorder (staging slots -> recv_x).
Combine: barrier -> push rows into their place in the home rank's combine
buffer -> barrier -> reduce (the same buffer layout and reduction as UBEP).

It is meant to be an honest baseline: vectorised packing fused into the put,
one copy per row per hop, barriers over shared memory rather than sockets.
What it lacks, by design, is UBEP's overlap: every rank waits at each barrier
for the slowest rank's slowest phase.
"""

from __future__ import annotations

import torch

from ubep.errors import PeerDataError
from ubep.layout import localize_topk, prefix_offsets, tokens_for_rank
from ubep.protocols.base import CallId, Received, SendPlan, ShmPeers, Sizing, new_layout
from ubep.protocols.rows import put_back, reduce_back, rows_view
from ubep.results import DispatchHandle
from ubep.shm import SegmentLayout


def bsp_layout(s: Sizing) -> SegmentLayout:
    layout = new_layout()
    R, T, K = s.num_ranks, s.capacity, s.max_topk
    layout.add("counts", (R,), torch.int64)  # this rank's tokens for each destination
    layout.add("flags", (R,), torch.int64)  # per-source "your slot is written" stamps
    layout.add("d.x", (R, T * s.row_bytes), torch.uint8)  # staging slot per source
    layout.add("d.topk", (R, T * K), torch.int64)
    layout.add("d.w", (R, T * K), torch.float32)
    layout.add("d.src", (R, T), torch.int64)
    layout.add("c.x", (R * T * s.row_bytes,), torch.uint8)  # rows back, destination-major
    layout.add("c.w", (R * T * K,), torch.float32)
    return layout


class BspShm:
    """Barrier-separated dispatch/combine among the ranks of one host."""

    name = "bsp"

    def __init__(self, peers: ShmPeers):
        self.peers = peers
        self.sizing: Sizing = peers.sizing
        self.me = peers.rank
        self.R = peers.num_ranks

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        heap, peers = self.peers.heap, self.peers
        counts_R = peers.faults.count("dispatch.count", call, plan.send_counts_R.numpy())
        heap.words(self.me, "counts")[:] = counts_R
        peers.barrier("dispatch (count exchange)", call)
        self._send_tokens(call, plan)
        peers.faults.at("dispatch.sent", call)
        peers.barrier("dispatch (token send)", call)
        counts_RR = self._verify_and_count(call)
        prefix_R1 = prefix_offsets(counts_RR[:, self.me])
        home_offset_R = counts_RR[:, : self.me].sum(dim=1)  # rows each source sent to lower ranks
        peers.barrier("dispatch (prefix sums)", call)
        return self._reorder(plan, prefix_R1, home_offset_R, cached=handle is not None)

    def _send_tokens(self, call: CallId, plan: SendPlan) -> None:
        heap, H = self.peers.heap, plan.x_NH.shape[1]
        for i in range(self.R):
            dst = (self.me + i) % self.R
            tokens = tokens_for_rank(plan.is_token_in_rank_NR, dst)
            n = tokens.numel()
            torch.index_select(
                plan.x_NH, 0, tokens, out=rows_view(heap.tensor(dst, "d.x")[self.me], n, H, plan.x_NH.dtype)
            )
            heap.tensor(dst, "d.src")[self.me][:n].copy_(tokens)
            if plan.topk_idx_NK is not None:
                K = plan.topk_idx_NK.shape[1]
                local, w = localize_topk(
                    plan.topk_idx_NK[tokens], plan.topk_weights_NK[tokens], self.sizing.placement, dst
                )
                heap.tensor(dst, "d.topk")[self.me][: n * K].copy_(local.flatten())
                heap.tensor(dst, "d.w")[self.me][: n * K].copy_(w.flatten())
            heap.words(dst, "flags")[self.me] = call.epoch

    def _verify_and_count(self, call: CallId) -> torch.Tensor:
        """The count matrix [R, R] (row s: what source s sends to each rank), checked."""
        heap = self.peers.heap
        flags = heap.words(self.me, "flags")
        missing = [s for s in range(self.R) if flags[s] != call.epoch]
        if missing:
            raise PeerDataError(f"dispatch (flag verification): no tokens from rank(s) {missing}")
        counts_RR = torch.stack([torch.from_numpy(heap.words(s, "counts").copy()) for s in range(self.R)])
        bad_RR = (counts_RR < 0) | (counts_RR > self.sizing.capacity)
        if bad_RR.any():
            src, dst = (int(i) for i in torch.nonzero(bad_RR)[0])
            count, capacity = int(counts_RR[src, dst]), self.sizing.capacity
            message = f"dispatch: rank {src} announced {count} tokens, capacity is {capacity}"
            raise self.peers.bad_data(call, src, message)
        return counts_RR

    def _reorder(self, plan: SendPlan, prefix_R1, home_offset_R, cached: bool) -> Received:
        heap, H = self.peers.heap, plan.x_NH.shape[1]
        M = int(prefix_R1[-1])
        K = None if cached else plan.topk_idx_NK.shape[1]
        recv_x = torch.empty(M, H, dtype=plan.x_NH.dtype)
        recv_idx = None if cached else torch.empty(M, K, dtype=torch.int64)
        recv_w = None if cached else torch.empty(M, K, dtype=torch.float32)
        src_token = torch.empty(M, dtype=torch.int64)
        for src in range(self.R):
            a, b = int(prefix_R1[src]), int(prefix_R1[src + 1])
            recv_x[a:b] = rows_view(heap.tensor(self.me, "d.x")[src], b - a, H, plan.x_NH.dtype)
            src_token[a:b] = heap.tensor(self.me, "d.src")[src][: b - a]
            if not cached:
                recv_idx[a:b] = heap.tensor(self.me, "d.topk")[src][: (b - a) * K].view(-1, K)
                recv_w[a:b] = heap.tensor(self.me, "d.w")[src][: (b - a) * K].view(-1, K)
        self._check_received(src_token, recv_idx)
        return Received(recv_x, recv_idx, recv_w, src_token, prefix_R1, home_offset_R)

    def _check_received(self, src_token_M: torch.Tensor, recv_idx_MK: torch.Tensor | None) -> None:
        """Token indices and local expert ids written by peers must be in range before use."""
        T, L = self.sizing.capacity, self.sizing.placement.num_local_experts
        if src_token_M.numel() and (src_token_M.min() < 0 or src_token_M.max() >= T):
            raise PeerDataError(f"dispatch: a peer sent source token indices outside [0, {T})")
        if recv_idx_MK is not None and recv_idx_MK.numel():
            if recv_idx_MK.min() < -1 or recv_idx_MK.max() >= L:
                raise PeerDataError(f"dispatch: a peer sent local expert ids outside [-1, {L})")

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        prefix, home_offset = handle.recv_prefix_R1.tolist(), handle.recv_home_offset_R.tolist()
        K = None if topk_weights_MK is None else topk_weights_MK.shape[1]
        self.peers.barrier("combine (start)", call)
        for i in range(self.R):
            home = (self.me + i) % self.R
            a, b = prefix[home], prefix[home + 1]
            w = None if K is None else topk_weights_MK[a:b]
            put_back(self.peers.heap, "c", home, home_offset[home], x_MH[a:b], w)
            if i == 1:
                self.peers.faults.at("combine.mid", call)
        self.peers.barrier("combine (token send)", call)
        return reduce_back(self.peers.heap, self.me, "c", x_MH.dtype, x_MH.shape[1], handle, K)

    def abort(self, call: CallId) -> None:
        self.peers.abort(call)

    def close(self) -> None:
        self.peers.close()

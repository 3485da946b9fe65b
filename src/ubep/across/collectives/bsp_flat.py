"""The collective transport: the Megatron-style pipeline over torch.distributed.

Dispatch: call header with the counts -> permute (tokens sorted by destination)
-> `all_to_all_single` of rows, then of routing metadata. Combine: call header,
then the row all-to-all backwards, and the reduction. This is the path for
traffic that leaves a host (gloo on CPU, NCCL on GPU) and the textbook
baseline. Payloads travel as bytes so every dtype works on every backend.

The call header (`ubep.across.call_header`) is a collective of one size
whatever the call: ranks whose calls differ (kind, dtype, top-k, the dispatch
a handle names) raise on every rank before any variable-size collective, and a
rank that rejects its input (dispatch or combine) joins it as REJECTED so its
peers fail at once. Either way the group stays in step. Every collective runs
under the Buffer's deadline (`ubep.deadlines`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ubep.across.call_header import NONE, CallHeader, CallHeaders
from ubep.deadlines import PeerPids, collective_deadline, construction_s
from ubep.errors import PeerDataError
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.layout import destination_major, localize_for_destinations, prefix_offsets
from ubep.protocols.base import DTYPE_CODES, CallId, Exchange, Received, SendPlan, Sizing
from ubep.registry import BSP
from ubep.results import DispatchHandle, RecvRoute


def _as_bytes(t_nX: torch.Tensor) -> torch.Tensor:
    """[n, X] of any dtype -> uint8 [n, X * itemsize] sharing storage (n may be 0)."""
    row_bytes = math.prod(t_nX.shape[1:]) * t_nX.element_size()
    return t_nX.contiguous().view(torch.uint8).view(t_nX.shape[0], row_bytes)


class BspDist(Exchange):
    """Dispatch/combine as all-to-all collectives on a process group."""

    name = BSP.name
    across_hosts = "torch.distributed all-to-all collectives: the bulk-synchronous baseline"

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        sizing: Sizing,
        timeout_s: float = 30.0,
        faults: FaultPoints = NO_FAULTS,
    ):
        self.group = group
        self.me = rank
        self.R = sizing.num_ranks
        self.sizing = sizing
        self.timeout_s = timeout_s
        self.faults = faults
        with collective_deadline(group, construction_s(timeout_s), "Buffer construction (pid exchange)"):
            self._pids = PeerPids.gather(group, rank, self.R)
        # deadline(phase): a partial, not a bound method, so no reference cycle keeps the group alive
        # after close (a gloo group freed in the interpreter's teardown can abort the process)
        self._deadline = functools.partial(collective_deadline, group, timeout_s, peers=self._pids)
        self.headers = CallHeaders(group, self.R, sizing.placement.num_local_experts, self._deadline)

    def _all_to_all(
        self, phase: str, send_nX: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        recv = send_nX.new_empty((sum(recv_counts), *send_nX.shape[1:]))
        with self._deadline(phase):
            dist.all_to_all_single(recv, send_nX, recv_counts, send_counts, group=self.group)
        return recv

    def _exchange_counts(
        self, call: CallId, plan: SendPlan, handle: DispatchHandle | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows sent to, rows received from) each rank, int64 [R]: the counts travel in the call
        header, and are checked before any buffer is sized by them."""
        counts = self.faults.count("dispatch.count", call, plan.send_counts_R.to(torch.int64))
        send_counts_R = (
            torch.as_tensor(counts, dtype=torch.int64, device=plan.send_counts_R.device)
            .expand(self.R)
            .contiguous()
        )
        header = CallHeader.of(
            call,
            handle=NONE if handle is None else handle.seq,
            dtype=DTYPE_CODES[plan.x_NH.dtype],
            topk=NONE if plan.topk_idx_NK is None else plan.topk_idx_NK.shape[1],
        )
        recv_counts_R = self.headers.exchange(call, header, send_counts_R.unsqueeze(1))[:, 0].contiguous()
        for src, count in enumerate(recv_counts_R.tolist()):
            if not 0 <= count <= self.sizing.capacity:
                raise PeerDataError(
                    f"dispatch: rank {src} announced {count} tokens, capacity is {self.sizing.capacity}"
                )
        return send_counts_R, recv_counts_R

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        send_counts_R, recv_counts_R = self._exchange_counts(call, plan, handle)
        send, recv = send_counts_R.tolist(), recv_counts_R.tolist()
        dest_R, tokens = destination_major(plan.is_token_in_rank_NR)
        x_NX = plan.packed_rows()
        x_bytes = self._all_to_all("dispatch (tokens)", _as_bytes(x_NX[tokens]), send, recv)
        self.faults.at("dispatch.sent", call)
        recv_x = x_bytes.view(x_NX.dtype).view(-1, x_NX.shape[1])
        meta = [tokens.unsqueeze(1)]
        if plan.topk_idx_NK is not None:
            local, w = localize_for_destinations(
                plan.topk_idx_NK[tokens], plan.topk_weights_NK[tokens], dest_R, self.sizing.placement
            )
            meta += [local, w.view(torch.int32).to(torch.int64)]
        meta_recv = self._all_to_all("dispatch (routing)", torch.cat(meta, dim=1), send, recv)
        recv_idx = recv_w = None
        if plan.topk_idx_NK is not None:
            K = plan.topk_idx_NK.shape[1]
            recv_idx = meta_recv[:, 1 : 1 + K].contiguous()
            recv_w = meta_recv[:, 1 + K :].to(torch.int32).view(torch.float32).contiguous()
        route = RecvRoute.of(meta_recv[:, 0].contiguous(), prefix_offsets(recv_counts_R))
        return Received.unpacking(plan, recv_x, recv_idx, recv_w, route)

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        recv = handle.recv_counts().tolist()
        send = handle.send_counts_R.tolist()
        K = NONE if topk_weights_MK is None else topk_weights_MK.shape[1]
        header = CallHeader.of(call, handle=handle.seq, dtype=DTYPE_CODES[x_MH.dtype], topk=K)
        self.headers.exchange(call, header)
        back = self._all_to_all("combine (tokens)", _as_bytes(x_MH), recv, send)
        back = back.view(x_MH.dtype).view(-1, x_MH.shape[1])
        _, tokens = destination_major(handle.is_token_in_rank_NR)
        out_NH = torch.zeros(handle.num_tokens, x_MH.shape[1], dtype=torch.float32, device=x_MH.device)
        out_NH.index_add_(0, tokens, back.float())  # rows arrive rank-ascending: sums stay in order
        out_w = None
        if topk_weights_MK is not None:
            w_back = self._all_to_all("combine (weights)", topk_weights_MK.contiguous(), recv, send)
            out_w = torch.zeros(
                handle.num_tokens,
                topk_weights_MK.shape[1],
                dtype=torch.float32,
                device=topk_weights_MK.device,
            )
            out_w.index_add_(0, tokens, w_back)
        return out_NH.to(x_MH.dtype), out_w

    def abort(self, call: CallId) -> None:
        """Join the call's header exchange as REJECTED (once), so the peers fail at once."""
        self.headers.abort(call)

    def close(self) -> None:
        pass

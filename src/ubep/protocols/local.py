"""The one-rank path: the reference semantics applied to a group of one."""

from __future__ import annotations

import torch

from ubep import reference
from ubep.protocols.base import CallId, Exchange, Received, SendPlan, Sizing
from ubep.registry import LOCAL
from ubep.results import DispatchHandle, RecvRoute


class LocalExchange(Exchange):
    """Dispatch to and combine from this rank alone; no transport involved."""

    name = LOCAL.name

    def __init__(self, sizing: Sizing):
        self.sizing = sizing

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        x_NX = plan.packed_rows()
        if handle is not None:
            return Received.unpacking(plan, x_NX[handle.recv_src_token_M], None, None, handle.recv)
        placement = self.sizing.placement
        got = reference.dispatch(
            [x_NX],
            [plan.topk_idx_NK],
            [plan.topk_weights_NK],
            placement.num_experts,
            rank_of_expert=placement.rank_of_expert_E,
        )[0]
        prefix = torch.tensor([0, got.src_token_M.numel()], dtype=torch.int64, device=got.src_token_M.device)
        route = RecvRoute.of(got.src_token_M, prefix)
        return Received.unpacking(plan, got.recv_x_MH, got.recv_topk_idx_MK, got.recv_topk_weights_MK, route)

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        tokens = handle.recv_src_token_M
        out = torch.zeros(handle.num_tokens, x_MH.shape[1], dtype=torch.float32, device=x_MH.device)
        out.index_add_(0, tokens, x_MH.float())
        out_w = None
        if topk_weights_MK is not None:
            out_w = torch.zeros(
                handle.num_tokens,
                topk_weights_MK.shape[1],
                dtype=torch.float32,
                device=topk_weights_MK.device,
            )
            out_w.index_add_(0, tokens, topk_weights_MK)
        return out.to(x_MH.dtype), out_w

    def abort(self, call: CallId) -> None:
        pass

    def close(self) -> None:
        pass

"""vLLM's all-to-all manager calls mapped onto one ubep.Buffer, in plain torch (no vLLM import).

vLLM's naive data-parallel prepare/finalize calls its manager as

    dispatch(hidden_NH, topk_weights_NK, topk_ids_NK) -> (x_MH, weights_MK, ids_MK)   # global ids
    ... experts: y_MH = sum over the row's local experts of weight * expert(x) ...
    combine(y_MH) -> out_NH                                                          # partial sum

where the all-gather manager it replaces returns every rank's tokens (M = all of them).
Here the dispatch sends each token only to the ranks of the group owning one of its experts
(`Buffer.dispatch`), and the combine sends the rows home and sums them (`Buffer.combine`).
vLLM's experts have applied the routing weights already, so the combine is a plain sum.

The group may hold only some of vLLM's EP ranks (TP > 1: the data-parallel group of one TP
rank); the experts other TP ranks own are then -1 in the group's routing, and vLLM's TP
all-reduce after the MoE layer adds their part, exactly as after its own reduce-scatter.

Legend: see `ubep.layout` (N tokens, H hidden, K top-k, M rows received, E experts in
vLLM's numbering, R ranks of the group, L local experts); B: experts the group owns.
"""

from __future__ import annotations

import collections
import functools
import inspect
from dataclasses import dataclass

import torch

from ubep.buffer import Buffer


@dataclass(frozen=True, slots=True)
class GroupExperts:
    """Which rank of the ubep group owns each of vLLM's (global, physical) experts.

    The Buffer numbers the group's experts 0..B-1 in ascending global id, so a rank's
    local experts (ubep's index among its owner's) are its global ids in ascending order.
    """

    buffer_id_E: torch.Tensor  # int64 [E]: the expert's id in the Buffer, -1 when no group rank owns it
    owner_B: torch.Tensor  # int64 [B]: the group rank owning each Buffer expert
    global_id_of_local_L: torch.Tensor  # int64 [L]: this rank's experts, global ids ascending

    @property
    def num_buffer_experts(self) -> int:
        return self.owner_B.numel()

    @classmethod
    def from_expert_maps(cls, expert_map_RE: torch.Tensor, rank: int) -> GroupExperts:
        """From every group rank's vLLM expert map (global id -> local slot, -1 elsewhere)."""
        if expert_map_RE.dim() != 2 or not 0 <= rank < expert_map_RE.shape[0]:
            raise ValueError(
                f"expert maps must be [R, E] with rank {rank} among R, got {expert_map_RE.shape}"
            )
        owned_RE = expert_map_RE >= 0
        owners_E = owned_RE.sum(dim=0)
        if (owners_E > 1).any():
            shared = torch.nonzero(owners_E > 1).flatten()[:8].tolist()
            raise ValueError(
                f"experts {shared} have a local slot on more than one rank of the group: ubep needs one "
                "owner per expert (vLLM's redundant experts sit in their own physical slots)"
            )
        per_rank_R = owned_RE.sum(dim=1)
        if (per_rank_R != per_rank_R[0]).any():
            raise ValueError(
                f"the group's ranks own {per_rank_R.tolist()} experts: ubep needs the same number on every "
                "rank; choose an EP size that divides the expert count"
            )
        if int(per_rank_R[0]) == 0:
            raise ValueError("no rank of the group owns an expert")
        globals_B = torch.nonzero(owners_E == 1).flatten()
        buffer_id_E = torch.full((expert_map_RE.shape[1],), -1, dtype=torch.int64, device=globals_B.device)
        buffer_id_E[globals_B] = torch.arange(globals_B.numel(), dtype=torch.int64, device=globals_B.device)
        owner_B = owned_RE[:, globals_B].to(torch.int64).argmax(dim=0)
        return cls(buffer_id_E, owner_B, torch.nonzero(owned_RE[rank]).flatten())


class EPExchange:
    """Dispatch and combine of one vLLM EP group through one ubep.Buffer.

    vLLM's `combine(y)` takes no handle, so each dispatch's handle waits here until the
    combine that follows it (first in, first out: a deferred finalize keeps the order).
    """

    def __init__(self, buffer: Buffer, experts: GroupExperts):
        if buffer.num_experts != experts.num_buffer_experts:
            raise ValueError(
                f"the Buffer has {buffer.num_experts} experts, the group owns {experts.num_buffer_experts}"
            )
        self.buffer, self.experts = buffer, experts
        self._pending: collections.deque = collections.deque()  # handles of dispatches not yet combined

    def dispatch(
        self, x_NH: torch.Tensor, topk_weights_NK: torch.Tensor, topk_ids_NK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows: (x_MH, weights_MK, global ids_MK); -1 and weight 0 for other ranks' experts."""
        valid_NK = topk_ids_NK >= 0
        ids_NK = torch.where(valid_NK, self.experts.buffer_id_E[topk_ids_NK.long().clamp(min=0)], -1)
        got = self.buffer.dispatch(x_NH, topk_idx=ids_NK, topk_weights=topk_weights_NK.float())
        self._pending.append(got.handle)
        local_MK = got.recv_topk_idx
        global_MK = torch.where(local_MK >= 0, self.experts.global_id_of_local_L[local_MK.clamp(min=0)], -1)
        return got.recv_x, got.recv_topk_weights.to(topk_weights_NK.dtype), global_MK.to(topk_ids_NK.dtype)

    def combine(self, y_MH: torch.Tensor) -> torch.Tensor:
        """out_NH: per token, the sum of its rows' expert outputs (float32 sum, y's dtype)."""
        if not self._pending:
            raise RuntimeError("combine without a dispatch before it: vLLM called its manager out of order")
        handle = self._pending.popleft()
        return self.buffer.combine(y_MH.contiguous(), handle).combined_x

    def close(self) -> None:
        self._pending.clear()
        self.buffer.close()


def localize_for_kernel(
    topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor, expert_map_E: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert-map fix for vLLM's CPU experts: global ids -> local slots, before the kernel.

    vLLM's `CPUUnquantizedExperts.apply` hands global ids to a kernel that indexes its local
    weights with them unchecked. Here each id becomes its local slot (`expert_map_E[id]`);
    an expert of another rank (map -1, or id -1) becomes slot 0 with weight 0, so the kernel
    reads valid weights and adds nothing for it. Without a map (no EP) nothing changes.
    """
    if expert_map_E is None:
        return topk_ids_NK, topk_weights_NK
    valid_NK = topk_ids_NK >= 0
    local_NK = torch.where(valid_NK, expert_map_E[topk_ids_NK.long().clamp(min=0)].long(), -1)
    foreign_NK = local_NK < 0
    return (
        local_NK.masked_fill(foreign_NK, 0).to(topk_ids_NK.dtype),
        topk_weights_NK.masked_fill(foreign_NK, 0.0),
    )


FIXED = "_ubep_expert_map_fix"  # marks an apply already wrapped


def with_expert_map(apply):
    """`apply` with its topk ids made local through its `expert_map` first; `apply` itself if it
    is already so (vLLM may load plugins twice, and a communicator per group applies it)."""
    if getattr(apply, FIXED, False):
        return apply
    signature = inspect.signature(apply)

    @functools.wraps(apply)
    def fixed(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        ids, given["topk_weights"] = localize_for_kernel(
            given["topk_ids"], given["topk_weights"], given["expert_map"]
        )
        # the CPU kernel takes int32 ids; vLLM's DeepEP high-throughput path hands DeepEP's int64
        given["topk_ids"] = ids.to(torch.int32)
        return apply(*bound.args, **bound.kwargs)

    setattr(fixed, FIXED, True)
    return fixed

"""DeepEP's Python API on top of ubep: change `import deep_ep` to `from ubep.compat import deep_ep`.

DeepEP sizes its Buffer in bytes (`num_nvl_bytes`, `num_rdma_bytes`) and learns
shapes at each call; ubep sizes by shape. This layer keeps one ubep.Buffer per
shape it meets, built collectively at the first call with that shape (every
rank makes the same calls, so every rank builds it at the same moment):
  - normal mode, per (hidden, num_experts): max_tokens_per_rank is the most
    tokens whose shared segment fits in max(num_nvl_bytes, num_rdma_bytes);
    `Config.get_nvl_buffer_size_hint` asks for HINT_TOKENS tokens per rank.
  - low-latency mode, per (hidden, num_experts, T): max_tokens_per_rank is T;
    the call checks that `get_low_latency_rdma_size_hint(T, ...)` fits in num_rdma_bytes.
GPU tuning knobs (SM counts, QPs, NVLink/fabric switches, chunk sizes in
Config) are accepted and do not change anything here; see docs/low_latency.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ubep import layout as ep_layout
from ubep import validate
from ubep.buffer import Buffer as UbepBuffer
from ubep.factory import heap_bytes
from ubep.group import join_group
from ubep.overlap import EventOverlap
from ubep.protocols.base import Sizing
from ubep.results import DispatchHandle, LowLatencyHandle

HINT_TOKENS = 4096  # tokens per rank a normal-mode size hint provides for (DeepEP's prefill size)
MAX_TOPK = 16

__all__ = ["Buffer", "Config", "EventOverlap"]


def _segment_bytes(hidden: int, num_ranks: int, num_experts: int, tokens: int, low_latency: bool) -> int:
    """Bytes of one rank's shared segment for a ubep.Buffer of these shapes."""
    placement = ep_layout.ExpertPlacement.contiguous(num_experts, num_ranks)
    sizing = Sizing(hidden=hidden, capacity=tokens, max_topk=MAX_TOPK, placement=placement)
    return heap_bytes(sizing, "ubep", low_latency)


def _tokens_that_fit(num_bytes: int, hidden: int, num_ranks: int) -> int:
    """The most tokens per rank whose normal-mode segment fits in num_bytes (0 if none)."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _segment_bytes(hidden, num_ranks, num_ranks, mid, low_latency=False) <= num_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Config:
    """DeepEP's performance config: the fields are GPU kernel tuning and are not used on this transport."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes for HINT_TOKENS tokens per rank of `hidden_bytes` (bf16: hidden * 2)."""
        return _segment_bytes(max(1, hidden_bytes // 2), num_ranks, num_ranks, HINT_TOKENS, low_latency=False)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Between hosts ubep uses torch.distributed, which needs no registered buffer."""
        return 0


class Buffer:
    """DeepEP's `deep_ep.Buffer`, byte-sized; every rank of `group` constructs it."""

    num_sms: int = 20  # DeepEP's class-wide SM budget; only feeds the default Config here

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ):
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self._info = join_group(group)
        self.group = self._info.group
        self.rank = self._info.rank
        self.group_size = self._info.world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self._buffers: dict[tuple, UbepBuffer] = {}  # lives as long as this Buffer, keyed by shape

    # -- sizing and configs -----------------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM budget for normal kernels (must be even); recorded, unused on CPU."""
        if (
            isinstance(new_num_sms, bool)
            or not isinstance(new_num_sms, int)
            or new_num_sms < 2
            or new_num_sms % 2
        ):
            raise ValueError(f"new_num_sms must be an even int >= 2, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Exact bytes of one rank's segment for low-latency calls of these shapes."""
        return _segment_bytes(hidden, num_ranks, num_experts, num_max_dispatch_tokens_per_rank, True)

    @staticmethod
    def capture() -> EventOverlap:
        """An already-complete event (CPU work is ordered by the program)."""
        return EventOverlap()

    def _normal(self, hidden: int, num_experts: int) -> UbepBuffer:
        key = ("normal", hidden, num_experts)
        if key not in self._buffers:
            budget = max(self.num_nvl_bytes, self.num_rdma_bytes)
            tokens = _tokens_that_fit(budget, hidden, self.group_size)
            if tokens < 1:
                raise ValueError(
                    f"num_nvl_bytes={self.num_nvl_bytes} holds no token of hidden size {hidden}; "
                    "size it with Config.get_nvl_buffer_size_hint"
                )
            self._buffers[key] = UbepBuffer(
                self.group,
                hidden=hidden,
                num_experts=num_experts,
                max_tokens_per_rank=tokens,
                low_latency=False,
            )
        return self._buffers[key]

    def _low_latency(self, hidden: int, num_experts: int, max_tokens: int) -> UbepBuffer:
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer built with low_latency_mode=True")
        key = ("ll", hidden, num_experts, max_tokens)
        if key not in self._buffers:
            need = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size, num_experts)
            if need > self.num_rdma_bytes:
                raise ValueError(
                    f"num_rdma_bytes={self.num_rdma_bytes} is too small for T={max_tokens}, hidden={hidden}, "
                    f"{num_experts} experts: get_low_latency_rdma_size_hint gives {need}"
                )
            self._buffers[key] = UbepBuffer(
                self.group, hidden=hidden, num_experts=num_experts, max_tokens_per_rank=max_tokens
            )
        return self._buffers[key]

    # -- normal mode ------------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event)."""
        placement = ep_layout.ExpertPlacement.contiguous(num_experts, self.group_size)
        idx = _validated_topk(topk_idx, num_experts)
        got = ep_layout.dispatch_layout(idx, placement)
        per_node = None
        if self._info.num_nodes > 1:
            node_R = torch.tensor(self._info.node_of_rank)
            nodes = range(self._info.num_nodes)
            hits = [got.is_token_in_rank_NR[:, node_R == n].any(dim=1) for n in nodes]
            per_node = torch.stack(hits, dim=1).sum(dim=0, dtype=torch.int32)
        return (
            got.num_tokens_per_rank_R,
            per_node,
            got.num_tokens_per_expert_E,
            got.is_token_in_rank_NR,
            EventOverlap(),
        )

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """DeepEP's dispatch; the number of experts comes from num_tokens_per_expert or the handle."""
        hidden = (x[0] if isinstance(x, tuple) else x).shape[1]
        if handle is not None:
            num_experts = len(handle.num_recv_tokens_per_expert_list) * self.group_size
        elif num_tokens_per_expert is not None:
            num_experts = num_tokens_per_expert.numel()
        else:
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) or a handle")
        return self._normal(hidden, num_experts).dispatch(
            x,
            handle,
            num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """DeepEP's combine: (combined_x, combined_topk_weights, event), plain sums."""
        if bias is not None:
            raise ValueError("bias is not supported by ubep's combine; add it to x before combining")
        num_experts = len(handle.num_recv_tokens_per_expert_list) * self.group_size
        return self._normal(x.shape[1], num_experts).combine(x, handle, topk_weights)

    # -- low-latency mode -------------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """Nothing to clean: ubep's flags carry call epochs, so stale slots are never mistaken for new."""

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """(recv_x, recv_count, handle, event, hook); FP8 by default, as in DeepEP."""
        _unsupported(round_scale=round_scale, use_ue8m0=use_ue8m0)
        inner = self._low_latency(x.shape[1], num_experts, num_max_dispatch_tokens_per_rank)
        got = inner.low_latency_dispatch(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8,
            async_finish,
            return_recv_hook,
        )
        stats = cumulative_local_expert_recv_stats
        if stats is None:
            return got
        if not (async_finish or return_recv_hook):
            stats.add_(got.recv_count.to(stats.dtype))
            return got

        def receive_then_count() -> None:
            got.hook()
            got.event.wait()
            stats.add_(got.recv_count.to(stats.dtype))

        both = EventOverlap(receive_then_count)
        return got._replace(event=both if async_finish else got.event, hook=both.wait)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """(combined_x, event, hook): the weighted sum of each token's expert outputs."""
        _unsupported(use_logfmt=use_logfmt)
        inner = self._ll_for(handle)
        return inner.low_latency_combine(
            x, topk_idx, topk_weights, handle, async_finish, return_recv_hook, out
        )

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A bf16 [L, R * T, H] tensor to fill; pass it to low_latency_combine (zero_copy is a no-op here)."""
        self._ll_for(handle)
        L, M = handle.num_local_experts, self.group_size * handle.num_max_dispatch_tokens_per_rank
        return torch.empty(L, M, handle.hidden, dtype=torch.bfloat16)

    def _ll_for(self, handle: LowLatencyHandle) -> UbepBuffer:
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must come from low_latency_dispatch, got {type(handle).__name__}")
        return self._low_latency(handle.hidden, handle.num_experts, handle.num_max_dispatch_tokens_per_rank)

    # -- lifetime ---------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release every shared resource (DeepEP's explicit destruction)."""
        buffers, self._buffers = self._buffers, {}
        for inner in buffers.values():
            inner.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def _validated_topk(topk_idx, num_experts: int) -> torch.Tensor:
    rows = topk_idx.shape[0] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() else 0
    return validate.topk_idx(topk_idx, rows, num_experts, MAX_TOPK)


def _unsupported(**flags: bool) -> None:
    """Options DeepEP offers that ubep does not implement: refuse them by name rather than ignore them."""
    for name, value in flags.items():
        if value:
            raise ValueError(f"{name}=True is not supported by ubep (FP8 scales are float32 amax / 448)")

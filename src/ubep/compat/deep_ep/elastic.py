"""DeepEP V2's `deep_ep.ElasticBuffer` on top of ubep's public `ubep.Buffer`.

    dispatch(x, topk_idx)  -> ubep.Buffer.dispatch (rows by source rank, then source token:
                              DeepEP's deterministic order, always) -> DeepEP's layouts
                              (normal, or expanded per local expert), handle `EPHandle`
    combine(x, handle)     -> the rows go home through a second ubep.Buffer (`elastic_combine`)
                              and are summed there in DeepEP V2's order and roundings

Buffers: one ubep.Buffer per (hidden, experts, T, K) for dispatch and one per (hidden, T, K)
for the trip home, built collectively at the first call that needs them (every rank makes
the same calls). Every dispatch also gathers each rank's per-rank token counts (DeepEP's
notify step), which fixes where every row sits on every rank.

The logical domain is DeepEP's: with allow_hybrid_mode, scale-out = ubep's nodes (hosts, or
torchrun's node groups) and scale-up = the ranks of one node; without it, 1 x R.
GPU-only arguments (SM and QP counts, the service level, streams and events, TMA layouts
beyond the scale strides) are accepted and recorded; docs/frameworks.md lists them.

Legend: see `elastic_handle`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ubep import validate
from ubep.buffer import Buffer as UbepBuffer
from ubep.compat.deep_ep import elastic_combine as trip
from ubep.compat.deep_ep.buffer import _segment_bytes
from ubep.compat.deep_ep.elastic_handle import (
    ElasticRoute,
    EPHandle,
    align,
    expanded_slots,
    lanes_per_rank,
    stream_counts,
)
from ubep.compat.deep_ep.header_gather import CallHeaders, opens
from ubep.compat.deep_ep.members import NO_REJOIN, Members
from ubep.compat.deep_ep.utils.envs import domain_of
from ubep.compat.deep_ep.utils.event import EventHandle, EventOverlap
from ubep.group import join_group
from ubep.membership import ON_PEER_FAILURE, RAISE
from ubep.transport.virtual import VirtualRank

MAX_TOPK = 32  # DeepEP V2's kernels take at most 32 lanes; it sizes num_topk=0 for 32
BUFFER_ALIGNMENT = 2 << 20  # DeepEP's 2 MB buffer granularity
ENTRY_ALIGNMENT = 32  # DeepEP aligns Engram entries, PP tensors and AGRS tensors to 32 bytes (LDG.256)
CPU_NUM_SMS = 20  # what get_theoretical_num_sms answers: no SMs here, a value handles can carry
SF_PACKS_PER_TMA_ROW = 4  # DeepEP aligns column-major scale columns to 16 bytes of 4-byte packs
QPS_DIRECT, QPS_HYBRID = 17, 65  # DeepEP's default QP allocations (recorded, never used)


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer: dispatch and combine with DeepEP V2's layouts and reductions."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        on_peer_failure: str = RAISE,
    ):
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden)):
            validate.positive(name, value, minimum=0)
        _topk(num_topk)
        if num_bytes is not None:
            validate.positive("num_bytes", num_bytes, minimum=0)
        validate.seconds("num_cpu_timeout_secs", num_cpu_timeout_secs)
        if on_peer_failure not in ON_PEER_FAILURE:
            raise ValueError(f"on_peer_failure must be one of {ON_PEER_FAILURE}, got {on_peer_failure!r}")
        self.on_peer_failure = on_peer_failure
        self._info = join_group(group)  # collective: every rank constructs the buffer
        self._buffers: dict[tuple, UbepBuffer] = {}
        # who takes part (`mask_ranks`), and the collectives among them, under num_cpu_timeout_secs
        self._members = Members(self._info, float(num_cpu_timeout_secs), self._buffers, on_peer_failure)
        self._headers = CallHeaders(self._members, "ElasticBuffer")  # every call opens with one
        self.group = group if group is not None else self._info.group
        self.rank_idx, self.num_ranks = self._info.rank, self._info.world_size
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)  # ubep's order is DeepEP's deterministic one anyway
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden, self.num_topk, self.use_fp8_dispatch = hidden, num_topk, bool(use_fp8_dispatch)
        self.explicit_num_bytes = num_bytes is not None
        self.num_bytes = (
            num_bytes
            if num_bytes is not None
            else self.get_buffer_size_hint(
                self.group, max(num_max_tokens_per_rank, 1), max(hidden, 1), num_topk
            )
        )
        # Recorded GPU settings: they choose kernels, queues and service levels on a GPU.
        self.num_cpu_bytes, self.sl_idx = num_cpu_bytes, sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.num_allocated_qps = num_allocated_qps or (QPS_HYBRID if allow_hybrid_mode else QPS_DIRECT)
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_rdma_ranks, self.num_nvlink_ranks = domain_of(self._info.node_of_rank)
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self._alive = True
        if not self.explicitly_destroy:  # DeepEP: the destructor releases the resources
            weakref.finalize(self, _close_all, self._buffers, self._members)

    # -- domains, sizing, lifetime ----------------------------------------------------------------

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(nodes, ranks per node): DeepEP's (RDMA ranks, NVLink ranks)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks): the nodes and their ranks in hybrid mode, else (1, R)."""
        if self.allow_hybrid_mode:
            return self.num_rdma_ranks, self.num_nvlink_ranks
        return 1, self.num_ranks

    @staticmethod
    def get_buffer_size_hint(
        group,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes of one rank's shared segments (dispatch and the trip home), 2 MB aligned; num_topk 0
        sizes for DeepEP V2's largest top-k."""
        validate.positive("num_max_tokens_per_rank", num_max_tokens_per_rank)
        validate.positive("hidden", hidden)
        _topk(num_topk)
        R = _group_size(group)
        K = num_topk or MAX_TOPK
        T = num_max_tokens_per_rank
        one = _segment_bytes(hidden, R, R, T, low_latency=False)
        home = _segment_bytes(hidden, R, R * K, T, low_latency=False)
        return align(one + home, BUFFER_ALIGNMENT)

    # DeepEP's sizes for its Engram, PP and AGRS buffers: the same figures, for code that sizes
    # before it builds; those features themselves raise NotImplementedError here.

    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[int, int]:
        """(GPU bytes, CPU bytes) DeepEP sizes an Engram store with: entries of `hidden` elements, each
        aligned to 32 bytes, for the received tokens and for the entries, both 2 MB aligned."""
        for name, value in (
            ("num_entries", num_entries),
            ("hidden", hidden),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
        ):
            validate.positive(name, value)
        entry = align(hidden * dtype.itemsize, ENTRY_ALIGNMENT)
        return align(entry * num_max_tokens_per_rank, BUFFER_ALIGNMENT), align(
            entry * num_entries, BUFFER_ALIGNMENT
        )

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """DeepEP's PP bytes: send and receive buffers for the previous and next rank, 2 MB aligned."""
        validate.positive("num_max_tensor_bytes", num_max_tensor_bytes)
        validate.positive("num_max_inflight_tensors", num_max_inflight_tensors)
        tensor = align(num_max_tensor_bytes, ENTRY_ALIGNMENT)
        return align(tensor * num_max_inflight_tensors * 2 * 2, BUFFER_ALIGNMENT)

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        """DeepEP's bytes of one all-gather session: each gathered tensor (R times the local `shapes`,
        one shape or a sequence of them) rounded up to 32 bytes."""
        many = isinstance(shapes[0], tuple)  # a torch.Size is a tuple too
        for i, size in enumerate(d for s in (shapes if many else (shapes,)) for d in s):
            validate.positive(f"shapes (dimension {i})", size, minimum=0)
        R = _group_size(group)
        return sum(
            align(R * math.prod(s) * dtype.itemsize, ENTRY_ALIGNMENT) for s in (shapes if many else (shapes,))
        )

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        """DeepEP's AGRS buffer bytes: the session's bytes, 2 MB aligned."""
        validate.positive("num_max_session_bytes", num_max_session_bytes)
        return align(num_max_session_bytes, BUFFER_ALIGNMENT)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args, **kwargs) -> int:
        """DeepEP sizes SM counts by a bandwidth model of the GPU; here a fixed, recorded value."""
        return CPU_NUM_SMS

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP rule (one per SM up to 9 direct, 16 per SM + 1 hybrid), capped by the allocation."""
        qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(qps, self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An event on "everything issued so far": CPU work is already ordered by the program."""
        return EventHandle()

    def get_comm_stream(self) -> torch.Stream:
        """The stream the calls run on: DeepEP's is a CUDA side stream; ubep's calls run on the CPU, in
        the calling thread and in program order, so this is the CPU stream (`query()` is True)."""
        return torch.Stream(device="cpu")

    @opens("barrier")
    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True):
        """Wait until every rank of the group reaches this barrier (the call header's all-gather is one)."""
        self._live()
        self._headers.agree()

    def destroy(self) -> None:
        """Release every shared resource (needs explicitly_destroy=True, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a buffer built with explicitly_destroy=True (as in DeepEP)")
        self._alive = False
        _close_all(self._buffers, self._members)

    def _live(self) -> None:
        if not self._alive:
            raise RuntimeError("this ElasticBuffer was destroyed; build a new one")
        if self._members.retired:
            raise RuntimeError(
                f"rank {self.rank_idx} masked itself out of its group: it takes part in no call"
            )

    # -- membership (ubep's addition: DeepEP V2 has no mask) --------------------------------------

    def mask_ranks(self, ranks: Iterable[int]) -> None:
        """Leave `ranks` out of every later call, as `ubep.Buffer.mask_ranks`: collective among the
        ranks that stay (each passes the same ranks), at any point between calls. Later dispatches
        drop the top-k entries of the masked ranks' experts (the handle's topk_idx holds -1 there)
        and combine sums the rest; handles from before the mask are refused; a buffer for a shape
        first met after it cannot be built (that takes every rank). A rank in `ranks` leaves."""
        self._live()
        self._members.mask(ranks)

    def unmask_ranks(self, ranks: Iterable[int]) -> None:
        """Let masked ranks rejoin: not yet (NotImplementedError), ubep.Buffer has no rejoin."""
        raise NotImplementedError(NO_REJOIN)

    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """The ranks left out of every call, ascending: masked by `mask_ranks`, or by a call that met
        them dead under on_peer_failure="mask"."""
        return tuple(sorted(self._members.masked))

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill `mask_status` ([num_ranks] ints) with 1 for masked ranks, 0 for the others (the form of
        DeepEP V1's `low_latency_query_mask_buffer`)."""
        if mask_status.dim() != 1 or mask_status.numel() != self.num_ranks:
            shape = tuple(mask_status.shape)
            raise ValueError(f"mask_status must be a [{self.num_ranks}] tensor, got {shape}")
        mask_status.copy_(self._members.masked_R(mask_status.device))

    def _check_room(self, key: tuple) -> None:
        """The check building the ubep.Buffer for `key` makes, before the call header (a rank must not
        fail alone in a collective step): with an explicit num_bytes, every shape's segments fit."""
        if key in self._buffers or not self.explicit_num_bytes:
            return
        _, hidden, tokens, _ = key[:4]
        shapes = [(b.sizing.hidden, b.sizing.capacity) for b in self._buffers.values()]
        need = sum(_segment_bytes(h, self.num_ranks, self.num_ranks, t, False) for h, t in shapes)
        need += _segment_bytes(hidden, self.num_ranks, self.num_ranks, tokens, False)
        if need > self.num_bytes:
            raise ValueError(
                f"num_bytes={self.num_bytes} is too small for hidden={hidden}, T={tokens}: "
                f"{need} bytes needed; size it with ElasticBuffer.get_buffer_size_hint"
            )

    def _ubep(self, key: tuple, num_experts: int, max_topk: int) -> UbepBuffer:
        """The ubep.Buffer for `key` = (kind, hidden, T, K, ...), built collectively on first use."""
        self._live()
        if key not in self._buffers:
            self._check_room(key)
            if self._members.masked:  # every staying rank refuses alike
                raise RuntimeError(
                    f"rank(s) {self.masked_ranks} are masked, so no buffer for a new shape {key} can be "
                    "built (that takes every rank); use the shapes met before the mask"
                )
            _, hidden, tokens, _ = key[:4]
            self._buffers[key] = UbepBuffer(
                self.group,
                hidden=hidden,
                num_experts=num_experts,
                max_tokens_per_rank=tokens,
                max_topk=max_topk,
                timeout_s=float(self.num_cpu_timeout_secs),
                low_latency=False,
                on_peer_failure=self.on_peer_failure,
            )
        return self._buffers[key]

    # -- dispatch ---------------------------------------------------------------------------------

    @opens("dispatch")
    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        """(recv_x, recv_topk_idx, recv_topk_weights, handle, event), DeepEP V2's dispatch.

        Non-expand: one row per (token, receiving rank), rows by source global index.
        Expand (do_expand): one row per (token, local expert), experts in order, each padded to
        expert_alignment (padding rows zero); recv_topk_idx is None, recv_topk_weights 1-D.
        Without CPU sync the outputs have worst-case rows, the valid prefix in the handle.
        With `handle` (cached): the same rows in the same order, and the same handle back.
        """
        self._live()
        _wait(previous_event)
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding=True needs do_expand=True (padding exists only when expanded)")
        num_sms = num_sms or CPU_NUM_SMS
        if (num_qps or self.get_theoretical_num_qps(num_sms)) > self.num_allocated_qps:
            raise ValueError(f"num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps}")
        if handle is not None:
            return self._cached_dispatch(
                x, handle, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand,
                use_tma_aligned_col_major_sf, async_with_compute_stream,
            )  # fmt: skip
        if num_experts is None or topk_idx is None:
            raise ValueError("dispatch needs topk_idx and num_experts unless a handle is given")
        R, E = self.num_ranks, num_experts
        validate.positive("num_experts", E)
        if E % R:
            raise ValueError(f"num_experts={E} must be a multiple of the {R} ranks")
        alignment = validate.positive("expert_alignment", 1 if expert_alignment is None else expert_alignment)
        payload, sf_kind = _payload(x)
        N, H = payload[0].shape if isinstance(payload, tuple) else payload.shape
        T = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        validate.positive("num_max_tokens_per_rank", T)
        if N > T:
            raise ValueError(f"x has {N} tokens, more than num_max_tokens_per_rank={T}")
        idx_NK = validate.topk_idx(topk_idx, N, E, MAX_TOPK)
        K, L = idx_NK.shape[1], E // R
        w_NK = None if topk_weights is None else validate.topk_weights(topk_weights, (N, K))
        self._check_room(("dispatch", H, T, K, E))
        self._headers.agree(hidden=H, num_experts=E, num_max_tokens_per_rank=T, num_topk=K)
        inner = self._ubep(("dispatch", H, T, K, E), E, K)
        masked = self._members.masked
        idx_NK, lanes_NR, sent_SRJ = self._notify(idx_NK, E, min(K, L))  # (it may mask: see below)
        try:
            got = inner.dispatch(payload, topk_idx=idx_NK, topk_weights=_or_zeros(w_NK, idx_NK))
        finally:
            self._members.follow()
        if self._members.masked != masked:  # masked inside the call: the counts without them
            idx_NK, lanes_NR, sent_SRJ = self._notify(idx_NK, E, min(K, L))
        slot_MK, counts_L, starts_L = expanded_slots(got.recv_topk_idx, L, alignment)
        aligned_L = (counts_L + alignment - 1) // alignment * alignment
        route = ElasticRoute(got.handle, sent_SRJ, got.recv_topk_idx, slot_MK, int(aligned_L.sum()))
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        M = route.num_recv
        rows = M if sync else R * T
        expanded = int(aligned_L.sum()) if sync else align(R * T * min(K, L) + (alignment - 1) * L, alignment)
        handle = EPHandle(
            route,
            do_expand=bool(do_expand),
            num_experts=E,
            expert_alignment=alignment,
            num_max_tokens_per_rank=T,
            num_sms=num_sms,
            topk_idx=idx_NK.clone() if do_handle_copy else idx_NK,  # idx_NK: topk_idx, less masked ranks
            num_recv_tokens=rows,
            num_expanded_tokens=expanded,
            num_recv_tokens_per_expert_list=aligned_L.tolist() if sync else [],
            psum_num_recv_tokens_per_scaleup_rank=self._scaleup_psum(sent_SRJ),
            psum_num_recv_tokens_per_expert=(starts_L + counts_L if do_expand else aligned_L.cumsum(0)).int(),
            num_unaligned_recv_tokens_per_expert=counts_L.int(),
            recv_src_metadata=self._src_metadata(route, T, rows, K, do_expand),
            dst_buffer_slot_idx=_dst_slots(idx_NK, lanes_NR, sent_SRJ[: self.rank_idx, :, 0].sum(dim=0), E),
        )
        _count(cumulative_local_expert_recv_stats, counts_L, L)
        recv = _outputs(
            handle, got.recv_x, sf_kind, got.recv_topk_weights if w_NK is not None else None,
            use_tma_aligned_col_major_sf,
        )  # fmt: skip
        return (*recv, handle, _event(async_with_compute_stream))

    def _notify(self, idx_NK: torch.Tensor, num_experts: int, lanes: int):
        """(topk_idx without the masked ranks' experts, lanes per rank [N, R], sent_SRJ [R, R, J]):
        DeepEP's notify step, every live rank's per-rank lane counts (masked ranks' rows zeros)."""
        R = self.num_ranks
        if self._members.masked:
            owner_NK = idx_NK.clamp_min(0) // (num_experts // R)
            masked_NK = (idx_NK >= 0) & self._members.masked_R(idx_NK.device)[owner_NK]
            idx_NK = idx_NK.masked_fill(masked_NK, -1)
        lanes_NR = lanes_per_rank(idx_NK, num_experts, R)
        mine_RJ = stream_counts(lanes_NR, lanes)
        sent_SRJ = self._members.gather(mine_RJ, "ElasticBuffer.dispatch (notify step)")
        return idx_NK, lanes_NR, sent_SRJ

    def _cached_dispatch(
        self, x, handle, topk_idx, topk_weights, stats, num_experts, tokens, alignment, do_cpu_sync,
        do_expand, col_major_sf, async_with_compute_stream,
    ):  # fmt: skip
        """Repeat `handle`'s routing for new x: ubep's cached dispatch, or a full one with new weights."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must come from ElasticBuffer.dispatch, got {type(handle).__name__}")
        if topk_idx is not None:
            raise ValueError("a cached dispatch (handle=...) reuses the handle's topk_idx: pass none")
        if do_cpu_sync:
            raise ValueError("a cached dispatch cannot do a CPU sync (as in DeepEP)")
        given = (num_experts, alignment, tokens)
        expected = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
        if any(g is not None and g != e for g, e in zip(given, expected, strict=True)):
            raise ValueError(
                f"(num_experts, expert_alignment, num_max_tokens_per_rank) = {given} disagree with the "
                f"handle's {expected}"
            )
        if bool(do_expand) != handle.do_expand:
            raise ValueError(f"do_expand={do_expand}, but the handle was dispatched with {handle.do_expand}")
        route: ElasticRoute = handle.route
        payload, sf_kind = _payload(x)
        H = (payload[0] if isinstance(payload, tuple) else payload).shape[1]
        K, E, T = route.recv_topk_idx_MK.shape[1], handle.num_experts, handle.num_max_tokens_per_rank
        idx_NK = handle.topk_idx
        w_NK = None if topk_weights is None else validate.topk_weights(topk_weights, tuple(idx_NK.shape))
        self._check_room(("dispatch", H, T, K, E))
        self._headers.agree("cached_dispatch", hidden=H, handle=route.inner.seq, weights=w_NK is not None)
        inner = self._ubep(("dispatch", H, T, K, E), E, K)
        try:
            if w_NK is None:
                got = inner.dispatch(payload, handle=route.inner)
                recv_w = None
            else:
                got = inner.dispatch(payload, topk_idx=idx_NK, topk_weights=w_NK)
                recv_w = got.recv_topk_weights
        finally:
            self._members.follow()
        _count(stats, handle.num_unaligned_recv_tokens_per_expert.long(), E // self.num_ranks)
        recv = _outputs(handle, got.recv_x, sf_kind, recv_w, col_major_sf)
        return (*recv, handle, _event(async_with_compute_stream))

    def _scaleup_psum(self, sent_SRJ: torch.Tensor) -> torch.Tensor:
        """int32 [scale-up ranks]: inclusive prefix sum of tokens received per source scale-up index."""
        from_S = sent_SRJ[:, self.rank_idx, 0]
        per_up = from_S.view(self.num_scaleout_ranks, self.num_scaleup_ranks).sum(dim=0)
        return per_up.cumsum(0).int()

    def _src_metadata(self, route: ElasticRoute, T: int, rows: int, K: int, do_expand: bool) -> torch.Tensor:
        """int32 [rows, 2 + K]: DeepEP's recv_src_metadata (padding rows -1)."""
        M, inner = route.num_recv, route.inner
        local_MK = route.recv_topk_idx_MK >= 0
        last_M = torch.where(local_MK, torch.arange(K, dtype=torch.int64, device=local_MK.device), -1).amax(
            dim=1
        )
        if self.num_scaleout_ranks == 1:
            where_M = inner.recv_src_rank_M
        else:  # hybrid: the row's slot among the rows of its source scale-up index
            up_M = inner.recv_src_rank_M % self.num_scaleup_ranks
            same_MU = torch.nn.functional.one_hot(up_M, self.num_scaleup_ranks)
            where_M = (same_MU.cumsum(dim=0) - same_MU).gather(1, up_M.unsqueeze(1)).flatten()
        meta = torch.full((rows, 2 + K), -1, dtype=torch.int32, device=local_MK.device)
        meta[:M, 0] = (inner.recv_src_rank_M * T + inner.recv_src_token_M).int()
        meta[:M, 1] = (where_M * K + last_M).int()
        if do_expand:
            meta[:M, 2:] = route.slot_MK.int()
        return meta

    # -- combine ----------------------------------------------------------------------------------

    @opens("combine")
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(combined_x [N, H], combined_topk_weights [N, K] or None, event), DeepEP V2's combine.

        combined_x = round(bias + the rows of the token's ranks in the order of their last lanes),
        summed in float32; with allow_multiple_reduction a rank first sums its own expanded rows,
        and in hybrid mode each scale-out domain's sum is rounded before the final sum.
        combined_topk_weights[t, k] is the weight the rank owning lane k sent back (0 for -1 lanes).
        """
        self._live()
        _wait(previous_event)
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must come from ElasticBuffer.dispatch, got {type(handle).__name__}")
        route: ElasticRoute = handle.route
        x = validate.tensor("x", x, (torch.bfloat16, torch.float32), 2)
        need = route.num_expanded if handle.do_expand else route.num_recv
        if x.shape[0] < need:
            raise ValueError(f"x has {x.shape[0]} rows; this handle's dispatch delivered {need}")
        multiple = self.allow_multiple_reduction
        weights = self._combine_weights(topk_weights, handle, multiple)
        idx_NK = handle.topk_idx
        N, K, H = idx_NK.shape[0], idx_NK.shape[1], x.shape[1]
        biases = _biases(bias, N, H)
        streams = trip.owner_streams(x, weights, route, handle.do_expand, multiple)
        home_key = ("home", H, handle.num_max_tokens_per_rank, K)
        self._check_room(home_key)
        self._headers.agree(hidden=H, handle=route.inner.seq, num_topk=K, streams=len(streams))
        home = self._ubep(home_key, self.num_ranks * K, K)
        arrived = []
        try:
            for j, stream in enumerate(streams):
                per_rank_R = route.sent_SRJ[:, :, j].sum(dim=0)
                chunks = -(-int(per_rank_R.max()) // handle.num_max_tokens_per_rank)
                table_RP = route.positions(self.rank_idx, idx_NK, handle.num_experts, j)
                arrived.append(trip.send_home(home, stream, table_RP, handle.num_max_tokens_per_rank, chunks))
        finally:
            self._members.follow()
        y_NKH, w_NK = trip.place(arrived, N, K, x)
        hybrid = multiple and self.num_scaleout_ranks > 1
        domain = handle.num_experts // self.num_scaleout_ranks if hybrid else None
        combined = trip.reduce_home(y_NKH, idx_NK, domain, biases)
        return combined, (w_NK if weights is not None else None), _event(async_with_compute_stream)

    def _combine_weights(self, topk_weights, handle: EPHandle, multiple: bool):
        """The receiver's weights: [rows, K] (non-expand) or [rows] (expand), rows covering the handle's."""
        if topk_weights is None:
            return None
        if handle.do_expand and not multiple:
            raise ValueError(
                "topk_weights in an expanded combine need allow_multiple_reduction=True (as in DeepEP)"
            )
        route: ElasticRoute = handle.route
        K = route.recv_topk_idx_MK.shape[1]
        need = route.num_expanded if handle.do_expand else route.num_recv
        w = validate.tensor("topk_weights", topk_weights, torch.float32, 1 if handle.do_expand else 2)
        if w.shape[0] < need or (not handle.do_expand and w.shape[1] != K):
            want = f"[>= {need}]" if handle.do_expand else f"[>= {need}, {K}]"
            raise ValueError(f"topk_weights has shape {tuple(w.shape)}, expected {want}")
        return w

    # -- what ubep's ElasticBuffer does not provide ------------------------------------------------

    def engram_write(self, *args, **kwargs):
        raise NotImplementedError("ElasticBuffer here serves EP dispatch/combine; Engram is not provided")

    engram_fetch = engram_write

    def pp_set_config(self, *args, **kwargs):
        raise NotImplementedError("ElasticBuffer here serves EP dispatch/combine; PP is not provided")

    pp_send = pp_recv = pp_set_config

    def agrs_set_config(self, *args, **kwargs):
        raise NotImplementedError("ElasticBuffer here serves EP dispatch/combine; AGRS is not provided")

    all_gather = create_agrs_session = destroy_agrs_session = agrs_set_config
    agrs_new_session = agrs_get_inplace_tensor = agrs_set_config


# -- helpers --------------------------------------------------------------------------------------


def _topk(num_topk: int) -> None:
    """num_topk in [0, MAX_TOPK] (0: not known yet)."""
    validate.positive("num_topk", num_topk, minimum=0)
    if num_topk > MAX_TOPK:
        raise ValueError(f"num_topk must be <= {MAX_TOPK} (DeepEP V2's limit), got {num_topk}")


def _close_all(buffers: dict, members: Members) -> None:
    closing = list(buffers.values())
    buffers.clear()
    for b in closing:
        b.close()
    members.close()


def _group_size(group) -> int:
    if isinstance(group, VirtualRank):
        return group.world_size
    if group is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return group.size() if hasattr(group, "size") else dist.get_world_size(group)


def _wait(event) -> None:
    if event is not None:
        event.current_stream_wait()


def _event(async_with_compute_stream: bool) -> EventOverlap:
    return EventOverlap(EventHandle()) if async_with_compute_stream else EventOverlap()


def _or_zeros(w, like: torch.Tensor) -> torch.Tensor:
    """w, or float32 zeros of like's shape on its device (weights are float32 whatever the default)."""
    return w if w is not None else torch.zeros(like.shape, dtype=torch.float32, device=like.device)


def _payload(x):
    """(ubep's payload, scale kind): x itself, or an FP8 pair whose scales are float32 [N, H / 128]
    or packed UE8M0 int32 [N, H / 512] (carried bit for bit in the first columns of float32 ones)."""
    if not isinstance(x, tuple):
        return validate.tensor("x", x, (torch.bfloat16, torch.float32), 2), None
    values, sf = x
    if not isinstance(sf, torch.Tensor) or sf.dtype not in (torch.float32, torch.int32):
        raise TypeError("x[1] (scales) must be a float32 or int32 (packed UE8M0) tensor")
    if sf.dtype == torch.float32:
        return (values, sf), "float32"
    wide = torch.zeros(sf.shape[0], values.shape[1] // 128, dtype=torch.float32, device=sf.device)
    if sf.shape[1] * 4 != wide.shape[1]:
        raise ValueError(f"packed UE8M0 scales must be [N, H / 512], got {tuple(sf.shape)}")
    wide[:, : sf.shape[1]] = sf.view(torch.float32)
    return (values, wide), "ue8m0"


def _sf_out(rows: int, like: torch.Tensor, col_major: bool) -> torch.Tensor:
    """Zeroed scales [rows, like's width] in like's dtype and device, row-major or DeepEP's TMA-aligned
    column-major layout."""
    width, dtype, device = like.shape[1], like.dtype, like.device
    if not col_major:
        return torch.zeros(rows, width, dtype=dtype, device=device)
    stride = align(max(rows, 1), SF_PACKS_PER_TMA_ROW)
    return torch.zeros(width, stride, dtype=dtype, device=device)[:, :rows].t()


def _outputs(handle: EPHandle, recv, sf_kind, recv_w_MK, col_major_sf: bool):
    """(recv_x, recv_topk_idx, recv_topk_weights) in the handle's layout and row counts."""
    route: ElasticRoute = handle.route
    M = route.num_recv
    values_MH, sf_MS = recv if isinstance(recv, tuple) else (recv, None)
    if sf_kind == "ue8m0":
        sf_MS = sf_MS[:, : sf_MS.shape[1] // 4].contiguous().view(torch.int32)
    if handle.do_expand:
        rows = handle.num_expanded_tokens
        local_MK = route.slot_MK >= 0
        m_P = local_MK.nonzero()[:, 0]
        slot_P = route.slot_MK[local_MK]
        pick = slot_P, m_P
    else:
        rows = handle.num_recv_tokens
        rows_M = torch.arange(M, dtype=torch.int64, device=values_MH.device)
        pick = rows_M, rows_M
    out_x = torch.zeros(rows, values_MH.shape[1], dtype=values_MH.dtype, device=values_MH.device)
    out_x[pick[0]] = values_MH[pick[1]]
    if sf_MS is not None:
        out_sf = _sf_out(rows, sf_MS, col_major_sf)
        out_sf[pick[0]] = sf_MS[pick[1]]
        out_x = (out_x, out_sf)
    if handle.do_expand:
        out_w = None
        if recv_w_MK is not None:
            out_w = torch.zeros(rows, dtype=torch.float32, device=recv_w_MK.device)
            out_w[pick[0]] = recv_w_MK[route.slot_MK >= 0]
        return out_x, None, out_w
    out_idx = torch.full(
        (rows, route.recv_topk_idx_MK.shape[1]), -1, dtype=torch.int64, device=route.recv_topk_idx_MK.device
    )
    out_idx[:M] = route.recv_topk_idx_MK
    out_w = None
    if recv_w_MK is not None:
        out_w = torch.zeros(rows, recv_w_MK.shape[1], dtype=torch.float32, device=recv_w_MK.device)
        out_w[:M] = recv_w_MK
    return out_x, out_idx, out_w


def _dst_slots(idx_NK, lanes_NR, before_R, num_experts: int) -> torch.Tensor:
    """int32 [N, K]: the row each lane's token occupies on the lane's owner (-1 for -1 lanes)."""
    R = lanes_NR.shape[1]
    sent_NR = (lanes_NR > 0).long()
    row_NR = before_R + sent_NR.cumsum(dim=0) - sent_NR
    owner_NK = torch.where(idx_NK >= 0, idx_NK // (num_experts // R), 0)
    return torch.where(idx_NK >= 0, row_NR.gather(1, owner_NK), -1).int()


def _count(stats, counts_L: torch.Tensor, num_local_experts: int) -> None:
    if stats is None:
        return
    stats = validate.tensor("cumulative_local_expert_recv_stats", stats, (torch.int32, torch.int64), 1)
    if stats.numel() != num_local_experts:
        raise ValueError(f"cumulative_local_expert_recv_stats must have {num_local_experts} entries")
    stats.add_(counts_L.to(stats.dtype))


def _biases(bias, num_tokens: int, hidden: int) -> list[torch.Tensor]:
    if bias is None:
        return []
    biases = [bias] if isinstance(bias, torch.Tensor) else list(bias)
    if len(biases) > 2:
        raise ValueError(f"bias takes one tensor or a pair, got {len(biases)}")
    for i, b in enumerate(biases):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"bias[{i}] must be a [{num_tokens}, {hidden}] tensor (one row per home token)")
    return biases

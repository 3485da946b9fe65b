"""DeepEP's `deep_ep.Buffer` on top of ubep's public `ubep.Buffer`.

DeepEP sizes its Buffer in bytes (`num_nvl_bytes`, `num_rdma_bytes`) and learns
shapes at each call; ubep sizes by shape. The constructor loads the compiled call
halves of every mode the Buffer can run (the seconds of a process's first ubep
Buffer), as DeepEP allocates there; this layer keeps one ubep.Buffer per shape it
meets, built collectively at the first call with that shape (every rank makes the
same calls, so every rank builds it at the same moment; tens of milliseconds):
  - normal mode, per (hidden, num_experts): max_tokens_per_rank is the most
    tokens whose shared segment fits in max(num_nvl_bytes, num_rdma_bytes).
  - low-latency mode, per (hidden, num_experts, T): max_tokens_per_rank is T;
    the call checks that `get_low_latency_rdma_size_hint(T, ...)` fits in num_rdma_bytes.

What this layer adds over ubep.Buffer, all expressed through its public calls:
  - handles that unpack like DeepEP's tuples (`handles.py`); a normal dispatch
    gathers every rank's counts once (DeepEP's notify step) to fill them;
  - dispatch routed by `is_token_in_rank` alone: a synthesized top-k naming one
    expert of each destination rank; the received top-k outputs are then None;
  - `num_worst_tokens`: outputs padded to that many rows, padding marked by
    `recv_topk_idx == -1`, an empty expert-count list, and a too-small value
    refused on every rank before any byte moves;
  - combine `bias`: summed in float32 with the rows, one rounding at the end;
  - low-latency `zero_copy`, `round_scale` and `use_ue8m0` (`scales.py`),
    column-major received scales, `use_logfmt` (combined at full precision).
  - `get_local_buffer_tensor`: bytes this Buffer holds for the caller (no call touches
    them); `get_comm_stream`: the CPU stream, where every call runs in program order.
GPU tuning knobs (SM counts, QPs, NVLink/fabric switches, chunk sizes in Config)
are accepted and change nothing here.
The shrink-mode mask buffer (`enable_shrink=True`) masks a rank in every ubep
Buffer built so far (`members.Members`): a collective among the ranks that stay,
where DeepEP's is a local flag, allowed between any two calls; the next calls, in
both modes, run without the masked ranks (the call header and the notify step
gather among the staying ranks). A call that meets a dead rank raises naming it,
or, with UBEP_ON_PEER_FAILURE=mask, masks it and finishes without it (what
`low_latency_query_mask_buffer` then reports, as DeepEP's kernels' masks).
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ubep import fp8, registry, settings, validate
from ubep import layout as ep_layout
from ubep.buffer import Buffer as UbepBuffer
from ubep.compat.deep_ep import scales
from ubep.compat.deep_ep.handles import LowLatencyView, NormalHandle, normal_handle
from ubep.compat.deep_ep.header_gather import CallHeaders, opens
from ubep.compat.deep_ep.members import NO_REJOIN, Members
from ubep.compat.deep_ep.utils.event import EventHandle, EventOverlap, pending_event, wait_previous
from ubep.deadlines import construction_s
from ubep.errors import SharedMemorySizeError
from ubep.factory import heap_bytes, ready_engine
from ubep.group import choose_transport, join_group
from ubep.layout import tokens_per_node
from ubep.overlap import EventOverlap as Pending
from ubep.protocols.base import Sizing
from ubep.protocols.warmup import needed
from ubep.results import LowLatencyHandle
from ubep.stats import Stats

HINT_TOKENS = 4096  # tokens per rank a normal-mode size hint provides for (DeepEP's prefill size)
MAX_TOPK = 16
LL_MAX_TOPK = 11  # DeepEP's low-latency kernels take top-k <= 11 (kNumMaxTopK in internode_ll.cu)
HINT_BYTES_PER_CHANNEL = 2  # DeepEP's hidden_bytes = hidden * max(element_size, 2): 2 for bf16 and FP8
DEFAULT_NUM_SMS = 20  # DeepEP's default SM budget: Config.num_sms // 2 channels shape the handle

__all__ = ["Buffer", "Config"]


def _max_topk(num_ranks: int) -> int:
    """Top-k capacity: DeepEP's 16, or one slot per rank for dispatches routed by is_token_in_rank."""
    return max(MAX_TOPK, num_ranks)


def _segment_sizer(hidden: int, num_ranks: int, num_experts: int, low_latency: bool) -> Callable[[int], int]:
    """Bytes of one rank's shared segment for a ubep.Buffer of these shapes built now, by its tokens per
    rank (the normal-mode Buffer with low_latency=False, the low-latency one with it): its protocol and
    low-latency row form come from the environment as that Buffer's will (`ubep.settings`:
    UBEP_PROTOCOL, UBEP_LL_FLAG; with `in-word` the low-latency slots take twice the bytes)."""
    chosen = settings.resolve({})
    placement = ep_layout.ExpertPlacement.contiguous(num_experts, num_ranks)
    max_topk = LL_MAX_TOPK if low_latency else _max_topk(num_ranks)
    protocol, ll_flag = chosen["protocol"].value, chosen["ll_flag"].value

    def segment_bytes(tokens: int) -> int:
        sizing = Sizing(hidden=hidden, capacity=tokens, max_topk=max_topk, placement=placement)
        return heap_bytes(sizing, protocol, low_latency, ll_flag)

    return segment_bytes


def _segment_bytes(hidden: int, num_ranks: int, num_experts: int, tokens: int, low_latency: bool) -> int:
    """`_segment_sizer`'s bytes for `tokens` tokens per rank."""
    return _segment_sizer(hidden, num_ranks, num_experts, low_latency)(tokens)


def _tokens_that_fit(num_bytes: int, hidden: int, num_ranks: int) -> int:
    """The most tokens per rank whose normal-mode segment fits in num_bytes (0 if none)."""
    segment_bytes = _segment_sizer(hidden, num_ranks, num_ranks, low_latency=False)
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if segment_bytes(mid) <= num_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Config:
    """DeepEP's performance config: GPU tuning, unused here but `num_sms // 2` (channels in handles)."""

    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """The segment a normal-mode Buffer maps for HINT_TOKENS tokens per rank of hidden
        `hidden_bytes / 2`, exactly, and no more.

        DeepEP's callers pass `hidden * max(element_size, 2)` (its docs' `get_hidden_bytes`,
        Megatron's), so that is the hidden size for bf16 and FP8 alike; ubep's segment depends on
        the hidden size, not on the payload's type. A caller passing one byte a channel for FP8
        gets room for half the tokens.
        """
        validate.positive("hidden_bytes", hidden_bytes)
        hidden = -(-hidden_bytes // HINT_BYTES_PER_CHANNEL)
        return _segment_bytes(hidden, num_ranks, num_ranks, HINT_TOKENS, low_latency=False)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Between hosts ubep uses torch.distributed, which needs no registered buffer."""
        return 0


class Buffer:
    """DeepEP's `deep_ep.Buffer`, byte-sized; every rank of `group` constructs it.

    The arguments after `allow_mnnvl` are keyword-only: DeepEP V1 puts `use_fabric` there and
    DeepEP 2.1 dropped it, so a positional value would mean a different argument in each; passed
    by position they raise TypeError here rather than be read as the wrong one. `use_fabric` is
    accepted (by keyword) and, like the other GPU switches, changes nothing.
    """

    num_sms: int = DEFAULT_NUM_SMS  # DeepEP's class-wide SM budget; only feeds the default Config here

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        *,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ):
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if comm is not None:
            raise ValueError("comm (an MPI communicator) is not supported; pass a torch.distributed group")
        self._info = join_group(group)
        self.group = self._info.group
        self.rank = self._info.rank
        self.group_size = self._info.world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        self._buffers: dict[tuple, UbepBuffer] = {}  # lives as long as this Buffer, keyed by shape
        self._normal_tokens: dict[int, int] = {}  # by hidden: the tokens per rank the bytes hold
        self._combine_inputs: dict[tuple, torch.Tensor] = {}  # zero-copy combine buffers, by shape
        self._raw: dict[bool, torch.Tensor] = {}  # get_local_buffer_tensor's bytes, by use_rdma_buffer
        chosen = settings.resolve({})  # as the ubep Buffers built here take them
        # the ranks masked in every buffer above (enable_shrink), and the collectives among the rest
        self._members = Members(
            self._info, chosen["timeout_s"].value, self._buffers, chosen["on_peer_failure"].value
        )
        self._headers = CallHeaders(self._members, "deep_ep.Buffer")  # every call opens with one
        self._ready_halves(chosen)

    def _ready_halves(self, chosen: dict[str, settings.Setting]) -> None:
        """Load (or compile) the call halves of every mode this Buffer can run, now: DeepEP allocates
        in its constructor, so its first call costs what a later one does. A ubep Buffer's memory
        depends on the shapes the calls bring (built at the first call of each), but most of a first
        build is not its memory: it is this process's first load of the compiled halves (seconds;
        a later ubep Buffer in the process takes milliseconds: scripts/deep_ep_first_call.py)."""
        transport, _ = choose_transport(chosen["transport"].value, self._info)
        engine = chosen["engine"].value
        if registry.TRANSPORTS[transport].on_device and engine == registry.AUTO:  # as ubep.Buffer picks
            engine = registry.TRITON.name
        halves = needed(chosen["protocol"].value, self.low_latency_mode, workers=1)
        timeout_s = construction_s(chosen["timeout_s"].value)
        ready_engine(engine, halves, time.monotonic() + timeout_s)

    def explain(self) -> str:
        """Which implementation serves this DeepEP Buffer, and the ubep Buffers built so far (each
        `ubep.Buffer.explain()` under its shape key, indented)."""
        inner = [f"  {key}:\n" + textwrap.indent(buf.explain(), "    ") for key, buf in self._buffers.items()]
        return "\n".join(
            ["deep_ep.Buffer served by ubep (ubep.compat.deep_ep); ubep Buffers per shape:"]
            + (inner or ["  none built yet"])
        )

    def stats(self, merge: bool = False) -> dict[tuple, Stats]:
        """Each ubep Buffer's `stats(merge)` by shape key, where recording is on (UBEP_STATS=1);
        not DeepEP API. With `merge`, a collective per Buffer: call it on every rank at once."""
        return {key: buf.stats(merge) for key, buf in self._buffers.items()}

    # -- sizing and configs -----------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether SM90 (Hopper) kernels were compiled: never here, ubep's engines are CPU and Triton."""
        return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM budget for normal kernels (must be even); sets the handles' channel count."""
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
        """Exact bytes of one rank's segment for low-latency calls of these shapes (bf16 or FP8, top-k up
        to DeepEP's low-latency limit of 11), in the protocol and row form the environment selects
        (UBEP_PROTOCOL, UBEP_LL_FLAG), as the Buffer built at the first low-latency call takes them and
        as its size check uses this hint."""
        return _segment_bytes(hidden, num_ranks, num_experts, num_max_dispatch_tokens_per_rank, True)

    def get_comm_stream(self) -> torch.Stream:
        """The stream the calls run on. DeepEP's is a CUDA side stream; ubep's calls run on the CPU,
        in the calling thread and in program order (an `async_finish` receive half at its event's
        wait), so this is the CPU stream: `query()` is True, `synchronize()` returns at once."""
        return torch.Stream(device="cpu")

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """This rank's raw buffer, `num_nvl_bytes` (or `num_rdma_bytes`) bytes, as `dtype` from byte
        `offset`; with `size`, its first `size.numel()` elements viewed as `size` (DeepEP V1).

        The bytes are allocated at the first request and kept for this Buffer's life, so every
        request sees the same memory, as in DeepEP. Unlike DeepEP's, no call reads or writes them and
        peers do not see them: ubep's exchanges use segments of their own. The tensor ends at the
        buffer's end (DeepEP's runs `offset` bytes past it).
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        item = dtype.itemsize
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= num_bytes:
            raise ValueError(f"offset must be an int in [0, {num_bytes}] (bytes), got {offset!r}")
        if offset % item:
            raise ValueError(f"offset ({offset} bytes) must be a multiple of {dtype}'s {item} bytes")
        if use_rdma_buffer not in self._raw:
            self._raw[use_rdma_buffer] = torch.zeros(num_bytes, dtype=torch.uint8, device="cpu")
        raw = self._raw[use_rdma_buffer]
        tensor = raw[offset : offset + (num_bytes - offset) // item * item].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(
                f"size {tuple(size)} needs {size.numel()} elements; the buffer holds {tensor.numel()} "
                f"of {dtype} from offset {offset}"
            )
        return tensor[: size.numel()].view(size)

    @staticmethod
    def capture() -> EventOverlap:
        """An event marking everything issued so far (complete: CPU work is ordered by the program)."""
        return EventOverlap(EventHandle())

    def _check_normal(self, hidden: int, num_experts: int) -> int:
        """The checks building the normal-mode buffer of this shape makes, before the call header (a
        rank must not fail alone in a collective step); the tokens it holds (0: built already)."""
        key = ("normal", hidden, num_experts)
        if key in self._buffers:
            return 0
        self._check_unmasked(key)
        if hidden not in self._normal_tokens:
            num_bytes = max(self.num_nvl_bytes, self.num_rdma_bytes)
            self._normal_tokens[hidden] = _tokens_that_fit(num_bytes, hidden, self.group_size)
        tokens = self._normal_tokens[hidden]
        if tokens < 1:
            raise ValueError(
                f"num_nvl_bytes={self.num_nvl_bytes} holds no token of hidden size {hidden}; "
                "size it with Config.get_nvl_buffer_size_hint"
            )
        return tokens

    def _normal(self, hidden: int, num_experts: int) -> UbepBuffer:
        key = ("normal", hidden, num_experts)
        if key not in self._buffers:
            tokens = self._check_normal(hidden, num_experts)
            self._buffers[key] = self._built(
                f"num_nvl_bytes={self.num_nvl_bytes} ({tokens} tokens per rank)",
                hidden=hidden,
                num_experts=num_experts,
                max_tokens_per_rank=tokens,
                max_topk=_max_topk(self.group_size),
                low_latency=False,
            )
        return self._buffers[key]

    def _check_low_latency(self, hidden: int, num_experts: int, max_tokens: int) -> None:
        """The checks building the low-latency buffer of this shape makes (see `_check_normal`)."""
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer built with low_latency_mode=True")
        key = ("ll", hidden, num_experts, max_tokens)
        if key not in self._buffers:
            self._check_unmasked(key)
            need = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size, num_experts)
            if need > self.num_rdma_bytes:
                raise ValueError(
                    f"num_rdma_bytes={self.num_rdma_bytes} is too small for T={max_tokens}, hidden={hidden}, "
                    f"{num_experts} experts: get_low_latency_rdma_size_hint gives {need}"
                )

    def _low_latency(self, hidden: int, num_experts: int, max_tokens: int) -> UbepBuffer:
        self._check_low_latency(hidden, num_experts, max_tokens)
        key = ("ll", hidden, num_experts, max_tokens)
        if key not in self._buffers:
            self._buffers[key] = self._built(
                f"num_rdma_bytes={self.num_rdma_bytes} (low-latency, T={max_tokens})",
                hidden=hidden,
                num_experts=num_experts,
                max_tokens_per_rank=max_tokens,
                max_topk=LL_MAX_TOPK,
                low_latency=True,
            )
        return self._buffers[key]

    def _built(self, sized_by: str, **sizes) -> UbepBuffer:
        """A ubep.Buffer of these sizes on this group; when its segments cannot fit the host, the
        error (raised on every rank before anything is mapped) says which DeepEP argument sized it."""
        try:
            return UbepBuffer(self.group, **sizes)
        except SharedMemorySizeError as error:
            raise SharedMemorySizeError(
                f"deep_ep.Buffer: {sized_by} sizes each rank's shared segment; {error}. Lower it (the "
                "size hints give what ubep needs for their shapes and no more; see docs/reliability.md, "
                "'Footprint')",
                error.needed,
                error.free,
            ) from error

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
        wait_previous(previous_event)
        placement = ep_layout.ExpertPlacement.contiguous(num_experts, self.group_size)
        idx = self._without_masked(_validated_topk(topk_idx, num_experts, self.group_size), num_experts)
        got = ep_layout.dispatch_layout(idx, placement)
        return (
            got.num_tokens_per_rank_R,
            None
            if self._info.num_nodes == 1
            else tokens_per_node(got.is_token_in_rank_NR, self._info.node_of_rank),
            got.num_tokens_per_expert_E,
            got.is_token_in_rank_NR,
            pending_event(Pending(), async_finish),
        )

    @opens("dispatch")
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | None = None,
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
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).

        With `handle` (cached): (recv_x, None, None, None, None, event). Without
        `topk_idx`, `is_token_in_rank` routes the tokens and the top-k outputs are None.
        """
        wait_previous(previous_event)
        validate.positive("num_worst_tokens", num_worst_tokens, minimum=0)
        hidden = (x[0] if fp8.is_pair(x) else x).shape[1]
        if handle is not None:
            return self._cached_dispatch(x, handle, hidden, topk_idx, topk_weights, async_finish)
        if num_tokens_per_expert is None:
            raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) or a handle")
        E, R = num_tokens_per_expert.numel(), self.group_size
        self._check_normal(hidden, E)
        idx, weights, sent_NR = self._routing(x, hidden, E, is_token_in_rank, topk_idx, topk_weights)
        self._headers.agree(hidden=hidden, num_experts=E, num_worst_tokens=num_worst_tokens)
        inner = self._normal(hidden, E)
        while True:  # again where the gather masked a rank it found dead (UBEP_ON_PEER_FAILURE=mask)
            masked = self._members.masked
            if masked:  # no row goes to a masked rank: the layout the caller passed may count some
                idx, sent_NR = self._around_masked(idx, sent_NR, E, topk_idx is None)
                num_tokens_per_rank = None
            counts_RX = self._gather_counts(sent_NR, num_tokens_per_expert)
            if self._members.masked == masked:
                break
        received = int(counts_RX[:, self.rank].sum())
        worst_R = counts_RX[:, :R].sum(dim=0)
        if num_worst_tokens and int(worst_R.max()) > num_worst_tokens:
            raise ValueError(
                f"num_worst_tokens={num_worst_tokens} is fewer than the {int(worst_R.max())} tokens rank "
                f"{int(worst_R.argmax())} receives; pass at least num_tokens * num_ranks"
            )
        try:  # the inner Buffer refuses (and tells the peers) before any byte moves
            got = inner.dispatch(
                x,
                topk_idx=idx,
                topk_weights=weights,
                num_tokens_per_rank=num_tokens_per_rank,
                is_token_in_rank=sent_NR,
                expert_alignment=expert_alignment,
            )
        except ValueError as error:
            self._members.follow()
            if sent_NR.shape[0] > inner.sizing.capacity:  # in DeepEP's terms: bytes, not a token count
                raise _too_many(
                    sent_NR.shape[0], inner.sizing.capacity, self.num_nvl_bytes, hidden
                ) from error
            raise
        self._members.follow()
        rows = num_worst_tokens or received
        channels = (config.num_sms if config is not None else Buffer.num_sms) // 2
        view = normal_handle(got.handle, counts_RX, channels, E, rows)
        if topk_idx is None:
            counts = self._expert_counts_from(counts_RX, E, expert_alignment)
            recv_idx = recv_w = None
        else:
            counts = got.num_recv_tokens_per_expert_list
            recv_idx, recv_w = _pad(got.recv_topk_idx, rows, -1), _pad(got.recv_topk_weights, rows, 0)
        recv_x = _pad_payload(got.recv_x, rows)
        event = pending_event(Pending(), async_finish, (recv_x if not fp8.is_pair(recv_x) else recv_x[0],))
        return recv_x, recv_idx, recv_w, [] if num_worst_tokens else counts, view, event

    def _routing(self, x, hidden, num_experts, is_token_in_rank, topk_idx, topk_weights):
        """(topk_idx, topk_weights, is_token_in_rank) for ubep's dispatch; a synthesized top-k when
        only is_token_in_rank is given (one expert of each destination rank, weight 0)."""
        R = self.group_size
        placement = ep_layout.ExpertPlacement.contiguous(num_experts, R)
        if topk_idx is not None:
            if topk_weights is None:
                raise ValueError("topk_weights must be given with topk_idx (DeepEP sends both or neither)")
            rows = (x[0] if fp8.is_pair(x) else x).shape[0]
            idx = validate.topk_idx(topk_idx, rows, num_experts, _max_topk(R))
            return idx, topk_weights, ep_layout.token_in_rank(idx, placement)
        if topk_weights is not None:
            raise ValueError("topk_weights was given without topk_idx")
        if is_token_in_rank is None:
            raise ValueError("dispatch needs topk_idx or is_token_in_rank to know where tokens go")
        sent_NR = validate.tensor("is_token_in_rank", is_token_in_rank, torch.bool, 2)
        if sent_NR.shape[1] != R:
            raise ValueError(f"is_token_in_rank must be [num_tokens, {R}], got {tuple(sent_NR.shape)}")
        first_expert_R = torch.arange(R, dtype=torch.int64, device=sent_NR.device) * (num_experts // R)
        idx = torch.where(sent_NR, first_expert_R, -1)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=idx.device), sent_NR

    def _without_masked(self, idx_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
        """topk_idx with -1 where it selects a masked rank's expert (itself where none is masked)."""
        if not self._members.masked:
            return idx_NK
        owner_NK = idx_NK.clamp_min(0) // (num_experts // self.group_size)
        return idx_NK.masked_fill((idx_NK >= 0) & self._members.masked_R(idx_NK.device)[owner_NK], -1)

    def _around_masked(self, idx_NK, sent_NR, num_experts: int, synthesized: bool):
        """(topk_idx, is_token_in_rank) without the masked ranks: what the inner dispatch sends."""
        if synthesized:
            sent_NR = sent_NR & ~self._members.masked_R(sent_NR.device)
            first_expert_R = torch.arange(self.group_size, dtype=torch.int64, device=sent_NR.device)
            return torch.where(sent_NR, first_expert_R * (num_experts // self.group_size), -1), sent_NR
        idx_NK = self._without_masked(idx_NK, num_experts)
        placement = ep_layout.ExpertPlacement.contiguous(num_experts, self.group_size)
        return idx_NK, ep_layout.token_in_rank(idx_NK, placement)

    def _gather_counts(self, sent_NR: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """int64 [R, R + E + 1]: every rank's (tokens per destination, tokens per expert, token count);
        a masked rank's row is zeros, and so is every rank's count for it (nothing is sent there).

        DeepEP's notify step: one small all-gather among the staying ranks, so every rank can fill
        the handle's prefix matrices and check num_worst_tokens before any token moves."""
        mine = torch.cat(
            [
                sent_NR.sum(dim=0),
                num_tokens_per_expert.to(torch.int64),
                torch.tensor([sent_NR.shape[0]], dtype=torch.int64, device=sent_NR.device),
            ]
        )
        if self.group_size == 1:
            return mine.unsqueeze(0)
        return self._members.gather(mine, "deep_ep.Buffer.dispatch (notify step)")

    def _expert_counts_from(self, counts_RX: torch.Tensor, num_experts: int, alignment: int) -> list[int]:
        """Tokens each local expert receives, from the senders' num_tokens_per_expert, aligned."""
        R, L = self.group_size, num_experts // self.group_size
        mine_RL = counts_RX[:, R + self.rank * L : R + (self.rank + 1) * L]
        return [-(-int(c) // alignment) * alignment for c in mine_RL.sum(dim=0)]

    def _cached_dispatch(self, x, handle, hidden, topk_idx, topk_weights, async_finish):
        if topk_idx is not None or topk_weights is not None:
            raise ValueError(
                "a cached dispatch (handle=...) repeats its routing: pass no topk_idx/topk_weights"
            )
        view = _normal_view(handle)
        self._check_normal(hidden, view.num_experts)
        self._headers.agree(
            "cached_dispatch", hidden=hidden, num_experts=view.num_experts, handle=view.inner.seq
        )
        try:
            got = self._normal(hidden, view.num_experts).dispatch(x, view.inner)
        finally:
            self._members.follow()
        recv_x = _pad_payload(got.recv_x, view.num_rows)
        return recv_x, None, None, None, None, pending_event(Pending(), async_finish)

    @opens("combine")
    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(combined_x, combined_topk_weights, event): plain sums per token, plus `bias` ([N, H], one
        tensor or two) added on the home rank in float32 before the one rounding to x's dtype."""
        wait_previous(previous_event)
        view = _normal_view(handle)
        M = view.inner.num_recv_tokens
        if x.dim() == 2 and x.shape[0] == view.num_rows != M:  # padded to num_worst_tokens: drop the padding
            x = x[:M]
            topk_weights = topk_weights[:M] if topk_weights is not None else None
        biases = _biases(bias, view.inner.num_tokens, x)
        self._check_normal(x.shape[1], view.num_experts)
        self._headers.agree(hidden=x.shape[1], num_experts=view.num_experts, handle=view.inner.seq)
        inner = self._normal(x.shape[1], view.num_experts)
        try:
            combined, weights, _ = inner.combine(x if not biases else x.float(), view.inner, topk_weights)
        finally:
            self._members.follow()
        if biases:
            combined = sum((b.float() for b in biases), combined).to(x.dtype)
        return combined, weights, pending_event(Pending(), async_finish, (combined,))

    # -- low-latency mode -------------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """Nothing to clean: ubep's flags carry call epochs, so stale slots are never mistaken for new."""

    @opens("ll_dispatch")
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
        """(recv_x, recv_count, handle, event, hook); FP8 by default, as in DeepEP.

        FP8 scales come back column-major in their last two dimensions. With round_scale
        they are powers of two, and with use_ue8m0 also packed into int32 [L, R * T, H // 512].
        The wait-cost statistics are not measured (the tensor is left as it is).
        """
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 holds power-of-two scales only)")
        if use_fp8 and use_ue8m0 and x.shape[-1] % (fp8.BLOCK * scales.BLOCKS_PER_WORD):
            raise ValueError(
                f"use_ue8m0=True needs a hidden size that is a multiple of 512, got {x.shape[-1]}"
            )
        T = num_max_dispatch_tokens_per_rank
        self._check_low_latency(x.shape[1], num_experts, T)
        self._headers.agree(hidden=x.shape[1], num_experts=num_experts, num_max_dispatch_tokens_per_rank=T)
        inner = self._low_latency(x.shape[1], num_experts, num_max_dispatch_tokens_per_rank)
        pow2 = use_fp8 and round_scale  # quantized on arrival: ubep's wire FP8 uses amax / 448 scales
        try:
            got = inner.low_latency_dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                use_fp8 and not pow2,
                async_finish,
                return_recv_hook,
            )
        finally:
            self._members.follow()
        recv_x, steps = _ll_outputs(got.recv_x, use_fp8, pow2, use_ue8m0)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            steps.append(lambda: stats.add_(got.recv_count.to(stats.dtype)))

        def receive() -> None:
            try:
                got.hook()
                got.event.wait()
            finally:
                self._members.follow()
            for step in steps:
                step()

        both = Pending(receive)
        if not (async_finish or return_recv_hook):
            both.wait()
        keep = (x, topk_idx, *(recv_x if isinstance(recv_x, tuple) else (recv_x,)), got.recv_count)
        event = EventOverlap(EventHandle(both), keep) if async_finish else EventOverlap()
        hook = both.wait if return_recv_hook else _nothing
        return recv_x, got.recv_count, LowLatencyView(got.handle), event, hook

    @opens("ll_combine")
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyView,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
        """(combined_x, event, hook): the weighted sum of each token's expert outputs.

        zero_copy=True combines what the caller wrote into
        `get_next_low_latency_combine_buffer(handle)`, not x. use_logfmt=True (DeepEP's
        10-bit wire format) is accepted and combined at full precision.
        """
        if zero_copy and use_logfmt:
            raise ValueError("zero_copy=True and use_logfmt=True cannot be combined (as in DeepEP)")
        inner_handle = _ll_inner(handle)
        H, E, T = inner_handle.hidden, inner_handle.num_experts, inner_handle.num_max_dispatch_tokens_per_rank
        self._check_low_latency(H, E, T)
        self._headers.agree(
            hidden=H, num_experts=E, num_max_dispatch_tokens_per_rank=T, handle=inner_handle.seq
        )
        inner = self._ll_for(inner_handle)
        if zero_copy:
            x = self._combine_input(inner_handle)
        try:
            got = inner.low_latency_combine(
                x, topk_idx, topk_weights, inner_handle, async_finish, return_recv_hook, out
            )
        finally:
            self._members.follow()
        keep = (x, topk_idx, topk_weights, got.combined_x)
        event = EventOverlap(EventHandle(got.event), keep) if async_finish else EventOverlap()
        return got.combined_x, event, got.hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyView) -> torch.Tensor:
        """The bf16 [L, R * T, H] tensor a `zero_copy=True` combine reads; fill it with the expert outputs."""
        return self._combine_input(_ll_inner(handle))

    def _combine_input(self, handle: LowLatencyHandle) -> torch.Tensor:
        inner = self._ll_for(handle)
        L, M = handle.num_local_experts, self.group_size * handle.num_max_dispatch_tokens_per_rank
        key = (handle.hidden, handle.num_experts, handle.num_max_dispatch_tokens_per_rank)
        if key not in self._combine_inputs:
            self._combine_inputs[key] = torch.zeros(
                L, M, handle.hidden, dtype=torch.bfloat16, device=inner.device
            )
        return self._combine_inputs[key]

    def _ll_for(self, handle: LowLatencyHandle) -> UbepBuffer:
        return self._low_latency(handle.hidden, handle.num_experts, handle.num_max_dispatch_tokens_per_rank)

    # -- the shrink-mode mask buffer ---------------------------------------------------------------

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask `rank_to_mask` (mask=True): later calls neither send to it nor wait for it.

        Collective among the ranks that stay (every one of them calls it with the same rank), in
        both modes and at any point between calls; the masked rank itself, if alive, leaves.
        Masking a rank masked already does nothing. Unmasking is refused: ubep.Buffer has no rejoin
        yet (NotImplementedError).
        """
        self._check_shrink()
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must lie in [0, {self.group_size}), got {rank_to_mask}")
        if not mask:
            if rank_to_mask in self._members.masked:
                raise NotImplementedError(NO_REJOIN)
            return
        if rank_to_mask not in self._members.masked:
            self._members.mask([rank_to_mask])

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill `mask_status` ([num_ranks] ints) with 1 for masked ranks, 0 for the others."""
        self._check_shrink()
        if mask_status.dim() != 1 or mask_status.numel() != self.group_size:
            shape = tuple(mask_status.shape)
            raise ValueError(f"mask_status must be a [{self.group_size}] tensor, got {shape}")
        mask_status.copy_(self._members.masked_R(mask_status.device))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank: possible only while none is masked (NotImplementedError otherwise: no rejoin
        yet)."""
        self._check_shrink()
        if self._members.masked:
            raise NotImplementedError(NO_REJOIN)

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise ValueError("the mask buffer needs a Buffer built with enable_shrink=True")

    def _check_unmasked(self, key: tuple) -> None:
        """A buffer for a new shape is built by every rank: impossible once a rank is masked."""
        if self._members.masked:
            raise RuntimeError(
                f"rank(s) {sorted(self._members.masked)} are masked, so no buffer for a new shape {key} can "
                "be built (that takes every rank); use the shapes met before the mask"
            )

    # -- lifetime ---------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release every shared resource (DeepEP's explicit destruction)."""
        buffers = list(self._buffers.values())
        self._buffers.clear()  # the dict `_members` masks in
        self._combine_inputs, self._raw = {}, {}
        for inner in buffers:
            inner.close()
        self._members.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def _too_many(num_tokens: int, capacity: int, num_nvl_bytes: int, hidden: int) -> ValueError:
    """x had more tokens than the bytes hold (DeepEP streams any count through its ring buffer; ubep holds
    a call's tokens at once)."""
    return ValueError(
        f"x has {num_tokens} tokens; num_nvl_bytes={num_nvl_bytes} holds {capacity} tokens per rank at "
        f"hidden {hidden} (Config.get_nvl_buffer_size_hint sizes for {HINT_TOKENS}): pass more bytes"
    )


def _nothing() -> None:
    """The hook of a call that already received."""


def _validated_topk(topk_idx, num_experts: int, num_ranks: int) -> torch.Tensor:
    rows = topk_idx.shape[0] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() else 0
    return validate.topk_idx(topk_idx, rows, num_experts, _max_topk(num_ranks))


def _normal_view(handle) -> NormalHandle:
    if not isinstance(handle, NormalHandle):
        raise TypeError(f"handle must come from this Buffer's dispatch, got {type(handle).__name__}")
    return handle


def _ll_inner(handle) -> LowLatencyHandle:
    if isinstance(handle, LowLatencyView):
        return handle.inner
    if isinstance(handle, LowLatencyHandle):
        return handle
    raise TypeError(f"handle must come from low_latency_dispatch, got {type(handle).__name__}")


def _pad(t: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """t [M, ...] with rows - M more rows of `fill` (t itself when nothing is missing)."""
    if t.shape[0] == rows:
        return t
    padded = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    return padded


def _pad_payload(recv_x, rows: int):
    if fp8.is_pair(recv_x):
        return _pad(recv_x[0], rows, 0), _pad(recv_x[1], rows, 0)
    return _pad(recv_x, rows, 0)


def _biases(bias, num_tokens: int, x: torch.Tensor) -> list[torch.Tensor]:
    """The 0, 1 or 2 bias tensors, each checked to be [N, H]."""
    if bias is None:
        return []
    biases = [bias] if isinstance(bias, torch.Tensor) else list(bias)
    if len(biases) > 2:
        raise ValueError(f"bias takes one tensor or a pair, got {len(biases)}")
    for i, b in enumerate(biases):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (num_tokens, x.shape[1]):
            raise ValueError(
                f"bias[{i}] must be a [{num_tokens}, {x.shape[1]}] tensor (one row per home token)"
            )
    return biases


def _ll_outputs(recv, use_fp8: bool, pow2: bool, ue8m0: bool) -> tuple[object, list[Callable[[], None]]]:
    """DeepEP's received tensors, and the steps that fill them once ubep's receive half has run."""
    if not use_fp8:
        return recv, []
    if not pow2:
        values, raw_scales = recv
        scales_LMB = scales.column_major(torch.empty_like(raw_scales))
        return (values, scales_LMB), [lambda: scales_LMB.copy_(raw_scales)]
    L, M, H = recv.shape
    values = torch.empty(L, M, H, dtype=fp8.VALUE_DTYPE, device=recv.device)
    width = H // fp8.BLOCK // (scales.BLOCKS_PER_WORD if ue8m0 else 1)
    out_scales = scales.column_major(
        torch.empty(L, M, width, dtype=torch.int32 if ue8m0 else torch.float32, device=recv.device)
    )

    def quantize_arrived() -> None:
        q_values, q_scales = scales.quantize_pow2(recv.view(L * M, H))
        values.copy_(q_values.view(L, M, H))
        packed = scales.pack_ue8m0(q_scales) if ue8m0 else q_scales
        out_scales.copy_(packed.view(L, M, width))

    return (values, out_scales), [quantize_arrived]

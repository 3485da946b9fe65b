"""What every protocol shares: the exchange interfaces (normal and low-latency mode), the sizing,
the send plan and what a dispatch receives, the payloads' wire codes and how rows sit in a byte
region.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ubep import fp8
from ubep.calls import CallId
from ubep.layout import ExpertPlacement, destination_major
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.base import Agreement, Record

# Wire codes for the dtypes a payload may carry (stored next to the data).
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4, torch.uint8: 5}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_ITEMSIZE = 4  # bytes per element of the widest payload dtype (float32)
CODE_RANGE = (min(CODE_DTYPES), max(CODE_DTYPES))


@dataclass(frozen=True, slots=True)
class SendPlan:
    """The sender's side of one dispatch, from the layout.

    An FP8 payload is two planes, values (`x_NH`, e4m3) and `scales_NS` (float32,
    S = H // 128), moved apart on a heap into their own outputs; the collective
    paths, which move one tensor, pack them into byte rows (`packed_rows`).
    """

    x_NH: torch.Tensor
    topk_idx_NK: torch.Tensor | None  # None: cached dispatch (routing from the handle)
    topk_weights_NK: torch.Tensor | None
    is_token_in_rank_NR: torch.Tensor
    send_counts_R: torch.Tensor  # int64 [R]
    scales_NS: torch.Tensor | None = None  # FP8 scales; None for bf16 / fp32 payloads
    # > 0: every receive output has this many rows (padding after the rows received), so a device
    # dispatch learns its receive size without reading a count on the host (DeepEP's num_worst_tokens)
    num_worst_tokens: int = 0
    # True (the Triton halves, `UbepTriton.layout_by_send`): is_token_in_rank_NR and send_counts_R are
    # outputs, which the send half fills from topk_idx_NK after checking its values (no host read)
    layout_by_send: bool = False

    def send_tokens(self) -> tuple[torch.Tensor, ...]:
        """Per destination rank, the ascending indices of the tokens it gets."""
        return send_tokens(self.is_token_in_rank_NR, self.send_counts_R)

    def packed_rows(self) -> torch.Tensor:
        """The payload as one tensor of rows: x itself, or FP8 values then scales as byte rows."""
        return self.x_NH if self.scales_NS is None else fp8.to_rows(self.x_NH, self.scales_NS)


@dataclass(frozen=True, slots=True)
class Received:
    """The receiver's side of one dispatch; rows in source-rank-then-token order."""

    recv_x_MH: torch.Tensor
    recv_topk_idx_MK: torch.Tensor | None
    recv_topk_weights_MK: torch.Tensor | None
    route: RecvRoute
    recv_scales_MS: torch.Tensor | None = None  # FP8 scales, beside recv_x_MH's values
    rows_per_expert_L: np.ndarray | None = None  # rows each local expert got, where the protocol counted them

    def padded(self, rows: int) -> Received:
        """This result with every output `rows` rows long (num_worst_tokens): the rows received,
        then padding (recv_x and scales 0, top-k ids -1, weights 0). A device dispatch pads in its
        kernels already, and this returns it as it is (shapes only: nothing read on the host)."""
        M = self.recv_x_MH.shape[0]
        if M > rows:
            raise more_than_worst(M, rows)
        if M == rows:
            return self

        def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            return None if t is None else torch.cat([t, t.new_zeros(rows - M, *t.shape[1:]).fill_(value)])

        return replace(
            self,
            recv_x_MH=pad(self.recv_x_MH, 0),
            recv_topk_idx_MK=pad(self.recv_topk_idx_MK, -1),
            recv_topk_weights_MK=pad(self.recv_topk_weights_MK, 0),
            recv_scales_MS=pad(self.recv_scales_MS, 0),
        )

    @classmethod
    def unpacking(cls, plan: SendPlan, rows_MX: torch.Tensor, *rest) -> Received:
        """What `packed_rows` rows became on arrival, split back into planes where FP8."""
        if plan.scales_NS is None:
            return cls(rows_MX, *rest)
        values_MH, scales_MS = fp8.from_rows(rows_MX, plan.x_NH.shape[1])
        return cls(values_MH, *rest, recv_scales_MS=scales_MS)


def more_than_worst(rows: int, num_worst_tokens: int) -> ValueError:
    """A dispatch received more rows than its num_worst_tokens allows (every engine's words)."""
    return ValueError(
        f"dispatch: this rank receives {rows} rows, more than num_worst_tokens={num_worst_tokens}; "
        "pass at least num_tokens * num_ranks"
    )


class Exchange(ABC):
    """A normal-mode protocol bound to its memory or fabric: the two halves of an EP layer's traffic.

        Buffer.dispatch -> validate -> plan -> [exchange.dispatch] -> Received -> results

    Every exchange moves rows (`dispatch`, `combine`), tells its peers when the Buffer gives up on a
    call (`abort`) and releases what it holds (`close`). What only some can do is asked through the
    methods and attributes below, whose defaults here say "not this one"; the Buffer never probes.
    """

    name: str
    # How each call half runs, in words (`Buffer.explain`): compiled, Triton kernels, or Python.
    halves: str = "step by step in Python"
    # What crosses hosts and how, in words (`Buffer.explain`); None inside one host.
    across_hosts: str | None = None
    # The send half derives the layout from topk_idx and checks its values itself (the Triton
    # halves), so the Buffer reads none of them on the host (`SendPlan.layout_by_send`).
    layout_by_send: bool = False

    @abstractmethod
    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received: ...

    @abstractmethod
    def combine(
        self, call: CallId, x_MH: torch.Tensor, handle: DispatchHandle, topk_weights_MK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    @abstractmethod
    def abort(self, call: CallId) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def check(self) -> None:
        """Raise the first error the device deferred since the last check (capturable halves only)."""
        return None  # nothing deferred, nothing held: the default of most exchanges

    def mask(self, ranks: Collection[int], seq: int) -> int:
        """Leave `ranks` out of every call after the one all staying ranks agree on; returns its seq.
        Only exchanges that can leave a rank out override this."""
        raise NotImplementedError(
            f"masking ranks needs a shared heap (transport 'shm' or 'virtual') or the fabric; "
            f"this Buffer's {self.name} exchange runs collectives, which cannot leave a rank out"
        )

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        """Inside call `seq`, failed with `error`: agree with the staying ranks on whom to leave out
        (`Transport.agree_to_mask`). None where `error` is no peer's failure, or where this exchange
        cannot leave a rank out inside a call (the caller raises `error`)."""
        return None

    def agree(self, value: int, phase: str) -> dict[int, int]:
        """Collective among the staying ranks, between calls: every staying rank's `value` (an int64),
        within the deadline (`Transport.agree`). Only exchanges that can mask override this."""
        raise NotImplementedError(f"{phase}: this Buffer's {self.name} exchange cannot leave a rank out")

    def admissions(self, seq: int, boundary: bool) -> frozenset[int]:
        """Before call `seq`, ranks being masked: where `boundary` (a call that takes no handle), the
        masked ranks whose restarted processes every staying rank takes back in before it
        (`Transport.admissions`); none where no rank can rejoin."""
        return frozenset()

    def admit(self, ranks: Collection[int], seq: int) -> frozenset[int]:
        """Take the restarted `ranks` back in before call `seq`, with every staying rank; returns those
        taken in (none where a joiner died meanwhile: they stay masked)."""
        raise NotImplementedError(f"this Buffer's {self.name} exchange cannot take a rank back in")

    def join(self, deadline_s: float, stamp: Callable[[str], None]) -> Agreement:
        """This process restarts a masked rank: join the staying ranks at a call they agree on;
        returns the ranks still masked and the seq of the call all resume after. `stamp(stage)` as
        the transport's `join`."""
        raise NotImplementedError(f"this Buffer's {self.name} exchange cannot take a rank back in")


class LowLatencyExchange(ABC):
    """Low-latency mode bound to its memory or fabric: each `*_send` sends now and returns the
    receive half, which the Buffer runs at once, on `event.wait()` or from the hook.

        Buffer.low_latency_dispatch -> validate -> plan -> [dispatch_send] -> receive half -> results
    """

    name: str
    halves: str | None = None  # how each call half runs, in words (`Buffer.explain`); None: say nothing
    # The compiled halves (numba, Triton): the send half checks topk_idx and the handle and routes
    # from them, so the Buffer reads no value on the host and builds no plan (wire rows to
    # `dispatch_send`, the combine through `combine_rows`).
    routes_in_halves: bool = False
    on_device: bool = False  # the halves are Triton kernels (device epochs, `check`)
    # `finish_combine` can finish a combine's receive half from the rows the staying ranks put
    finishes_combine: bool = False

    @abstractmethod
    def dispatch_send(self, call: CallId, plan, out) -> Callable[[], None]:
        """`plan`: `ubep.protocols.ll.plans.LLDispatchPlan` (or `WireRows` on the device); `out`: the
        `LLDispatchOut` the receive half fills."""

    @abstractmethod
    def combine_send(self, call: CallId, plan, out_NH: torch.Tensor) -> Callable[[], None]:
        """`plan`: `ubep.protocols.ll.plans.LLCombinePlan`; `out_NH` receives the weighted sums."""

    @abstractmethod
    def abort(self, call: CallId, kind: str) -> None: ...

    def combine_rows(
        self, call: CallId, x_LMH: torch.Tensor, w_NK: torch.Tensor, handle, out_NH: torch.Tensor, idx_NK
    ) -> Callable[[], None]:
        """`routes_in_halves` only: combine's send half from the expert outputs and the handle alone."""
        raise NotImplementedError(f"{self.name}: combine_rows needs halves that route (routes_in_halves)")

    def check(self) -> None:
        """Raise the first error the device deferred since the last check (capturable halves only)."""
        return None  # nothing deferred, nothing held: the default of most exchanges

    def resume(self, seq: int) -> None:
        """After a mask: the calls up to `seq` are over, so halves they hold are free again."""
        return None  # nothing deferred, nothing held: the default of most exchanges

    def finish_combine(self, call: CallId, got) -> None:
        """`finishes_combine` only: the receive half of combine `call`, which failed on a peer masked
        since, entered again with `got` (`ubep.plans.LLCombineInputs` taken after the mask: the
        masked ranks' entries dropped), over the rows the staying ranks put in that call."""
        raise NotImplementedError(f"{self.name}: a combine cannot be finished in place here")


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizing:
    """Shapes every rank agreed on at construction."""

    hidden: int
    capacity: int  # T: most tokens a rank passes to one call
    max_topk: int
    placement: ExpertPlacement

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def row_bytes(self) -> int:
        return self.hidden * MAX_ITEMSIZE


def send_tokens(is_token_in_rank_NR: torch.Tensor, send_counts_R: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per destination rank, the ascending indices of the tokens it gets (an all-to-all's send order)."""
    _, token_n = destination_major(is_token_in_rank_NR)
    return torch.split(token_n, send_counts_R.tolist())


def rows(region_XB: torch.Tensor, n: int, dtype: torch.dtype, width: int, first: int = 0) -> torch.Tensor:
    """Rows [first, first + n) of a byte region holding packed [*, width] rows of `dtype`.

    The region's declared row size B is the widest dtype's; narrower rows are
    packed (row i at byte i * width * itemsize), so every view is contiguous.
    """
    row_bytes = width * dtype.itemsize
    flat = region_XB.view(-1)
    return flat[first * row_bytes : (first + n) * row_bytes].view(dtype).view(n, width)


def spread(record: Record, peers: Sequence[int], num_ranks: int) -> dict[str, np.ndarray]:
    """`read_all`'s rows for `peers`, each moved to its rank's row of `num_ranks`; the rows of ranks
    not read (masked ones) are zero: no tokens, no rows."""
    out = {}
    for name, rows_P in record.items():
        out[name] = np.zeros((num_ranks, *rows_P.shape[1:]), dtype=rows_P.dtype)
        out[name][list(peers)] = rows_P
    return out

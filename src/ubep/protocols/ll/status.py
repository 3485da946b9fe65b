"""Low-latency halves' status words turned into the exceptions of the torch statement
(`ubep.protocols.ll.exchange`).

The compiled halves (numba: `ubep.protocols.ll.numba_halves`; Triton: `triton_halves`) end with a
code and, on an error, status[1:5] = (peer, what it sent, ..., expected); both raise through here so
that every engine reports a bad peer in the same words. The codes are the halves' (tests hold them
equal); this module imports neither numba nor triton.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.errors import PeerDataError
from ubep.protocols.ll.codes import (  # noqa: F401 (the codes are this module's words too)
    DONE,
    E_COUNTS,
    E_EXPERT,
    E_FIELD,
    E_FORMAT,
    E_LAYOUT,
    E_MINE,
    E_OTHER_TOPK,
    E_REJECTED,
    E_REPEATED,
    E_RETURNED,
    E_T,
    E_TOKENS,
    E_TOO_MANY,
    E_UNRECEIVED,
    WAITING,
)
from ubep.transport.base import Transport
from ubep.transport.heap import complaint
from ubep.validate import bad_expert, repeated_in_row
from ubep.waiting import rejected_input


def error(
    t: Transport, blocks, call: CallId, phase: str, code: int, status: np.ndarray, mine: int
) -> Exception:
    """The exception for a half's error status in `phase`; `mine` is this call's T (dispatch) or
    wire dtype code (combine)."""
    peer, a, b, c = (int(v) for v in status[1:5])
    if code in OWN_INPUT:
        return OWN_INPUT[code](a, b, c)
    if code == E_TOO_MANY:
        return too_many_returned(peer, a, b)
    if code == E_MINE:
        what = "dispatch" if call.kind == "ll_dispatch" else "combine"
        return RuntimeError(
            f"low-latency {what} #{call.epoch}: call #{call.epoch - 2} still awaits its receive half "
            "(hook or event.wait()); at most two low-latency calls of a kind may be in flight"
        )
    if code == E_REJECTED:
        return rejected_input(phase, peer)
    if code == E_FIELD:
        header = blocks.sent if call.kind == "ll_dispatch" else blocks.returned
        return t.bad_data(call, peer, complaint(header, header.fields[b], peer, a))
    if code == E_TOKENS:
        return t.bad_data(call, peer, f"low-latency dispatch: rank {peer} sent token indices out of range")
    messages = {
        E_T: f"low-latency dispatch: rank {peer} used T={a}, this rank T={mine}",
        E_FORMAT: f"low-latency dispatch: rank {peer} sent another payload format "
        "(all ranks must pass the same dtype and use_fp8)",
        E_COUNTS: f"low-latency dispatch: rank {peer} announced counts outside [0, {mine}]",
        E_RETURNED: f"low-latency combine: rank {peer} returned {a} rows (dtype code {b}), "
        f"expected {c} (code {mine})",
    }
    return PeerDataError(messages[code])


# This rank's own input, checked in the compiled send halves: the host's exceptions, from (a, b, c).
OWN_INPUT = {
    E_EXPERT: lambda value, num_experts, row: bad_expert(num_experts, value),
    E_REPEATED: lambda expert, _, row: repeated_in_row(row, expert),
    E_UNRECEIVED: lambda *_: ValueError(
        "handle: its dispatch was not received yet; call its hook or event.wait() first"
    ),
    E_OTHER_TOPK: lambda _a, _b, row: ValueError(
        f"topk_idx must be the one passed to the low_latency_dispatch that made handle (row {row} differs)"
    ),
    E_LAYOUT: lambda j, home, _: ValueError(
        f"handle: layout_range[{j}, {home}] names rows its dispatch did not receive (the handle was changed)"
    ),
}


def too_many_returned(home: int, rows: int, most: int) -> PeerDataError:
    """An expert rank returns each home at most `most` rows (its run of the home's back slots); more
    means the home's dispatch sent it a token twice for one expert, or too many tokens."""
    return PeerDataError(
        f"low-latency combine: rank {home} sent this rank {rows} rows in the dispatch, more than the "
        f"{most} its tokens can select here"
    )

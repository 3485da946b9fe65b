"""Low-latency halves' status words turned into the exceptions of `ubep.protocols.ll`'s torch statement.

The compiled halves (numba: `ubep.engine.ll_halves`; Triton: `ubep.engine.ll_triton`) end with a
code and, on an error, status[1:5] = (peer, what it sent, ..., expected); both raise through here so
that every engine reports a bad peer in the same words. The codes are the halves' (tests hold them
equal); this module imports neither numba nor triton.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.errors import PeerDataError
from ubep.transport.base import Transport
from ubep.transport.heap import complaint
from ubep.waiting import AbortNotice, PeerAbortedError

DONE, WAITING = 0, 1
E_FIELD = 2  # a header word outside its field's bounds: (peer, value, field index)
E_REJECTED = 3  # the peer rejected this call: (peer)
E_T = 4  # dispatch: the peer used another T: (peer, its T)
E_FORMAT = 5  # dispatch: the peer sent another payload format
E_COUNTS = 6  # dispatch: the peer announced counts above this call's T
E_TOKENS = 7  # dispatch: the peer's slot infos name tokens out of range
E_RETURNED = 8  # combine: the peer returned another row count or dtype: (peer, count, dtype, expected)
E_MINE = 9  # this rank's own reuse word says an older call still awaits its receive half


def error(
    t: Transport, blocks, call: CallId, phase: str, code: int, status: np.ndarray, mine: int
) -> Exception:
    """The exception for a half's error status in `phase`; `mine` is this call's T (dispatch) or
    wire dtype code (combine)."""
    peer, a, b, c = (int(v) for v in status[1:5])
    if code == E_MINE:
        what = "dispatch" if call.kind == "ll_dispatch" else "combine"
        return RuntimeError(
            f"low-latency {what} #{call.epoch}: call #{call.epoch - 2} still awaits its receive half "
            "(hook or event.wait()); at most two low-latency calls of a kind may be in flight"
        )
    if code == E_REJECTED:
        return PeerAbortedError(
            phase,
            peer,
            AbortNotice("it rejected its input for this call; see that rank's error"),
        )
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

"""UBEP dispatch halves' status words turned into the exceptions of the torch statement
(`ubep.protocols.ubep.exchange`).

The compiled halves (numba: `ubep.protocols.ubep.numba_halves`; Triton: `triton_halves`) end with a
code and, on an error, status[1:6] = (peer, what it sent, ..., expected); both raise through here so
that every engine reports a bad peer in the same words. This module imports neither numba nor triton.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.errors import PeerDataError
from ubep.protocols.base import CODE_DTYPES, more_than_worst
from ubep.protocols.combine.status import OWN_INPUT
from ubep.protocols.ubep import codes as k
from ubep.transport.base import Transport
from ubep.transport.heap import complaint
from ubep.waiting import rejected_input


def error(
    t: Transport, blocks, call: CallId, code: int, status: np.ndarray, dtype, K: int, seq: int
) -> Exception:
    """The exception for a dispatch half's error status; (dtype, K, seq) are this rank's call's payload
    dtype, top-k and dispatch seq, for the message."""
    peer, a, b, c, _ = (int(v) for v in status[1:6])
    if code in OWN_INPUT:
        return OWN_INPUT[code](a, b, c)
    if code == k.E_REJECTED:
        return rejected_input("dispatch (routing)", peer)
    if code == k.E_TOPK:
        return PeerDataError(f"dispatch: rank {peer} routed with top-k {a}, this rank with {K}")
    if code == k.E_WORST:
        return more_than_worst(a, b)
    if code == k.E_FIELD:
        return t.bad_data(call, peer, complaint(blocks.route, blocks.route.fields[b], peer, a))
    messages = {
        k.E_DTYPE: f"dispatch: rank {peer} sent {CODE_DTYPES.get(a)}, this rank {dtype}",
        k.E_LIST: f"dispatch: rank {peer} listed tokens outside [0, {a})",
        k.E_EXPERT: f"dispatch: rank {peer} routed to expert ids outside [-1, {a})",
        k.E_NONE_LOCAL: f"dispatch: rank {peer} listed a token for this rank that selects none "
        "of its experts",
        k.E_COUNT: f"dispatch: rank {peer} sends {a} rows here, this rank's handle expects {b} "
        "(all ranks must pass handles of the same dispatch)",
        k.E_SHORT: f"dispatch: rank {peer} sent {a} tokens, fewer than routed here",
    }
    return t.bad_data(call, peer, messages[code])

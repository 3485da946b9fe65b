"""BSP dispatch phases' status words turned into the exceptions of the torch statement
(`ubep.protocols.bsp.exchange`).

The compiled phases (numba: `ubep.protocols.bsp.numba_halves`; Triton: `triton_halves`) end with a
code and, on an error, status[1:5]; both raise through here, so that every engine reports a bad peer
in the same words. This module imports neither numba nor triton.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.errors import PeerDataError
from ubep.protocols.base import CODE_DTYPES, more_than_worst
from ubep.protocols.bsp import codes as k
from ubep.protocols.combine.status import OWN_INPUT
from ubep.transport.base import Transport
from ubep.transport.heap import complaint
from ubep.waiting import rejected_input


def error(
    t: Transport, blocks, call: CallId, code: int, status: np.ndarray, pending: np.ndarray, dtype, K: int
) -> Exception:
    """The exception for a phase's error status; (dtype, K) are this rank's call's, for the message."""
    peer, a, b, c = (int(v) for v in status[1:5])
    if code in OWN_INPUT:
        return OWN_INPUT[code](a, b, c)
    if code == k.E_REJECTED:
        return rejected_input("dispatch (flag verification)", peer)
    if code == k.E_MISSING:
        missing = pending[:peer].tolist()
        t.check_in_step(call, "dispatch (flag verification)")  # a peer in another call: say so
        return PeerDataError(f"dispatch (flag verification): no tokens from rank(s) {missing}")
    if code == k.E_WORST:
        return more_than_worst(a, b)
    if code == k.E_FIELD:
        header = blocks.counts if c else blocks.staged
        return t.bad_data(call, peer, complaint(header, header.fields[0 if c else b], peer, a))
    if code == k.E_FORMAT:
        theirs = f"{CODE_DTYPES.get(a)} with top-k {b}"
        return t.bad_data(
            call, peer, f"dispatch: rank {peer} sent {theirs}, this rank {dtype} with top-k {K}"
        )
    if code == k.E_TOKENS:
        return t.bad_data(call, peer, f"dispatch: rank {peer} sent source token indices outside [0, {a})")
    return t.bad_data(call, peer, f"dispatch: rank {peer} sent local expert ids outside [-1, {a})")

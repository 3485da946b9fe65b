"""Normal mode's shared status words turned into exceptions: the combine's (every engine reports a bad
expert rank in the words of `ubep.protocols.combine.torch_halves`), and this rank's own top-k as the Triton
send halves of ubep and bsp check it. This module imports neither numba nor triton.
"""

from __future__ import annotations

import numpy as np

from ubep.calls import CallId
from ubep.protocols.base import CODE_DTYPES
from ubep.protocols.combine import codes as k
from ubep.protocols.combine.blocks import BackBlocks
from ubep.transport.base import Transport
from ubep.transport.heap import complaint
from ubep.validate import bad_expert, repeated_in_row

# This rank's own topk_idx, checked in a Triton send half: the host's exceptions, from (a, b, c).
OWN_INPUT = {
    k.E_OWN_EXPERT: lambda value, num_experts, row: bad_expert(num_experts, value),
    k.E_OWN_REPEATED: lambda expert, _, row: repeated_in_row(row, expert),
}


def combine_error(
    t: Transport, back: BackBlocks, call: CallId, code: int, status: np.ndarray, dtype, K: int, seq: int
) -> Exception:
    """The exception for a combine half's error status; (dtype, K, seq) are this rank's call's payload
    dtype, top-k and dispatch seq, for the message."""
    peer, a, b, c, d = (int(v) for v in status[1:6])
    if code == k.E_FIELD:
        return t.bad_data(call, peer, complaint(back.back, back.back.fields[b], peer, a))
    messages = {
        k.E_OTHER_CALL: f"combine: rank {peer} combines the rows of call #{a}, this rank those of #{seq} "
        "(all ranks must pass the handle of the same dispatch)",
        k.E_ROWS: f"combine: rank {peer} returned {a} rows of {CODE_DTYPES.get(b)} (top-k {c}), "
        f"expected {d} of {dtype} (top-k {K})",
    }
    return t.bad_data(call, peer, messages[code])

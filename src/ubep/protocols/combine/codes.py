"""The status codes normal mode's call halves share (ubep's and bsp's, and the combine both run), and
the status words they fill. Free of numba and Triton, so every side can import them.

Status words: status[0] is the code, status[1] the peer, status[2:6] what it sent and what was
expected (see each code); the Triton halves add status[WAITING_WORD]: 1 + a peer a wait ran out on.
"""

DONE, WAITING = 0, 1
E_FIELD = 2  # a header word outside its field's bounds: (peer, value, field index)
# Codes 3 to 9 are each protocol's own dispatch codes (`ubep.protocols.ubep.codes`, `bsp.codes`).
E_OTHER_CALL = 10  # combine: the peer combines another dispatch's rows: (peer, its dispatch seq)
E_ROWS = (
    11  # combine: the peer returned another row count or format: (peer, rows, its dtype, its K, expected)
)
E_WORST = 12  # dispatch (Triton halves): more rows than num_worst_tokens: (-1, rows, num_worst_tokens)
E_REJECTED = 13  # dispatch: the peer rejected its own input for this call (its header says so): (peer)
# This rank's own topk_idx, checked in the Triton send half (the host reads none of its values there):
E_OWN_EXPERT = 14  # a value outside [-1, E): (this rank, the value, E, its row)
E_OWN_REPEATED = 15  # a row lists an expert twice: (this rank, the expert, 0, the row)
WAITING_WORD = 6  # the Triton halves' status[6]: 1 + the peer still awaited (0: none)

# A rejected call's header word (ubep: the route header's num_tokens; bsp: every count): no count is
# negative, so no sender's real header says it.
REJECTED = -(1 << 40)

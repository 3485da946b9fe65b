"""The status codes and block order a BSP phase shares with the host: the numba phases
(`ubep.engine.bsp_halves`), the Triton kernels (`ubep.engine.bsp_triton`) and the host that turns a
status into exceptions (`ubep.protocols.bsp_status`). Free of numba and Triton.

Status words: status[0] is the code, status[1] the peer (E_MISSING: how many are missing, listed in
`pending`), status[2:5] what it sent (see each code).
"""

# Blocks, in the order of `BspBlocks.all()` (the address table's second axis); the back blocks follow
# (UBEP's places), then the device barrier word.
COUNTS, STAGED, STAGE_X, STAGE_SCALES, STAGE_TOKENS, STAGE_TOPK, STAGE_WEIGHTS = range(7)
BARRIER = 10

DONE, WAITING = 0, 1
E_FIELD = 2  # a header word outside its bounds: (peer, value, field index, 0 = staged / 1 = counts)
E_MISSING = 3  # after the barrier, no staging flag from status[1] ranks (in pending)
E_FORMAT = 4  # the peer staged another dtype or top-k: (peer, its dtype code, its K)
E_TOKENS = 5  # a staged source token index outside [0, T)
E_LOCAL = 6  # a staged local expert id outside [-1, L)
E_WORST = 12  # (device phases) more rows than num_worst_tokens: (-1, rows, num_worst_tokens)
# The Triton phases only (a numba rank cannot share a BSP call with a Triton rank):
E_REJECTED = 13  # the peer rejected its own input for this call (its counts record says so): (peer)
E_OWN_EXPERT = 14  # this rank's topk_idx value outside [-1, E): (this rank, the value, E, its row)
E_OWN_REPEATED = 15  # this rank's topk_idx row lists an expert twice: (this rank, the expert, 0, the row)
REJECTED = -(1 << 40)  # every count of the counts record of a call whose sender rejected its input

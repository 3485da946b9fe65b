"""The status codes and memory layout a UBEP call half shares with the host: the numba halves
(`ubep.engine.ubep_halves`), the Triton kernels (`ubep.engine.ubep_triton`) and the host that turns a
status into exceptions (`ubep.protocols.ubep_status`). Free of numba and Triton, so every side can
import them.

Status words: status[0] is the code, status[1] the peer, status[2:6] what it sent and what was
expected (see each code).
"""

# Blocks, in the order of `UbepBlocks.all()` (the address table's second axis).
ROUTE, DATA, TOPK, WEIGHTS, LISTS, X, SCALES, BACK, Y, Y_WEIGHTS = range(10)
# Route header words; back header words (prefix takes R + 1 words, dispatch follows).
R_NUM, R_DTYPE, R_TOPK, R_COUNTS = 1, 2, 3, 4
B_DTYPE, B_TOPK, B_PREFIX = 1, 2, 3

DONE, WAITING = 0, 1
E_FIELD = 2  # a header word outside its field's bounds: (peer, value, field index)
E_DTYPE = 3  # the peer's payload dtype code differs: (peer, its code)
E_TOPK = 4  # the peer routed with another top-k: (peer, its K)
E_LIST = 5  # the peer listed a token outside [0, its N): (peer, its N)
E_EXPERT = 6  # the peer's routing names an expert outside [-1, E)
E_NONE_LOCAL = 7  # the peer listed a token that selects none of this rank's experts
E_COUNT = (
    8  # cached dispatch: the peer sends another row count than the handle expects: (peer, count, expected)
)
E_SHORT = 9  # cached dispatch: the peer sent fewer tokens than routed here: (peer, its N)
E_OTHER_CALL = 10  # combine: the peer combines another dispatch's rows: (peer, its dispatch seq)
E_ROWS = (
    11  # combine: the peer returned another row count or format: (peer, rows, its dtype, its K, expected)
)
E_WORST = 12  # dispatch (device halves): more rows than num_worst_tokens: (-1, rows, num_worst_tokens)
E_REJECTED = 13  # dispatch: the peer rejected its own input for this call (its route header says so): (peer)
# This rank's own topk_idx, checked in the Triton send half (the host reads none of its values there):
E_OWN_EXPERT = 14  # a value outside [-1, E): (this rank, the value, E, its row)
E_OWN_REPEATED = 15  # a row lists an expert twice: (this rank, the expert, 0, the row)

# The route header's num_tokens of a call whose sender rejected its own input: no count is negative,
# so no sender's real header says it.
REJECTED = -(1 << 40)

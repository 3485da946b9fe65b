"""The status codes a low-latency call half returns: the numba halves, the Triton kernels and the
host that turns them into exceptions (`ubep.protocols.ll.status`) share them. Free of numba and
Triton, so every side can import them."""

DONE, WAITING = 0, 1
E_FIELD = 2  # a header word outside its field's bounds: (peer, value, field index)
E_REJECTED = 3  # the peer rejected this call: (peer)
E_T = 4  # dispatch: the peer used another T: (peer, its T)
E_FORMAT = 5  # dispatch: the peer sent another payload format
E_COUNTS = 6  # dispatch: the peer announced counts above this call's T
E_TOKENS = 7  # dispatch: the peer's slot infos name tokens out of range
E_RETURNED = 8  # combine: the peer returned another row count or dtype: (peer, count, dtype, expected)
E_MINE = 9  # this rank's own reuse word says an older call still awaits its receive half
# This rank's own inputs, checked in the compiled halves (the host does not read them there):
E_EXPERT = 10  # dispatch: a topk_idx value outside [-1, E): (this rank, the value, E, its row)
E_REPEATED = 11  # dispatch: a topk_idx row lists an expert twice: (this rank, the expert, 0, the row)
E_UNRECEIVED = 12  # combine: the handle's dispatch was not received yet
E_OTHER_TOPK = 13  # combine: topk_idx differs from the dispatch's: (this rank, 0, 0, the first row)
E_TOO_MANY = 14  # combine: a home's dispatch sent more rows than its tokens can select: (home, rows, most)
E_LAYOUT = (
    15  # combine (numba): the handle's layout_range names rows it did not receive: (this rank, j, home)
)
WAITING_WORD = 5  # the Triton halves' status[5]: 1 + the peer still awaited (0: none)

"""The status codes of UBEP's dispatch halves: the numba halves (`ubep.protocols.ubep.numba_halves`),
the Triton kernels (`triton_halves`) and the host that turns a status into exceptions (`status`)
share them; those every normal-mode half shares are `ubep.protocols.combine.codes`'. Free of numba and
Triton, so every side can import them.
"""

from ubep.protocols.combine.codes import (  # noqa: F401 (the shared codes are this module's words too)
    DONE,
    E_FIELD,
    E_OTHER_CALL,
    E_OWN_EXPERT,
    E_OWN_REPEATED,
    E_REJECTED,
    E_ROWS,
    E_WORST,
    REJECTED,
    WAITING,
    WAITING_WORD,
)

E_DTYPE = 3  # the peer's payload dtype code differs: (peer, its code)
E_TOPK = 4  # the peer routed with another top-k: (peer, its K)
E_LIST = 5  # the peer listed a token outside [0, its N): (peer, its N)
E_EXPERT = 6  # the peer's routing names an expert outside [-1, E)
E_NONE_LOCAL = 7  # the peer listed a token that selects none of this rank's experts
E_COUNT = 8  # cached dispatch: another row count than the handle expects: (peer, count, expected)
E_SHORT = 9  # cached dispatch: the peer sent fewer tokens than routed here: (peer, its N)

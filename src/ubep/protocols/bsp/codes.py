"""The status codes of BSP's dispatch phases: the numba phases (`ubep.protocols.bsp.numba_halves`),
the Triton kernels (`triton_halves`) and the host that turns a status into exceptions (`status`) share
them; those every normal-mode half shares are `ubep.protocols.combine.codes`'. Free of numba and Triton.

Status words: status[0] is the code, status[1] the peer (E_MISSING: how many are missing, listed in
`pending`), status[2:5] what it sent (see each code). E_FIELD's details: (peer, value, field index,
0 = staged / 1 = counts). E_REJECTED, E_OWN_EXPERT and E_OWN_REPEATED come from the Triton phases
only (a numba rank cannot share a BSP call with a Triton rank); REJECTED is every count of the counts
record of a call whose sender rejected its input.
"""

from ubep.protocols.combine.codes import (  # noqa: F401 (the shared codes are this module's words too)
    DONE,
    E_FIELD,
    E_OWN_EXPERT,
    E_OWN_REPEATED,
    E_REJECTED,
    E_WORST,
    REJECTED,
    WAITING,
    WAITING_WORD,
)

E_MISSING = 3  # after the barrier, no staging flag from status[1] ranks (in pending)
E_FORMAT = 4  # the peer staged another dtype or top-k: (peer, its dtype code, its K)
E_TOKENS = 5  # a staged source token index outside [0, T): (the source whose slot holds it, T)
E_LOCAL = 6  # a staged local expert id outside [-1, L): (the source whose slot holds it, L)

"""The fair-share servers' event loop (`engine.fair_share`): max-min fair rates by water-filling.

Compiled with numba where it is installed (the `fast` extra). Without it the
same loops run as plain Python: exact, and slower (the simulator, `ubep simulate` and
`ubep plan` work after a plain install).
Z: flows at one server (legend in layout.py).
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit

    COMPILED = True
except ModuleNotFoundError:  # no `fast` extra: run the loops below as Python
    COMPILED = False

    def njit(**_options):
        return lambda fn: fn


@njit(cache=True)
def water_fill(cap_Z: np.ndarray, capacity: float, rate_Z: np.ndarray) -> None:
    """Max-min fair rates into rate_Z: flows capped below an equal share keep their cap, the rest
    split what is left. Fast path: no cap below the equal share."""
    n = cap_Z.size
    if cap_Z.min() >= capacity / n:
        rate_Z[:n] = capacity / n
        return
    left = capacity
    order = np.argsort(cap_Z)
    for j in range(n):
        share = left / (n - j)
        if cap_Z[order[j]] < share:
            rate_Z[order[j]] = cap_Z[order[j]]
            left -= cap_Z[order[j]]
        else:
            for jj in range(j, n):
                rate_Z[order[jj]] = share
            break


@njit(cache=True)
def fair_queues(starts, head, size, cap, rate, done) -> None:
    """Processor sharing with rate caps, one server per segment [starts[q], starts[q + 1])."""
    for q in range(starts.size - 1):
        lo, n = starts[q], starts[q + 1] - starts[q]
        rem = size[lo : lo + n].copy()
        active = np.empty(n, dtype=np.int64)
        cap_Z, r = np.empty(n), np.empty(n)
        na, i, t = 0, 0, head[lo]
        while i < n or na > 0:
            if na == 0 and t < head[lo + i]:
                t = head[lo + i]
            while i < n and head[lo + i] <= t:
                if rem[i] <= 0.0:
                    done[lo + i] = t
                else:
                    active[na], cap_Z[na] = i, cap[lo + i]
                    na += 1
                i += 1
            if na == 0:
                continue
            water_fill(cap_Z[:na], rate[lo], r)
            dt = np.inf if i >= n else head[lo + i] - t
            for a in range(na):
                dt = min(dt, rem[active[a]] / r[a])
            t += dt
            keep = 0
            for a in range(na):
                j = active[a]
                rem[j] -= r[a] * dt
                if rem[j] <= 1e-9 * size[lo + j]:
                    done[lo + j] = t
                else:
                    active[keep], cap_Z[keep] = j, cap_Z[a]
                    keep += 1
            na = keep

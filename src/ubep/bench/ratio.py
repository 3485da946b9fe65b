"""One system's time over another's, with a 95 % interval from a paired bootstrap over rounds.

The bench times every system once a round (see `turns`), so round i of two
systems shares whatever load the host had at that moment. The ratio is
median(a) / median(b), where a[i] is one system's dispatch + combine in round
i. The interval resamples whole rounds with replacement, the same rounds for
both systems (paired: a slow round slows both, and stays in or out of the
resample for both), recomputes the ratio of medians, and takes the middle 95 %
of RESAMPLES such ratios (the percentile interval).

Shapes: R rounds, S resamples.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

RESAMPLES = 2000  # enough that the 2.5th and 97.5th percentiles move by well under 1 % between seeds
LEVEL = 0.95
SEED = 0  # a fixed seed: the same samples always give the same interval


class Ratio(NamedTuple):
    point: float  # median(a) / median(b)
    low: float  # the interval's ends
    high: float


def paired_ratio(
    a: list[float], b: list[float], *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> Ratio:
    """median(a) / median(b), and the `level` interval from resampling rounds (a[i] with b[i])."""
    a_R, b_R = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a_R.ndim != 1 or a_R.shape != b_R.shape or a_R.size == 0:
        raise ValueError(f"a and b must be one sample per round, as many of each; got {len(a)} and {len(b)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    pick_SR = np.random.default_rng(seed).integers(0, a_R.size, size=(resamples, a_R.size))
    ratios_S = np.median(a_R[pick_SR], axis=1) / np.median(b_R[pick_SR], axis=1)
    low, high = np.quantile(ratios_S, [(1 - level) / 2, (1 + level) / 2])
    return Ratio(float(np.median(a_R) / np.median(b_R)), float(low), float(high))

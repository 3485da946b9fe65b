"""Low-latency mode on a group of one: the rows go from this rank to itself.

The send half takes the copy (so later writes to x do not leak in, as with a
real transport); the receive half places it, exactly as the other transports do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ubep.calls import CallId
from ubep.engine import Engine
from ubep.protocols.base import LowLatencyExchange
from ubep.protocols.ll.plans import (
    LLCombinePlan,
    LLDispatchOut,
    LLDispatchPlan,
    gather_rows,
    place_all,
    reduce_returned,
    returned_rows,
)


class LLLocal(LowLatencyExchange):
    """Low-latency halves for a group of one: this rank's rows to itself."""

    name = "local-ll"

    def __init__(self, engine: Engine):
        self.engine = engine

    def dispatch_send(self, call: CallId, plan: LLDispatchPlan, out: LLDispatchOut) -> Callable[[], None]:
        rows_PB = gather_rows(plan.rows_NB, plan.pair_token_P)
        counts_SL = plan.counts_RL

        def receive() -> None:
            place_all(self.engine, out, counts_SL, rows_PB, plan.pair_token_P, plan.pair_k_P)

        return receive

    def combine_send(self, call: CallId, plan: LLCombinePlan, out_NH: torch.Tensor) -> Callable[[], None]:
        rows_PB = returned_rows(plan)
        return lambda: reduce_returned(self.engine, plan, rows_PB, out_NH)

    def abort(self, call: CallId, kind: str) -> None:
        pass

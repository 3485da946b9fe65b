"""The DeepEP layers' call header: one fixed-size all-gather opens every call.

A call of `deep_ep.Buffer` or `ElasticBuffer` runs several collectives whose sizes depend on
its shapes: DeepEP's notify step (every rank's counts), building a ubep.Buffer for a shape met
for the first time, the ubep calls themselves. A rank that rejected its input and skipped them,
or that calls with other shapes (num_experts 4 here, 8 there), pairs its collectives with the
wrong ones of its peers: wrong rows with no error, a hang, or gloo ending the process ("Received
data size doesn't match expected size"). So every call first all-gathers `WORDS` int64 words,
the same size on every rank and for every call, before anything else:

    status, kind, seq, then the call's fields, a word each (-1 where the call has fewer)
    rank 1 rejects:  [REJECTED, dispatch, 3, -1, -1, ...]

Every rank reaches the same verdict: a rank that rejected its input makes its peers raise
`PeerAbortedError` naming it; calls of different kinds (or a skipped call) raise
`PeerDataError`; a field that differs raises `ConfigMismatchError` naming it and which ranks hold
which value. Every rank spent the call either way, so the next call is exact. A method opens
with the header (`@opens`); checks that may fail on one rank alone run first, then `agree`, then
the collectives:

    @opens("dispatch")
    def dispatch(self, x, ...):
        idx = validate.topk_idx(...)                   # raising here joins as REJECTED
        self._headers.agree(hidden=H, num_experts=E)
        counts = all_gather(...)                        # sizes agreed on every rank

Once ranks are masked (`members.Members`), the exchange runs among the staying ranks alone.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ubep.compat.deep_ep.members import Members
from ubep.errors import ConfigMismatchError, PeerDataError
from ubep.waiting import AbortNotice, PeerAbortedError

OK, REJECTED = 0, 1
UNUSED = -1
FIELDS = 5  # the most fields a call agrees on
WORDS = 3 + FIELDS
KINDS = {  # kind: (its code on the wire, how errors name the call)
    "dispatch": (1, "dispatch"),
    "cached_dispatch": (2, "dispatch with a handle"),
    "combine": (3, "combine"),
    "ll_dispatch": (4, "low_latency_dispatch"),
    "ll_combine": (5, "low_latency_combine"),
    "barrier": (6, "barrier"),
}
NAMES = {code: name for code, name in KINDS.values()}

Method = TypeVar("Method", bound=Callable[..., Any])


class CallHeaders:
    """One DeepEP layer's call headers over its group; `owner` names the layer in errors.

    Between `begin` and the end of the call it remembers that call's kind and number and
    whether this rank has agreed yet, so a rejection joins the exchange once."""

    def __init__(self, members: Members, owner: str):
        self._members, self._owner = members, owner
        self._seq = 0
        self._kind, self._agreed = "", True

    def begin(self, kind: str) -> None:
        self._seq += 1
        self._kind, self._agreed = kind, False

    def agree(self, kind: str | None = None, **fields: int) -> None:
        """This rank's checks passed: exchange headers of `kind` (default: the method's) with these
        fields (ints, the same names on every rank calling this kind) and raise on any difference."""
        kind = kind or self._kind
        words = [OK, KINDS[kind][0], self._seq, *(operator.index(v) for v in fields.values())]
        if len(words) > WORDS:
            raise ValueError(f"a call header holds at most {FIELDS} fields, got {list(fields)}")
        self._agreed = True  # from here on this rank has taken part, whatever the exchange says
        if len(self._members.live()) > 1:  # a rank alone agrees with itself
            phase = self._phase(kind)
            self._check(self._all_gather(words, phase), phase, list(fields))

    def reject(self) -> None:
        """This rank gave up on the call before agreeing: join the exchange as REJECTED."""
        if self._agreed or len(self._members.live()) == 1:
            return
        self._agreed = True
        try:
            self._all_gather([REJECTED, KINDS[self._kind][0], self._seq], self._phase(self._kind))
        except Exception:
            pass  # the caller is already raising the reason this rank gave up

    def end(self) -> None:
        if not self._agreed:  # the peers would wait for this rank's header
            raise RuntimeError(f"{self._phase(self._kind)}: the call returned without its header")

    def _phase(self, kind: str) -> str:
        return f"{self._owner}.{KINDS[kind][1]} (call header)"

    def _all_gather(self, words: list[int], phase: str) -> torch.Tensor:
        """int64 [R, WORDS]: every live rank's header (masked ranks' rows zeros), under the layer's
        deadline (a lost peer named)."""
        mine_W = torch.tensor(words + [UNUSED] * (WORDS - len(words)), dtype=torch.int64, device="cpu")
        return self._members.gather(mine_W, phase)

    def _check(self, headers_RW: torch.Tensor, phase: str, names: list[str]) -> None:
        """Raise alike on every rank: a rejection first, then calls that differ, then fields (the live
        ranks' headers only)."""
        live = list(self._members.live())
        rejected = [r for r in live if int(headers_RW[r, 0]) != OK]
        if rejected:
            code, seq = headers_RW[rejected[0], 1:3].tolist()
            reason = f"it rejected its input for {NAMES.get(code, code)} (call #{seq}); see its error"
            if len(rejected) > 1:
                reason += f"; so did rank(s) {_ranks(rejected[1:])}"
            raise PeerAbortedError(phase, rejected[0], AbortNotice(reason))
        headers_LW = headers_RW[live]
        calls = [f"{NAMES.get(code, code)} #{seq}" for code, seq in headers_LW[:, 1:3].tolist()]
        if len(set(calls)) > 1:
            raise PeerDataError(f"{phase}: the ranks' calls differ: {_sides(live, calls, ' called ')}")
        differ = [i for i, name in enumerate(names) if (headers_LW[:, 3 + i] != headers_LW[0, 3 + i]).any()]
        if differ:
            said = [f"{names[i]} ({_sides(live, headers_LW[:, 3 + i].tolist(), ': ')})" for i in differ]
            raise ConfigMismatchError(
                f"{phase} on rank {self._members.rank}: ranks disagree on " + ", and on ".join(said)
            )


def opens(kind: str) -> Callable[[Method], Method]:
    """A method whose every call opens with a header of `kind` at `self._headers`: its body runs
    its checks, then `self._headers.agree(...)`, then its collectives; if it raises before
    agreeing, this rank joins the header as REJECTED, so its peers raise in this call too."""

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            headers: CallHeaders = self._headers
            headers.begin(kind)
            try:
                result = method(self, *args, **kwargs)
            except BaseException:
                headers.reject()
                raise
            headers.end()
            return result

        return call  # type: ignore[return-value]

    return decorate


def _sides(ranks: list[int], values: list, joint: str) -> str:
    """'rank(s) 0, 2: 8; rank(s) 1: 4': which of `ranks` hold each distinct value of `values` (one
    per rank), in order of appearance."""
    by_value: dict = {}
    for rank, value in zip(ranks, values, strict=True):
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"rank(s) {_ranks(ranks)}{joint}{value}" for value, ranks in by_value.items())


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

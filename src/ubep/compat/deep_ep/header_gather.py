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

The exchange needs the whole group: once the V1 layer's mask buffer masked a rank, calls open
without it (`leave_out`), as before the header existed.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ubep.deadlines import collective_deadline
from ubep.errors import ConfigMismatchError, PeerDataError
from ubep.group import GroupInfo, torch_group
from ubep.transport.virtual import VirtualRank
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

    def __init__(self, info: GroupInfo, timeout_s: float, owner: str):
        self._info, self._timeout_s, self._owner = info, timeout_s, owner
        self._whole = info.world_size > 1  # a group of one agrees with itself
        self._seq = 0
        self._kind, self._agreed = "", True

    def leave_out(self) -> None:
        """Open calls without a header from now on: a rank is masked, and the group's collective
        would wait for it."""
        self._whole = False

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
        if self._whole:
            phase = self._phase(kind)
            self._check(self._all_gather(words, phase), phase, list(fields))

    def reject(self) -> None:
        """This rank gave up on the call before agreeing: join the exchange as REJECTED."""
        if self._agreed or not self._whole:
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
        """int64 [R, WORDS]: every rank's header, under the layer's deadline (a lost peer named)."""
        mine_W = torch.tensor(words + [UNUSED] * (WORDS - len(words)), dtype=torch.int64, device="cpu")
        info = self._info
        if isinstance(info.group, VirtualRank):
            return torch.stack(info.group.world.all_gather(info.rank, mine_W))
        everyone = [torch.empty_like(mine_W) for _ in range(info.world_size)]
        with collective_deadline(torch_group(info.group), self._timeout_s, phase, info.peers):
            dist.all_gather(everyone, mine_W, group=info.group)
        return torch.stack(everyone)

    def _check(self, headers_RW: torch.Tensor, phase: str, names: list[str]) -> None:
        """Raise alike on every rank: a rejection first, then calls that differ, then fields."""
        rejected = torch.nonzero(headers_RW[:, 0] != OK).flatten().tolist()
        if rejected:
            code, seq = headers_RW[rejected[0], 1:3].tolist()
            reason = f"it rejected its input for {NAMES.get(code, code)} (call #{seq}); see its error"
            if len(rejected) > 1:
                reason += f"; so did rank(s) {_ranks(rejected[1:])}"
            raise PeerAbortedError(phase, rejected[0], AbortNotice(reason))
        calls = [f"{NAMES.get(code, code)} #{seq}" for code, seq in headers_RW[:, 1:3].tolist()]
        if len(set(calls)) > 1:
            raise PeerDataError(f"{phase}: the ranks' calls differ: {_sides(calls, ' called ')}")
        differ = [i for i, name in enumerate(names) if (headers_RW[:, 3 + i] != headers_RW[0, 3 + i]).any()]
        if differ:
            said = [f"{names[i]} ({_sides(headers_RW[:, 3 + i].tolist(), ': ')})" for i in differ]
            raise ConfigMismatchError(
                f"{phase} on rank {self._info.rank}: ranks disagree on " + ", and on ".join(said)
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


def _sides(values: list, joint: str) -> str:
    """'rank(s) 0, 2: 8; rank(s) 1: 4': which ranks hold each distinct value, in order of appearance."""
    by_value: dict = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"rank(s) {_ranks(ranks)}{joint}{value}" for value, ranks in by_value.items())


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

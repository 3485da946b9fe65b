"""The call header: the first collective of every call half on the torch.distributed paths.

A collective whose ranks disagree on its size does not fail in Python: gloo ends
the process ("Received data size doesn't match expected size"). Ranks disagree
whenever their calls do (dispatch on one rank and low_latency_dispatch on
another; combines with handles of different dispatches; another dtype or top-k;
a rank that rejected its input and went on to its next call). So every call
half first runs one all-to-all whose size depends only on the group, never on
the call: each rank sends each peer `WORDS` header words (the same to all) and
`per_peer` words of its own (the counts of what it will send there).

Every rank sees every peer's header, so every rank reaches the same verdict
before any variable-size collective: a rank that rejected its input
(`REJECTED`) makes its peers raise `PeerAbortedError`; any other difference
raises `PeerDataError` naming the field and the ranks on each side. Either way
every rank has spent the same call number, so the next matching call works.

    header words:  status, kind, seq, handle (the seq of the dispatch a handle names), dtype, topk, tokens
    rank 0 -> 1:   [OK, dispatch, 7, -1, bf16, 8, -1 | rows for rank 1, 0, ...]

(Hidden sizes need no word: the Buffer rejects any other than its own, and
ranks agreed on it at construction. Handles are named by the seq, not the
per-kind epoch, because a kind mismatch leaves the ranks' per-kind counters
apart but their seq in step.)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import astuple, dataclass, fields

import torch
import torch.distributed as dist

from ubep.calls import KINDS, METHODS, CallId
from ubep.errors import PeerDataError
from ubep.protocols.base import CODE_DTYPES
from ubep.waiting import AbortNotice, PeerAbortedError

OK, REJECTED = 0, 1
NONE = -1  # a word this call does not use (no handle, no top-k, no T)
PHASES = {  # as the other phases of these calls are named in errors
    "dispatch": "dispatch",
    "combine": "combine",
    "ll_dispatch": "low-latency dispatch",
    "ll_combine": "low-latency combine",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class CallHeader:
    """What one rank is about to do; every field but status must match on every rank."""

    status: int = OK
    kind: int
    seq: int
    handle: int = NONE  # the seq of the dispatch whose handle this call uses (`DispatchHandle.seq`)
    dtype: int = NONE  # wire code (`ubep.protocols.base.DTYPE_CODES`)
    topk: int = NONE
    tokens: int = NONE  # low-latency T (num_max_dispatch_tokens_per_rank)

    @classmethod
    def of(cls, call: CallId, **words: int) -> CallHeader:
        return cls(kind=KINDS[call.kind], seq=call.seq, **words)

    @classmethod
    def rejected(cls, call: CallId) -> CallHeader:
        """The header of a rank that gave up on `call` before its first collective."""
        return cls(status=REJECTED, kind=KINDS[call.kind], seq=call.seq)


NAMES = tuple(f.name for f in fields(CallHeader))
WORDS = len(NAMES)


class CallHeaders:
    """One group's header exchange; remembers the last call it carried, so an abort joins once.

    `names[i]` is how errors name the group's rank i (default: i), e.g. its EP rank when
    `group` is a rail of the hierarchical transport.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_ranks: int,
        per_peer: int,
        deadline: Callable[[str], AbstractContextManager],
        names: tuple[int, ...] | None = None,
    ):
        self.group, self.R, self.per_peer = group, num_ranks, per_peer
        self.deadline = deadline
        self.names = names or tuple(range(num_ranks))
        self._entered_seq = 0

    def exchange(self, call: CallId, header: CallHeader, mine_RX: torch.Tensor | None = None) -> torch.Tensor:
        """Send `header` and row r of `mine_RX` (int64 [R, X <= per_peer]) to rank r; check every
        rank's header; return the per-peer words each source sent here (int64 [R, per_peer])."""
        recv_RW = self._all_to_all(call, header, mine_RX)
        check(recv_RW[:, :WORDS], phase(call), self.names)
        return recv_RW[:, WORDS:]

    def abort(self, call: CallId) -> None:
        """Join `call`'s header exchange as REJECTED, unless this rank has started it already."""
        if self._entered_seq == call.seq:
            return
        try:
            self._all_to_all(call, CallHeader.rejected(call), None)
        except Exception:
            pass  # the caller is already raising the reason this rank gave up

    def _all_to_all(self, call: CallId, header: CallHeader, mine_RX: torch.Tensor | None) -> torch.Tensor:
        self._entered_seq = call.seq
        send_RW = torch.zeros(self.R, WORDS + self.per_peer, dtype=torch.int64, device="cpu")
        send_RW[:, :WORDS] = torch.tensor(astuple(header), dtype=torch.int64, device="cpu")
        if mine_RX is not None:
            send_RW[:, WORDS : WORDS + mine_RX.shape[1]] = mine_RX
        recv_RW = torch.empty_like(send_RW)
        with self.deadline(phase(call)):
            dist.all_to_all_single(recv_RW, send_RW, group=self.group)
        return recv_RW


def check_peer(where: str, me: int, mine: torch.Tensor, peer: int, theirs: torch.Tensor) -> None:
    """`check` of one peer's header (int64 [WORDS]) against this rank's, the rows in rank order, so
    that every rank words a difference alike (a message-based path sees one peer at a time). A
    header too short to hold a call header blames the peer."""
    if theirs.numel() != WORDS:
        raise PeerDataError(
            f"{where}: rank {peer} sent {theirs.numel()} call header words, a call header has {WORDS}",
            culprit=peer,
        )
    rows, names = ((mine, theirs), (me, peer)) if me < peer else ((theirs, mine), (peer, me))
    check(torch.stack(rows), where, names)


def check_message(
    call: CallId, me: int, mine: torch.Tensor, peer: int, header: torch.Tensor, words: int
) -> None:
    """A landed message's header words (int64), checked before any is used: exactly `words` of them
    (the protocol's: the call header, then its counts), the call header as `check_peer` holds it."""
    if header.numel() != words:
        raise PeerDataError(
            f"{phase(call)}: rank {peer} sent a message of {header.numel()} header words, this "
            f"call's carry {words}",
            culprit=peer,
        )
    check_peer(phase(call), me, mine, peer, header[:WORDS])


def phase(call: CallId) -> str:
    return f"{PHASES[call.kind]} (call header)"


def other_call_check(call: CallId, me: int, mine: torch.Tensor) -> Callable[[int, torch.Tensor], None]:
    """A fabric's `other_call` for `call`: a peer's message of this seq on another lane (it is in another
    kind of call) raises in the call header's words, `theirs` a message header (int64, the call header
    first)."""
    where = phase(call)
    return lambda peer, theirs: check_peer(where, me, mine, peer, theirs[:WORDS])


def check(headers_RW: torch.Tensor, where: str, names: tuple[int, ...]) -> None:
    """Raise on every rank alike if any rank rejected the call or any two headers differ;
    row i is the header of the rank errors call `names[i]`."""
    rejected = torch.nonzero(headers_RW[:, 0] != OK).flatten().tolist()
    if rejected:
        kind, seq = headers_RW[rejected[0], 1:3].tolist()
        reason = f"it rejected its input for {METHODS.get(kind, kind)} (call #{seq}); see its error"
        if len(rejected) > 1:
            reason += f"; so did rank(s) {_ranks([names[r] for r in rejected[1:]])}"
        raise PeerAbortedError(where, names[rejected[0]], AbortNotice(reason))
    differ = [i for i in range(1, WORDS) if (headers_RW[:, i] != headers_RW[0, i]).any()]
    if not differ:
        return
    if NAMES.index("kind") in differ:
        differ = [NAMES.index("kind")]  # the other words mean different things in different calls
    parts = [f"{NAMES[i]}: {_sides(headers_RW[:, i].tolist(), NAMES[i], names)}" for i in differ]
    raise PeerDataError(f"{where}: the ranks' calls differ in " + "; ".join(parts))


def _sides(values: list[int], name: str, names: tuple[int, ...]) -> str:
    """'rank(s) 0 called dispatch, rank(s) 1 called low_latency_dispatch': each distinct value."""
    by_value: dict[int, list[int]] = {}
    for i, value in enumerate(values):
        by_value.setdefault(value, []).append(names[i])
    said = [f"rank(s) {_ranks(ranks)} {_word(name, value)}" for value, ranks in by_value.items()]
    return ", ".join(said)


def _word(name: str, value: int) -> str:
    if name == "kind":
        return f"called {METHODS.get(value, f'an unknown call ({value})')}"
    if value == NONE:
        return {"handle": "no handle", "topk": "no top-k"}.get(name, "none")
    if name == "handle":
        return f"the handle of call #{value}"
    if name == "dtype":
        return str(CODE_DTYPES.get(value, f"dtype code {value}"))
    return str(value)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)

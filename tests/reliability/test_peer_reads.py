"""A peer's value is read once: a writer that rewrites a word it published, between the published value
and a bad one, while an honest rank's compiled half reads it, gets the honest rank to return the exact
result or raise naming the writer; never to crash, hang or return wrong data (issue 32, item 1).

Each case names one word a half takes from a peer: a header field, a list entry, a slot's source
token. Rank 1 (the writer) publishes honestly; once its stamp lands, a flipper thread alternates the
word between the published value and a bad one, and only then does rank 0 (the honest rank) run its
half. Before the fix the halves checked the word in the writer's memory and loaded it again to use it:
SIGSEGV on a prefix shifted by 2**40, wrong row counts on T + 1, negative token ids in the handle.

Every case runs in a child process (`python tests/reliability/test_peer_reads.py CASE REPS`), so that a crash
fails the test instead of killing pytest. The default is a few repetitions per case; the stress
version, `UBEP_STRESS_PEER_READS=200`, runs 200 per case (docs/reliability.md).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("numba")  # the halves under test, and the flipper, are compiled

from ubep.engine.numba_kernels import _jit
from ubep.engine.numba_sync import load_relaxed, store_relaxed

R, E, H, T, K = 2, 8, 64, 6, 2  # rank 0 holds experts 0-3, rank 1 experts 4-7
WRITER, READER = 1, 0
TIMEOUT_S = 20.0
REPEATS = int(os.environ.get("UBEP_STRESS_PEER_READS", "3"))


@dataclass(frozen=True)
class PeerWord:
    """One int64 word a half reads from a peer, and what makes it bad.

    `block(exchange)` holds it, in `owner`'s memory ("writer": the writer's own block; "reader": the
    writer's row of the reader's inbox), at byte `offset(exchange)`; `stamp(exchange)` is the header
    (with `stamp_offset`, in the same owner's memory) whose stamp says it is published.
    """

    protocol: str
    mode: str  # "normal" or "ll"
    kind: str  # the call whose word flips: "dispatch" or "combine"
    block: Callable
    owner: str
    offset: Callable
    stamp: Callable
    stamp_offset: Callable
    bad: Callable[[int], int]
    reader_waits: bool = True  # the reader starts its call once the word flips (False: a barrier first)
    words: int = 1  # consecutive words flipped together, each to bad(its value)


def _route(x):
    return x.blocks.route


def _back(x):
    return x.blocks.back.back


def _counts(x):
    return x.blocks.counts


def _staged(x):
    return x.blocks.staged


def _sent(x):
    return x.blocks.sent


def _returned(x):
    return x.blocks.returned


def own(where: tuple[str, str], kind: str, header: Callable, field: str, bad: Callable, at: int = 0, **kw):
    """A field (word `at` of it) of a header in the writer's own memory."""
    offset = lambda x: (header(x).word(field) + at) * 8  # noqa: E731
    return PeerWord(*where, kind, header, "writer", offset, header, lambda x: 0, bad, **kw)


def inbox(where: tuple[str, str], kind: str, header: Callable, field: str, bad: Callable, **kw):
    """A field of the writer's row of a header inbox in the reader's memory."""
    row = lambda x: WRITER * header(x).words * 8  # noqa: E731
    offset = lambda x: row(x) + header(x).word(field) * 8  # noqa: E731
    return PeerWord(*where, kind, header, "reader", offset, header, row, bad, **kw)


def region(
    where: tuple[str, str], kind: str, block: Callable, owner: str, offset: Callable, stamp: Callable,
    bad: Callable, **kw,
):  # fmt: skip
    """A word of a region, published under `stamp` (a header in the same owner's memory; in the
    reader's memory, the writer's row of an inbox)."""
    stamp_at = (lambda x: 0) if owner == "writer" else (lambda x: WRITER * stamp(x).words * 8)
    return PeerWord(*where, kind, block, owner, offset, stamp, stamp_at, bad, **kw)


UBEP, BSP, LL = ("ubep", "normal"), ("bsp", "normal"), ("ubep", "ll")  # (Buffer protocol, mode)
CASES = {
    "ubep-route-count": own(UBEP, "dispatch", _route, "counts", lambda v: T + 1, READER),
    "ubep-route-count-huge": own(UBEP, "dispatch", _route, "counts", lambda v: 1 << 30, READER),
    "ubep-route-num-tokens": own(UBEP, "dispatch", _route, "num_tokens", lambda v: -1),
    "ubep-list-entry": region(
        UBEP, "dispatch", lambda x: x.blocks.lists, "writer", lambda x: READER * T * 8, _route,
        lambda v: 1 << 40,
    ),
    "back-prefix-shifted": own(UBEP, "combine", _back, "prefix", lambda v: v + (1 << 40), READER, words=2),
    "back-prefix-past-end": own(UBEP, "combine", _back, "prefix", lambda v: R * T + 1, READER + 1),
    "back-dispatch-seq": own(UBEP, "combine", _back, "dispatch", lambda v: v + 1),
    "bsp-count": own(BSP, "dispatch", _counts, "counts", lambda v: T + 1, READER),
    "bsp-staged-dtype": inbox(BSP, "dispatch", _staged, "dtype", lambda v: 99, reader_waits=False),
    "bsp-staged-token": region(
        BSP, "dispatch", lambda x: x.blocks.stage_tokens, "reader", lambda x: WRITER * T * 8, _staged,
        lambda v: -1, reader_waits=False,
    ),
    "ll-sent-count": inbox(LL, "dispatch", _sent, "counts", lambda v: 1 << 30),
    "ll-sent-count-over-t": inbox(LL, "dispatch", _sent, "counts", lambda v: T + 1),
    "ll-slot-token": region(
        LL, "dispatch", lambda x: x.blocks.slot_info, "reader",
        lambda x: WRITER * x.blocks.slot_info.shape[1] * T * 8, _sent, lambda v: -K,
    ),
    "ll-returned-count": inbox(LL, "combine", _returned, "count", lambda v: v + (1 << 30)),
}  # fmt: skip


# The Triton halves run under the interpreter (seconds a call): the cases where their old form loaded a
# checked word again, one call each by default.
TRITON_CASES = ("ubep-route-count-huge", "back-prefix-shifted", "bsp-count", "ll-sent-count")


def _groups(engine: str) -> list[tuple[str, ...]]:
    """The cases, grouped by the Buffer they need (protocol and mode): one child process each."""
    names = TRITON_CASES if engine == "triton" else tuple(CASES)
    keys = dict.fromkeys((CASES[n].protocol, CASES[n].mode) for n in names)
    return [tuple(n for n in names if (CASES[n].protocol, CASES[n].mode) == key) for key in keys]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("engine", "cases"),
    [("numba", g) for g in _groups("numba")] + [("triton", g) for g in _groups("triton")],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_a_word_rewritten_while_read_gives_exact_results_or_names_the_writer(engine, cases):
    reps = REPEATS if engine == "numba" else max(1, REPEATS // 10)
    env = dict(os.environ)
    if engine == "triton":
        pytest.importorskip("triton")
        env["TRITON_INTERPRET"] = "1"
    limit = len(cases) * (60 + (10 if engine == "numba" else 30) * reps)
    done = subprocess.run(
        [sys.executable, __file__, ",".join(cases), str(reps), engine],
        capture_output=True, text=True, timeout=limit, env=env,
    )  # fmt: skip
    assert done.returncode == 0, f"the child crashed or failed (rc {done.returncode}): {done.stderr[-3000:]}"
    for case, report in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert report["wrong"] == [], (case, report)
        assert report["exact"] + report["named"] == reps, (case, report)
        assert report["flipped"] > 0, (case, report)  # the word really was rewritten during the calls


class StagesBadly:
    """Rank 1's fault points: once its rows are staged at every peer (`dispatch.sent`, before the token
    barrier), it rewrites its first staged source token index (or local expert id) at rank 0."""

    armed = True

    def __init__(self, exchange, what: str):
        self.exchange, self.what = exchange, what

    def at(self, point: str, call) -> None:
        if point == "dispatch.sent":
            b, t = self.exchange.blocks, self.exchange.t
            if self.what == "token":
                t.view(b.stage_tokens, 0)[1, 0] = 99
            else:
                t.view(b.stage_topk, 0)[1, 0, 0] = 99

    def count(self, point: str, call, value):
        return value


@pytest.mark.parametrize("engine", ["numba", "torch"])
@pytest.mark.parametrize("what", ["token", "local"])
def test_a_bad_staged_value_is_blamed_on_its_sender_by_every_rank(engine, what):
    """bsp: a source token index or local expert id out of range in rank 1's staging slot at rank 0
    makes rank 0 name rank 1, and rank 2, which read nothing wrong, blame rank 1 too, not honest
    rank 0 (issue 32, item 4: before, "a peer sent ...", and rank 2 blamed rank 0)."""
    import ubep
    from ubep import PeerAbortedError, PeerDataError
    from ubep.transport.virtual import VirtualWorld

    tokens = 4

    def step(rank):
        x = torch.ones(tokens, H, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 2, 4]] * tokens)  # every rank sends every token to every rank
        w = torch.ones(tokens, 3)
        with ubep.Buffer(
            rank, hidden=H, num_experts=6, max_tokens_per_rank=tokens, max_topk=3, engine=engine,
            protocol="bsp", timeout_s=TIMEOUT_S,
        ) as buf:  # fmt: skip
            if rank.rank == 1:
                exchange = buf._exchange
                bad = StagesBadly(exchange, what)
                exchange.faults = bad
                if exchange._compiled is not None:
                    exchange._compiled.faults = bad
            try:
                d = buf.dispatch(x, topk_idx=idx, topk_weights=w)
                buf.combine(d.recv_x, d.handle)
            except (PeerDataError, PeerAbortedError) as error:
                return error
            return None

    errors = VirtualWorld(3, timeout_s=120).run(step)
    said = "source token indices" if what == "token" else "local expert ids"
    assert isinstance(errors[0], PeerDataError) and f"rank 1 sent {said} outside" in str(errors[0]), errors
    assert isinstance(errors[2], PeerAbortedError) and errors[2].culprit == 1, errors[2]


# -- the child: each case's calls under the flipper ----------------------------------------------


def _flip_until_stopped(address, good, bad, stop_address):
    """Alternate the int64 words at `address` (good [n], bad [n]) between `bad` and `good` until the word
    at `stop_address` is nonzero (a compiled loop, GIL released: the words change every few
    nanoseconds, inside any window between a half's check and a second load); returns how many
    times they went bad."""
    flips = 0
    while load_relaxed(stop_address) == 0:
        for i in range(good.size):
            store_relaxed(address + 8 * i, bad[i])
        for i in range(good.size):
            store_relaxed(address + 8 * i, good[i])
        flips += 1
    for i in range(good.size):
        store_relaxed(address + 8 * i, good[i])
    return flips


class Flipper(threading.Thread):
    """Alternates one word between its published value and a bad one while armed: from the moment its
    stamp changes (the writer published) until stopped."""

    def __init__(self, word: PeerWord):
        super().__init__(daemon=True)
        self.flip = _jit(_flip_until_stopped)
        self.word = word
        self.where: list[tuple[int, int]] = []  # (word address, stamp address) per buffer half
        self.arm_now, self.armed, self.flipping, self.idle = (threading.Event() for _ in range(4))
        self.idle.set()
        self.stop_word = np.zeros(1, dtype=np.int64)
        self.flips = 0
        self._compile_now()

    def _compile_now(self) -> None:
        """Compile the flipping loop before any call is armed: compiled on first use (seconds on a cold
        cache), it would start only after a short call had ended, and flip nothing."""
        scratch = np.zeros(1, dtype=np.int64)
        self.stop_word[0] = 1
        self.flip(scratch.ctypes.data, scratch, scratch.copy(), self.stop_word.ctypes.data)
        self.stop_word[0] = 0

    def locate(self, exchange) -> None:
        """Both halves' addresses of the word and of its stamp, from the reader's address table."""
        w = self.word
        owner = WRITER if w.owner == "writer" else READER
        table, _ = exchange.t.address_table([w.block(exchange), w.stamp(exchange)])
        self.where = [
            (int(table[owner, 0, h]) + w.offset(exchange), int(table[owner, 1, h]) + w.stamp_offset(exchange))
            for h in (0, 1)
        ]

    def stop(self) -> None:
        """End this call's flipping (the word is left at its published value)."""
        self.stop_word[0] = 1
        self.idle.wait(TIMEOUT_S)

    def run(self) -> None:
        while True:
            self.arm_now.wait()
            self.arm_now.clear()
            self.idle.clear()
            self.stop_word[0] = 0
            stamps = [_int64_at(s) for _, s in self.where]
            before = [int(s[0]) for s in stamps]
            self.armed.set()
            while self.stop_word[0] == 0:
                landed = [h for h in (0, 1) if int(stamps[h][0]) != before[h]]
                if landed:
                    address = self.where[landed[0]][0]
                    good = _int64_at(address, self.word.words).copy()
                    bad = np.array([self.word.bad(int(v)) for v in good], dtype=np.int64)
                    self.flipping.set()
                    self.flips += self.flip(address, good, bad, self.stop_word.ctypes.data)
            self.idle.set()


def _int64_at(address: int, n: int = 1) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(address))


def _inputs(rank: int):
    """Token t of each rank selects expert t % 4 (rank 0's) and 4 + t % 4 (rank 1's): every local
    expert of both ranks gets rows from both."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    t = torch.arange(T)
    idx = torch.stack([t % 4, 4 + t % 4], dim=1)
    w = torch.rand(T, K, generator=gen)
    return x, idx, w


def _expected(mode: str):
    """Each rank's dispatch and combine results from the plain-torch reference."""
    from ubep import reference

    xs, idxs, ws = zip(*(_inputs(r) for r in range(R)), strict=True)
    if mode == "ll":
        got = reference.low_latency_dispatch(list(xs), list(idxs), E, T)
        ys = [_expert(g.recv_x_LMX) for g in got]
        return got, reference.low_latency_combine(ys, got, list(idxs), list(ws))
    got = reference.dispatch(list(xs), list(idxs), list(ws), E)
    ys = [_expert(g.recv_x_MH) for g in got]
    return got, reference.combine(ys, got, [x.shape[0] for x in xs])


def _expert(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * 1.5 - 0.25).to(x.dtype)


def _one_call(buf, word: PeerWord, flipper: Flipper, rank: int, sync: threading.Barrier, raised: dict):
    """One dispatch and combine; the flipped call runs on the reader only once the word flips.
    Returns ('dispatch' | 'combine', result or the exception).

    The ranks (threads) tell each other through `raised` whether their dispatch raised: a
    combine follows only where neither did, so the ranks' barriers stay in step (a combine
    beside a rank that skipped it would wait to its deadline). The writer's dispatch may raise
    by design after a call the reader failed naming it: it is then the verdict, judged as the
    reader's own (it must name the writer)."""
    x, idx, w = _inputs(rank)

    def flipped(call):
        if word.kind == stage and rank == READER and word.reader_waits:
            flipper.flipping.wait(TIMEOUT_S)
        return call()

    stage = "dispatch"
    try:
        if word.mode == "ll":
            d = flipped(lambda: buf.low_latency_dispatch(x, idx, T, E))
        else:
            d = flipped(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w))
    except Exception as error:
        d = error
    if word.kind == "dispatch":
        return stage, d
    raised[rank] = d if isinstance(d, Exception) else None
    sync.wait(TIMEOUT_S)
    if raised[rank] is not None:
        return stage, d
    if (theirs := raised[WRITER if rank == READER else READER]) is not None:
        return stage, theirs  # the writer left behind by a call the reader failed (Heap._left_behind)
    stage = "combine"
    try:
        if word.mode == "ll":
            return stage, (d, flipped(lambda: buf.low_latency_combine(_expert(d.recv_x), idx, w, d.handle)))
        return stage, (d, flipped(lambda: buf.combine(_expert(d.recv_x), d.handle)))
    except Exception as error:
        return stage, error


def _judge(outcome, word: PeerWord, expected) -> str:
    """'exact', 'named' (an error blaming the writer), or what was wrong."""
    from ubep import PeerAbortedError, PeerDataError

    stage, got = outcome
    if isinstance(got, PeerDataError) and f"rank {WRITER} " in str(got):
        return "named"
    if isinstance(got, PeerAbortedError) and WRITER in (got.culprit, got.culprit is None and got.peer):
        return "named"  # the writer found its own word bad
    if isinstance(got, Exception):
        return f"{stage}: {type(got).__name__}: {got}"
    dispatched, combined = expected
    mine = dispatched[READER]
    d = got if stage == "dispatch" else got[0]
    if word.mode == "ll":
        n = mine.recv_count_L
        same = torch.equal(d.recv_count, n) and all(
            torch.equal(d.recv_x[j, : n[j]], mine.recv_x_LMX[j, : n[j]])
            and torch.equal(d.handle.recv_src_token_LM[j, : n[j]], mine.src_token_LM[j, : n[j]])
            for j in range(len(n))
        )
    else:
        same = torch.equal(d.recv_x, mine.recv_x_MH) and torch.equal(
            d.handle.recv_src_token_M, mine.src_token_M
        )
    if stage == "combine":
        same = same and torch.equal(got[1].combined_x, combined[READER])
    return "exact" if same else f"{stage}: a wrong result without an error"


def _child(cases: list[str], reps: int, engine: str) -> dict:
    """Run `reps` flipped calls of each case (all of one protocol and mode) on one pair of Buffers;
    {case: {"exact", "named", "wrong", "flipped"}} for the reader."""
    import ubep
    from ubep.transport.virtual import VirtualWorld

    words = [CASES[c] for c in cases]
    first = words[0]
    flipper = Flipper(first)
    flipper.start()
    expected = _expected(first.mode)
    sync = threading.Barrier(R)
    raised: dict[int, Exception | None] = {}  # this call's dispatch errors, by rank

    def rank_main(rank):
        out = {}
        with ubep.Buffer(
            rank, hidden=H, num_experts=E, max_tokens_per_rank=T, max_topk=K, engine=engine,
            protocol=first.protocol, timeout_s=TIMEOUT_S, low_latency=first.mode == "ll",
        ) as buf:  # fmt: skip
            exchange = buf._ll if first.mode == "ll" else buf._exchange
            for case, word in zip(cases, words, strict=True):
                if rank.rank == READER:
                    flipper.word, flipper.flips = word, 0
                    flipper.locate(exchange)
                verdicts = []
                for _ in range(reps):
                    sync.wait(TIMEOUT_S)
                    if rank.rank == READER:
                        flipper.flipping.clear()
                        flipper.arm_now.set()
                        flipper.armed.wait(TIMEOUT_S)
                        flipper.armed.clear()
                    sync.wait(TIMEOUT_S)
                    outcome = _one_call(buf, word, flipper, rank.rank, sync, raised)
                    sync.wait(TIMEOUT_S)
                    if rank.rank == READER:
                        flipper.stop()
                        verdicts.append(_judge(outcome, word, expected))
                out[case] = {
                    "exact": verdicts.count("exact"),
                    "named": verdicts.count("named"),
                    "wrong": [v for v in verdicts if v not in ("exact", "named")],
                    "flipped": flipper.flips,
                }
        return out

    return VirtualWorld(R, timeout_s=TIMEOUT_S * (4 + reps * len(cases))).run(rank_main)[READER]


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3])))
    sys.stdout.flush()
    os._exit(0)  # the flipper is a daemon thread: leave without waiting for it

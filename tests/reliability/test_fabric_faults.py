"""The fabric after failed calls, lost peers and hostile messages (issue 45, items 1, 2, 8-12), on every
engine (gloo; zmq and nixl where installed).

- Failed calls leave nothing behind: a rank late past the deadline twice, a dispatch met by a combine
  twice, a peer killed, stopped or closed and then masked: 50 calls after the faults (UBEP_FAULT_CALLS
  sets how many) are exact on every rank, none raising an engine's own error (a send no receive
  was posted for, waited on later, timed out and closed the connection).
- A lost peer is named with a ubep error on every survivor, never by the engine's raw words.
- A hostile peer's message (a header too short, a frame outside its lane, a trailer that never
  matches, routing out of range across a rail) is `PeerDataError` naming it on the ranks that
  read it, the others name it as the culprit, and the calls after it are exact.

Hosts are emulated on this one (`LocalLaunch`): every message between ranks goes over the fabric.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import struct
import time
from dataclasses import astuple, replace

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, expert_output

import ubep
from ubep import reference
from ubep.across.call_header import WORDS, CallHeader, check_message
from ubep.across.fabric.base import Message, Outgoing, agree_on_mask
from ubep.calls import CallId
from ubep.errors import PeerDataError

HAS_NIXL = any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13"))
NO_NIXL = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed")
NO_ZMQ = pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="pyzmq is not installed")
ENGINE_MARKS = {"gloo": (), "zmq": (NO_ZMQ,), "nixl": (NO_NIXL,)}
ENGINES = [pytest.param(name, marks=marks) for name, marks in ENGINE_MARKS.items()]


def on_engines(cases: list[tuple], zmq_cases: list[tuple]) -> list:
    """(fabric, *case) for every engine and case, zmq only on `zmq_cases`: the others are checks of the
    protocol (a header cut short, rows routed out of range), the same code on every engine, and zmq
    (the default engine) runs the across tests besides."""
    return [
        pytest.param(name, *case, marks=marks)
        for name, marks in ENGINE_MARKS.items()
        for case in cases
        if name != "zmq" or case in zmq_cases
    ]


R, E, H, T = 3, 6, 32, 8
SC = Scenario(name="fabric-faults", num_ranks=R, num_experts=E, hidden=H, topk=2, capacity=T, seed=11)
TIMEOUT_S = 2.0
# Exact rounds asked for after each fault: 50 keeps the suite fast; UBEP_FAULT_CALLS=500 is the soak
# docs/reliability.md records. Every launch's hard deadline grows with it (seconds).
AFTER = int(os.environ.get("UBEP_FAULT_CALLS", "50"))
LAUNCH_S = 100.0 * max(1.0, AFTER / 50)
CASE_S = LAUNCH_S + 20.0
RAW = ("Timed out", "Connection closed", "pair closure", "Connection reset", "Socket")  # gloo's own words


def buffer(
    fabric: str, num_experts: int = E, low_latency: bool = False, transport: str = "dist"
) -> ubep.Buffer:
    if fabric == "nixl":
        os.environ["UCX_TLS"] = "tcp"  # as between hosts
    return ubep.Buffer(
        hidden=H,
        num_experts=num_experts,
        max_tokens_per_rank=T,
        transport=transport,
        fabric=fabric,
        timeout_s=TIMEOUT_S,
        low_latency=low_latency,
    )


class Rounds:
    """Dispatch + combine rounds against the reference, without the `masked` ranks' tokens."""

    def __init__(self, sc: Scenario, me: int, masked: frozenset[int] = frozenset()):
        xs, idxs, ws = reference.without_ranks(*sc.inputs(), set(masked), sc.num_experts)
        self.me, self.x, self.idx, self.w = me, xs[me], idxs[me], ws[me]
        ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
        self.recv_x = ref[me].recv_x_MH
        ys = [expert_output(r.recv_x_MH, rank) for rank, r in enumerate(ref)]
        self.combined = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]

    def one(self, buf: ubep.Buffer) -> bool:
        got = buf.dispatch(self.x, topk_idx=self.idx, topk_weights=self.w)
        out = buf.combine(expert_output(got.recv_x, self.me), got.handle)
        return torch.equal(got.recv_x, self.recv_x) and torch.equal(out.combined_x, self.combined)

    def exact(self, buf: ubep.Buffer, n: int = AFTER) -> int:
        """How many of `n` rounds were exact (an error propagates: the test names it)."""
        return sum(self.one(buf) for _ in range(n))


def all_ok(outcomes) -> None:
    """Every rank of `outcomes` returned: each one that did not is named with its error (a survivor's
    error often names a peer that exited, so the peer's own error is the one to read)."""
    failed = [f"rank {o.rank} ({o.cause}): {o.error}" for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)


def said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# -- item 1: failed calls leave no send behind --------------------------------------------------------


def failed_calls(fabric: str, how: str) -> tuple[list[str], int]:
    """Two faults, then AFTER rounds. "late": rank 1 reaches its combine past the others' deadline (they
    give up, it completes: the calls stay in step); "kinds": rank 1 calls combine where the others
    call dispatch. Returns (each fault's error on this rank, or "none"; exact rounds after)."""
    me = dist.get_rank()
    rounds = Rounds(SC, me)
    with buffer(fabric) as buf:
        errors = []
        for _ in range(2):
            assert rounds.one(buf)
            got = buf.dispatch(rounds.x, topk_idx=rounds.idx, topk_weights=rounds.w)
            y = expert_output(got.recv_x, me)
            try:
                if how == "late":
                    if me == 1:
                        time.sleep(TIMEOUT_S + 0.5)
                    buf.combine(y, got.handle)
                elif me == 1:
                    buf.combine(y, got.handle)
                else:
                    buf.dispatch(rounds.x, topk_idx=rounds.idx, topk_weights=rounds.w)
                errors.append("none")
            except ubep.UbepError as error:
                errors.append(said(error))
        return errors, rounds.exact(buf)


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize("fabric", ENGINES)
@pytest.mark.parametrize("how", ["late", "kinds"])
def test_two_failed_calls_leave_the_fabric_exact_for_the_calls_after(fabric, how):
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=LAUNCH_S).outcomes(failed_calls, fabric, how)
    all_ok(outcomes)
    for o in outcomes:
        errors, exact = o.result
        assert not any(word in e for e in errors for word in RAW), (o.rank, errors)
        if how == "kinds":
            assert all(differ_in_kind(e) for e in errors), errors
        elif o.rank != 1:
            assert all(e.startswith(("CommTimeoutError", "PeerAbortedError")) for e in errors), errors
        assert exact == AFTER, f"rank {o.rank}: {exact} of {AFTER} rounds after the faults were exact"


def differ_in_kind(error: str) -> bool:
    """Whether an error says the ranks' calls differ in kind: this rank's own header check, or a peer's
    abort notice that landed first (nixl, now and then) saying it gave up on a call of the other kind."""
    if error.startswith("PeerDataError"):
        return "differ in kind" in error
    told = re.fullmatch(r"PeerAbortedError: (\w+) .* aborted the call \(it gave up on its (\w+) .*", error)
    return told is not None and told[1] != told[2]  # this rank's call, the peer's


# -- items 1 and 2: a lost peer is named, masked, and the survivors go on ------------------------------

VICTIM = 2


def lost_peer(fabric: str, how: str) -> tuple[list[str], int]:
    """Rank VICTIM is killed, stopped or closes its Buffer after a round; the survivors' next two calls
    name it (a caller may well try again before masking), they mask it and make AFTER rounds.
    Returns (the survivor's errors, exact rounds after)."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    pids: list[int | None] = [None] * R
    dist.all_gather_object(pids, os.getpid())
    with buffer(fabric) as buf:
        assert Rounds(SC, me).one(buf)
        if me == VICTIM:
            if how == "close":
                buf.close()
                store.wait(["survivors-done"])
                return [], 0
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        errors = [attempt(lambda: Rounds(SC, me).one(buf)) for _ in range(2)]
        if any(e.startswith("raw") for e in errors):
            return errors, 0
        buf.mask_ranks([VICTIM])
        exact = Rounds(SC, me, frozenset({VICTIM})).exact(buf)
    if me == 0:
        store.set("survivors-done", "1")
        if how == "stop":
            os.kill(pids[VICTIM], signal.SIGKILL)
    return errors, exact


def attempt(call) -> str:
    """What a call that checks its results came to: "none" (exact), "wrong" (completed, not exact), its
    error as "Type: message", or "raw ..." (an engine's own error)."""
    try:
        exact = call()
    except ubep.UbepError as e:
        return said(e)
    except RuntimeError as e:
        return f"raw {said(e)}"
    return "none" if exact else "wrong"


def names(error: str, rank: int) -> bool:
    """Whether a survivor's error is a ubep error that names `rank`."""
    named = f"rank(s) {rank}" in error or f"rank {rank}" in error
    return error.startswith(("CommTimeoutError", "PeerAbortedError")) and named


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize("fabric", ENGINES)
@pytest.mark.parametrize("how", ["kill", "stop", "close"])
def test_a_lost_peer_is_named_and_the_survivors_go_on_exactly(fabric, how):
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=LAUNCH_S).outcomes(lost_peer, fabric, how)
    all_ok(outcomes[:VICTIM])
    for o in outcomes[:VICTIM]:
        errors, exact = o.result
        assert all(names(e, VICTIM) for e in errors), (o.rank, errors)
        assert exact == AFTER, f"rank {o.rank}: {exact} of {AFTER} rounds after the mask were exact"


LL = Scenario(name="ll-stop", num_ranks=2, num_experts=4, hidden=H, topk=2, capacity=T, seed=3)


def ll_dispatch_exact(buf: ubep.Buffer, me: int) -> bool:
    xs, idxs, _ = LL.inputs()
    ref = reference.low_latency_dispatch(xs, idxs, LL.num_experts, T)[me]
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, LL.num_experts)
    rows = [torch.equal(got.recv_x[j, :c], ref.recv_x_LMX[j, :c]) for j, c in enumerate(ref.recv_count_L)]
    return torch.equal(got.recv_count, ref.recv_count_L) and all(rows)


def ll_round_exact(buf: ubep.Buffer, me: int) -> bool:
    xs, idxs, ws = LL.inputs()
    ref = reference.low_latency_dispatch(xs, idxs, LL.num_experts, T)
    got = buf.low_latency_dispatch(xs[me], idxs[me], T, LL.num_experts)
    ys = [expert_output(r.recv_x_LMX, rank) for rank, r in enumerate(ref)]
    out = buf.low_latency_combine(ys[me], idxs[me], ws[me], got.handle)
    return torch.equal(out.combined_x, reference.low_latency_combine(ys, ref, idxs, ws)[me])


def resumed_after_stop(fabric: str) -> tuple[list[str], int, str]:
    """Low-latency over dist: rank 1 stops after a call; rank 0 gives up on its next two at the deadline,
    then resumes rank 1, which completes those two late (rank 0's rows were in); both make AFTER exact
    rounds; then rank 0 closes its Buffer and rank 1's next call must name it. Returns (this rank's
    errors in the two calls, exact rounds after, rank 1's error once rank 0 left)."""
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    pids: list[int | None] = [None] * 2
    dist.all_gather_object(pids, os.getpid())
    buf = buffer(fabric, num_experts=LL.num_experts, low_latency=True)
    assert ll_dispatch_exact(buf, me)
    if me == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    errors = [attempt(lambda: ll_dispatch_exact(buf, me)) for _ in range(2)]
    if me == 0:
        os.kill(pids[1], signal.SIGCONT)
    exact = sum(ll_round_exact(buf, me) for _ in range(AFTER))
    left = "none"
    if me == 0:
        buf.close()
        store.set("rank-0-closed", "1")
        store.wait(["rank-1-done"])
    else:
        store.wait(["rank-0-closed"])
        left = attempt(lambda: ll_round_exact(buf, me))
        store.set("rank-1-done", "1")
        buf.close()
    return errors, exact, left


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize("fabric", ENGINES)
def test_a_stopped_rank_resumed_goes_on_and_names_a_peer_that_left(fabric):
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=LAUNCH_S).outcomes(resumed_after_stop, fabric)
    all_ok(outcomes)
    (first, exact0, _), (resumed, exact1, left) = (o.result for o in outcomes)
    assert all(names(e, 1) for e in first), first
    assert resumed == ["none", "none"], resumed  # late, but every row it needed was in
    assert (exact0, exact1) == (AFTER, AFTER), (exact0, exact1)
    assert names(left, 0), left


# -- items 8, 9, 10: a hostile peer's message is named, and leaves nothing behind ---------------------

HOSTILE = 1


class Tamper:
    """On the hostile rank: its messages of the next call on `lane` go out altered. "short": the header
    cut to `value` words; "words", "bytes": the frame says `value` header words or payload bytes;
    "trailer": the word after the payload does not match the frame (gloo's); "cut": the message ends a
    byte before its frame says (zmq's, whose messages land whole); "token", "expert": hier's
    first crossing row names source token or expert `value`."""

    def __init__(self, fabric, lane: str, how: str, value: int):
        self.fabric, self.lane, self.how, self.value = fabric, lane, how, value
        self.seq: int | None = None
        self.cut: dict[int, object] = {}  # the message handed out (by id) -> the one sent in its place
        self.outbox, self.send = fabric.outbox, fabric.send
        fabric.outbox, fabric.send = self._outbox, self._send
        if fabric.name == "nixl":
            self.initialize_xfer = fabric._agent.initialize_xfer
            fabric._agent.initialize_xfer = self._initialize_xfer

    def _mine(self, lane: str, seq: int) -> bool:
        if lane != self.lane or self.seq not in (None, seq):
            return False
        self.seq = seq
        return True

    def _outbox(self, lane, peer, call, words, nbytes):
        if not self._mine(lane, call.seq) or self.how != "short":
            return self.outbox(lane, peer, call, words, nbytes)
        sent = self.outbox(lane, peer, call, self.value, nbytes)
        handed = type(sent)(torch.zeros(words, dtype=torch.int64), sent.payload, sent.key)
        self.cut[id(handed)] = sent
        return handed

    def _send(self, out) -> None:
        sent = self.cut.pop(id(out), None)
        if sent is not None:
            sent.header.copy_(out.header[: sent.header.numel()])
            out = sent
        elif self._mine(*self._lane_and_seq(out)):
            meta = 8 + 12 * HIER.topk  # a hier row's routing: source token, top-k ids, weights
            if self.how in ("token", "expert") and out.payload.numel() >= meta:
                out.payload[:meta].view(torch.int64)[0 if self.how == "token" else 1] = self.value
            elif self.fabric.name == "gloo" and self.how == "trailer":
                out.key[1][-8:].view(torch.int64)[0] ^= 1
            elif self.fabric.name == "gloo" and self.how in ("words", "bytes"):
                out.key[1][:16].view(torch.int64)[{"words": 0, "bytes": 1}[self.how]] = self.value
            elif self.fabric.name == "zmq" and self.how in ("words", "bytes"):  # frame: lane, seq, kind, ...
                out.key.buffer[:40].view(torch.int64)[{"words": 3, "bytes": 4}[self.how]] = self.value
            elif self.fabric.name == "zmq" and self.how == "cut":  # one byte short of what its frame says
                out = Outgoing(out.header, out.payload, replace(out.key, buffer=out.key.buffer[:-1]))
        self.send(out)

    def _lane_and_seq(self, out) -> tuple[str, int]:
        """(lane, call) of a message, as each engine keeps them."""
        if self.fabric.name == "gloo":
            (lane, _, seq), _ = out.key
            return self._lane_name(lane), seq
        return self._lane_name(out.key.lane), out.key.seq

    def _lane_name(self, index: int) -> str:
        return next(name for name, i in self.fabric.lanes.items() if i == index)

    def _initialize_xfer(self, op, local, remote, agent, frame, *rest, **kw):
        fields = list(struct.unpack("<cBBqqqq", frame))  # tag, lane, half, seq, kind, words, bytes
        if self.how in ("words", "bytes") and self._mine(self._lane_name(fields[1]), fields[3]):
            fields[{"words": 5, "bytes": 6}[self.how]] = self.value
            frame = struct.pack("<cBBqqqq", *fields)
        return self.initialize_xfer(op, local, remote, agent, frame, *rest, **kw)


def fabric_of(buf: ubep.Buffer):
    return buf._exchange.fabric


def hostile_call(buf: ubep.Buffer, call: str, me: int) -> bool:
    """One call of kind `call` (a combine after an honest dispatch); True: it completed."""
    xs, idxs, ws = SC.inputs()
    if call.startswith("ll"):
        got = buf.low_latency_dispatch(xs[me], idxs[me], T, E)
        if call == "ll_combine":
            buf.low_latency_combine(got.recv_x, idxs[me], ws[me], got.handle)
        return True
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    if call == "combine":
        buf.combine(got.recv_x, got.handle)
    return True


def hostile_peer(fabric: str, call: str, how: str, value: int) -> tuple[str, int]:
    """Rank HOSTILE alters its messages of one call; returns (this rank's error in it, exact rounds
    after it)."""
    me = dist.get_rank()
    rounds = Rounds(SC, me)
    with buffer(fabric, low_latency=call.startswith("ll")) as buf:
        assert rounds.one(buf)
        if me == HOSTILE:
            Tamper(fabric_of(buf), call, how, value)
        error = attempt(lambda: hostile_call(buf, call, me))
        return error, rounds.exact(buf)


def blames(error: str, rank: int) -> bool:
    """A ubep error that names `rank` as the one at fault: its data (PeerDataError), or as the culprit
    another rank passed on (PeerAbortedError)."""
    if error.startswith("PeerDataError"):
        return f"rank {rank} " in error
    return error.startswith("PeerAbortedError") and (
        f"rank {rank} failed" in error or f"rank {rank} aborted" in error
    )


HOSTILE_CASES = [
    ("dispatch", "short", 3),  # item 8: fewer words than a call header
    ("dispatch", "short", 7),  # item 8: the call header alone, no counts
    ("combine", "short", 3),
    ("ll_dispatch", "short", 3),
    ("ll_combine", "short", 7),
    ("dispatch", "words", 1 << 40),  # item 9: a frame outside its lane
    ("combine", "bytes", -8),
]


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize(
    ("fabric", "call", "how", "value"),
    on_engines(HOSTILE_CASES, [c for c in HOSTILE_CASES if c[1] != "short"] + HOSTILE_CASES[:1]),
)
def test_a_hostile_message_is_named_and_the_calls_after_are_exact(fabric, call, how, value):
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=LAUNCH_S).outcomes(
        hostile_peer, fabric, call, how, value
    )
    check_hostile(outcomes)


@pytest.mark.timeout(CASE_S)
def test_a_message_whose_trailer_never_matches_is_named():
    """Item 10 (gloo: the trailer tells a whole message from one still landing)."""
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=LAUNCH_S).outcomes(
        hostile_peer, "gloo", "dispatch", "trailer", 0
    )
    check_hostile(outcomes)


@pytest.mark.timeout(CASE_S)
@NO_ZMQ
def test_a_message_shorter_than_its_frame_is_named():
    """zmq: ZeroMQ delivers a message whole, so its length is checked against its frame's."""
    outcomes = ubep.LocalLaunch(world_size=R, timeout_s=LAUNCH_S).outcomes(
        hostile_peer, "zmq", "dispatch", "cut", 0
    )
    check_hostile(outcomes)


def check_hostile(outcomes) -> None:
    all_ok(outcomes)
    for o in outcomes:
        error, exact = o.result
        if o.rank == HOSTILE:
            assert error == "none" or error.startswith(("PeerAbortedError", "PeerDataError")), error
        else:
            assert blames(error, HOSTILE), (o.rank, error)
        assert exact == AFTER, f"rank {o.rank}: {exact} of {AFTER} rounds after the hostile call were exact"


# -- items 8, 11, 12 across a rail (hier: two nodes of two ranks; rails (0, 2) and (1, 3)) -------------

HIER = Scenario(
    name="hier-faults", num_ranks=4, num_experts=8, hidden=H, topk=2, tokens=(8,) * 4, capacity=T, seed=2
)
RAIL_PEER = 3  # rank HOSTILE's rail peer, the one that reads its rows


def hostile_rail_peer(fabric: str, how: str, value: int) -> tuple[str, int]:
    """Rank HOSTILE alters its rail message of one dispatch ("short", "token", "expert"), or makes its
    combine in float32 where every other rank's is bfloat16 ("dtype"). Returns (this rank's error in
    that call, exact rounds after)."""
    me = dist.get_rank()
    rounds = Rounds(HIER, me)
    with buffer(fabric, num_experts=HIER.num_experts, transport="hier") as buf:
        assert rounds.one(buf)
        if me == HOSTILE and how != "dtype":
            Tamper(fabric_of(buf), "hier_dispatch", how, value)

        def call() -> bool:
            got = buf.dispatch(rounds.x, topk_idx=rounds.idx, topk_weights=rounds.w)
            if how == "dtype":
                y = got.recv_x.float() if me == HOSTILE else got.recv_x
                buf.combine(y, got.handle)
            return True

        error = attempt(call)
        return error, rounds.exact(buf)


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize(
    ("fabric", "how", "value"), on_engines([("short", 3), ("token", -2), ("expert", 8 + 3)], [("token", -2)])
)
def test_a_hostile_rail_message_is_named_by_its_reader(fabric, how, value):
    """Items 8 and 11: the rail peer that reads the message names the sender (before relaying a row of
    it); the node peers it told give up too; the rounds after are exact."""
    launch = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=LAUNCH_S)
    outcomes = launch.outcomes(hostile_rail_peer, fabric, how, value)
    all_ok(outcomes)
    for o in outcomes:
        error, exact = o.result
        assert error == "none" or error.startswith(("PeerAbortedError", "PeerDataError")), (o.rank, error)
        assert exact == AFTER, f"rank {o.rank}: {exact} of {AFTER} rounds after the hostile call were exact"
    error = outcomes[RAIL_PEER].result[0]
    assert error.startswith("PeerDataError") and f"rank {HOSTILE} " in error, error


@pytest.mark.timeout(CASE_S)
@pytest.mark.parametrize("fabric", ENGINES)
def test_a_combine_of_another_dtype_is_blamed_on_its_rank_across_the_forwarder(fabric):
    """Item 12: rank 1's combine is float32. Rank 0 (its node peer) and rank 3 (its rail peer) see it;
    rank 2 hears of it from rank 0, across the rail, and must name rank 1, not rank 0."""
    launch = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=LAUNCH_S)
    outcomes = launch.outcomes(hostile_rail_peer, fabric, "dtype", 0)
    all_ok(outcomes)
    for o in outcomes:
        error, exact = o.result
        assert error.startswith(("PeerAbortedError", "PeerDataError")), (o.rank, error)
        if o.rank != HOSTILE:
            assert f"rank {HOSTILE} " in error or f"rank(s) {HOSTILE} " in error, (o.rank, error)
        assert exact == AFTER, f"rank {o.rank}: {exact} of {AFTER} rounds after were exact"


# -- without processes: the checks themselves ---------------------------------------------------------


class OnePeer:
    """A fabric of two ranks whose peer (rank 1) sends one message, `header`, on every lane."""

    name, rank, num_ranks = "one-peer", 0, 2

    def __init__(self, header: list[int]):
        self.header = torch.tensor(header, dtype=torch.int64)

    def outbox(self, lane, peer, call, words, nbytes) -> Outgoing:
        return Outgoing(torch.empty(words, dtype=torch.int64), torch.empty(nbytes, dtype=torch.uint8), None)

    def send(self, out: Outgoing) -> None:
        pass

    def arrivals(self, lane, call, peers, phase, other_call=None):
        yield Message(1, self.header.clone(), torch.empty(0, dtype=torch.uint8))

    def release(self, lane, peer, call) -> None:
        pass


@pytest.mark.parametrize("header", [[5], [5, 0, 0, 7], [-1, 0, 0], [5, 0, 2]])
def test_a_mask_round_that_is_not_a_call_and_flags_names_its_sender(header):
    with pytest.raises(PeerDataError, match="mask_ranks: rank 1 sent") as raised:
        agree_on_mask(OnePeer(header), [], 5, 1)
    assert raised.value.culprit == 1
    assert agree_on_mask(OnePeer([7, 0, 0]), [], 5, 1) == ((0, 1), 7)  # an honest one: resume after 7


@pytest.mark.parametrize("words", [0, 3, WORDS, WORDS + 2])
def test_a_message_header_of_the_wrong_length_names_its_sender(words):
    call = CallId(3, 2, "dispatch")
    mine = torch.tensor(astuple(CallHeader.of(call)), dtype=torch.int64)
    theirs = torch.cat([mine, torch.zeros(2, dtype=torch.int64)])[:words]
    with pytest.raises(PeerDataError, match=f"rank 1 sent a message of {words} header words") as raised:
        check_message(call, 0, mine, 1, theirs, WORDS + 1)
    assert raised.value.culprit == 1
    check_message(call, 0, mine, 1, torch.cat([mine, torch.zeros(1, dtype=torch.int64)]), WORDS + 1)

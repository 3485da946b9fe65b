"""Dispatch/combine across nodes with per-node deduplication (DeepEP's internode scheme).

Ranks pair up across nodes in rails (`ubep.nodes`): traffic between two nodes
runs only between the two ranks of one rail, over torch.distributed; inside a
node it runs over a shared-memory heap, as `ubep.protocols.ubep` does.

Dispatch, on rank `me` (node n, local index l), call seq s (stamps in the node: `in_node`):
  1. across: for each other node, the tokens that need any rank there cross
     once, to me's rail peer on that node: all-to-alls over the rail group of
     the counts, the routing (source token, global top-k ids, weights) and x.
  2. relay: me's *forward set* is the rows its rail peers sent (by slot, each
     block ascending) followed by its own tokens that need a rank of node n.
     The routing goes into me's shared segment (stamp META = s) and x lands
     there straight from the all-to-all (stamp DATA = s).
  3. fan out: every rank of node n reads every forward set's routing, picks
     the rows owned here, orders them by (source rank, token) as the contract
     says (the source is the token's home, not the forwarder), and pulls them.
Combine mirrors it: each expert rank puts its rows into their forwarder's
combine buffer (destination-major); the forwarder sums each
forwarded row over its node in float32 and sends one float32 partial per
(token, node) back along the rail; the home sums the partials of every node
in float32, in rail order, and casts to x's dtype.

Why float32 partials: the contract accumulates in float32; a partial rounded
to bf16 before crossing would add a rounding step no flat exchange has. It
costs 2x the bytes of a bf16 row on the way back (see `boundary_bytes`).

Legend: see `ubep.layout` (G nodes, V ranks per node, F rows in a forward set,
S rows crossing, O own tokens kept in the node, Y columns of a partial: H or H + K).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ubep.across.call_header import NONE, CallHeader, CallHeaders
from ubep.calls import CallId
from ubep.deadlines import collective_deadline, construction_s
from ubep.engine import Engine
from ubep.errors import PeerDataError
from ubep.group import GroupInfo
from ubep.layout import (
    ExpertPlacement,
    destination_major,
    localize_topk,
    prefix_offsets,
    token_in_rank,
)
from ubep.nodes import NodeMap, tokens_per_slot
from ubep.protocols.base import (
    CODE_DTYPES,
    CODE_RANGE,
    DTYPE_CODES,
    Exchange,
    Received,
    SendPlan,
    Sizing,
    rows,
)
from ubep.registry import HIER
from ubep.results import DispatchHandle, RecvRoute
from ubep.timers import lap, timed
from ubep.transport.base import Field, Header, Region
from ubep.transport.shm import shm_heap


@dataclass(frozen=True, slots=True)
class HierRoute:
    """One dispatch's relay tables, kept in the handle (`DispatchHandle.route`).

    Home side (this rank's tokens), per rail slot g:
      send_token_S:   tokens sent across, slot-major, ascending in each block (int64 [S])
      send_counts_G:  rows sent to each slot (0 at this rank's own slot)
      own_token_O:    own tokens that need a rank of this node (int64 [O])
    Forwarder side (this rank's forward set: S rows from other nodes, then its O own rows):
      relay_counts_G: rows received from each slot (0 at the own slot)
      fwd_in_node_FV: bool [F, P], the node ranks each forwarded row went to
    Expert side (rows received, M):
      recv_fwd_M:     node-local index of the forwarder each row came through
      recv_fwd_row_M: that row's index in its forwarder's set
      fwd_offset_V:   where this rank's rows start in each forwarder's combine buffer
    """

    send_token_S: torch.Tensor
    send_counts_G: torch.Tensor
    own_token_O: torch.Tensor
    relay_counts_G: torch.Tensor
    fwd_in_node_FV: torch.Tensor
    recv_fwd_M: torch.Tensor
    recv_fwd_row_M: torch.Tensor
    fwd_offset_V: torch.Tensor


class Routed(NamedTuple):
    """What fan-out derives from every forward set's routing, for this rank."""

    topk_MK: torch.Tensor  # local expert ids
    weights_MK: torch.Tensor
    src_rank_M: torch.Tensor
    src_token_M: torch.Tensor
    fwd_M: torch.Tensor
    fwd_row_M: torch.Tensor
    fwd_offset_V: torch.Tensor
    fwd_in_node_FV: torch.Tensor  # this rank's own forward set


def dispatch_row_bytes(hidden: int, itemsize: int, topk: int) -> int:
    """Bytes of one crossing dispatch row: x, source token (int64), top-k ids (int64), weights (fp32)."""
    return hidden * itemsize + 8 + topk * (8 + 4)


def partial_row_bytes(hidden: int, topk: int) -> int:
    """Bytes of one crossing combine partial: float32 [H], plus float32 [K] weights when combined."""
    return 4 * (hidden + topk)


@dataclass(frozen=True, slots=True)
class HierBlocks:
    """The node-local memory: each rank's forward set, and its combine buffer, double-buffered."""

    route: Header  # own: the forward set's rows, dtype and top-k
    data: Header  # own: its rows (count, dtype) have landed; a cached dispatch publishes only this
    ids: Region  # int64 [F, 2]: (source rank, source token) of each forwarded row
    topk: Region  # int64 [F, max_topk]: global expert ids
    weights: Region  # float32 [F, max_topk]
    x: Region  # uint8 [F, row bytes]
    slot: Header  # inbox: per node rank, the rows it put into this rank's combine buffer
    back_x: Region  # uint8 [F * P, row bytes]: rows back, node-rank-major
    back_w: Region  # float32 [F * P, max_topk]
    done: Region  # int64 [1]: the seq of the last call this rank is done with (`HierExchange._finish`)

    @classmethod
    def of(cls, s: Sizing, num_nodes: int, per_node: int) -> HierBlocks:
        F, K, B = s.capacity * num_nodes, s.max_topk, s.row_bytes  # own tokens plus one block per other node
        dtype = Field("dtype", lo=CODE_RANGE[0], hi=CODE_RANGE[1])
        return cls(
            route=Header("hier.route", (Field("count", hi=F), dtype, Field("topk", hi=K))),
            data=Header("hier.data", (Field("count", hi=F), dtype)),
            ids=Region("hier.ids", (F, 2), torch.int64, double=True),
            topk=Region("hier.topk", (F, K), torch.int64, double=True),
            weights=Region("hier.weights", (F, K), torch.float32, double=True),
            x=Region("hier.x", (F, B), torch.uint8, double=True),
            slot=Header("hier.slot", (dtype, Field("count", hi=F)), inbox=True),
            back_x=Region("hier.back_x", (F * per_node, B), torch.uint8, double=True),
            back_w=Region("hier.back_w", (F * per_node, K), torch.float32, double=True),
            done=Region("hier.done", (1,), torch.int64),
        )

    def all(self) -> tuple[Region | Header, ...]:
        return (
            self.route,
            self.data,
            self.ids,
            self.topk,
            self.weights,
            self.x,
            self.slot,
            self.back_x,
            self.back_w,
            self.done,
        )


def in_node(call: CallId) -> CallId:
    """`call` as the node-local memory sees it: stamped, and its half chosen, by the call's seq.

    The seq is the one number every rank agrees on after any mismatch (a kind mismatch
    leaves the per-kind epochs apart for good), so a wait pairs only the same call on both
    sides: a rank whose call went wrong can never have its next call's rows taken for it.
    Halves alternate with the seq's parity; a call writes its half only once every node peer
    is done with this rank's last call on that half (`HierExchange._begin`), so no peer still
    reads it.
    """
    return CallId(call.seq, call.seq, call.kind, call.timers)


def subgroups(nodes: NodeMap, rank: int, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(rail group, node group) of `rank`, connected within `timeout_s` (construction's deadline; each
    call sets its own). Every rank creates every group, in the same order (torch's rule for
    `new_group`; hier runs on the whole world); gloo, because the payloads are CPU tensors."""
    timeout = timedelta(seconds=timeout_s)
    rails = [nodes.rail(local) for local in range(nodes.ranks_per_node)]
    members = rails + [nodes.node_ranks(n) for n in range(nodes.num_nodes)]
    mine = []
    for ranks in members:
        group = dist.new_group(list(ranks), timeout=timeout, backend="gloo")
        if rank in ranks:
            mine.append(group)
    return mine[0], mine[1]


def as_bytes(t_nX: torch.Tensor) -> torch.Tensor:
    """[n, X] of any dtype -> uint8 [n, X * itemsize]."""
    row_bytes = math.prod(t_nX.shape[1:]) * t_nX.element_size()
    return t_nX.contiguous().view(torch.uint8).view(t_nX.shape[0], row_bytes)


def columns(rows_SB: torch.Tensor, widths: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Split packed byte rows into typed column blocks: widths are (dtype, columns)."""
    out, at = [], 0
    for dtype, cols in widths:
        nbytes = cols * dtype.itemsize
        # clone, not contiguous(): a one-row slice counts as contiguous yet keeps the packed row's
        # stride, which view(dtype) refuses unless it divides by the dtype's size
        block = rows_SB[:, at : at + nbytes].clone(memory_format=torch.contiguous_format)
        out.append(block.view(dtype).view(rows_SB.shape[0], cols))
        at += nbytes
    return out


class HierExchange(Exchange):
    """Hierarchical dispatch/combine for a group spanning several nodes of equal size."""

    across_hosts = "rail all-to-all across nodes, pull/put on shared memory within a node"

    name = HIER.name

    def __init__(self, info: GroupInfo, sizing: Sizing, timeout_s: float, engine: Engine):
        nodes = NodeMap(info.node_of_rank)
        ok, why = nodes.uniform()
        if not ok:
            raise ValueError(f"transport='hier': {why}")
        self.sizing, self.me = sizing, info.rank
        self.G, self.P = nodes.num_nodes, nodes.ranks_per_node
        self.local = nodes.local_index(info.rank)
        self.rail = nodes.rail(self.local)
        self.slot = self.rail.index(info.rank)
        self.slot_ranks_GV = nodes.slot_ranks(self.local)
        self.node_ranks = list(nodes.node_ranks(info.node_of_rank[info.rank]))
        # Sources whose rows reach this node through node rank f: those with local index f.
        self.sources_via = [nodes.rail(f) for f in range(self.P)]
        self.groups = subgroups(nodes, info.rank, construction_s(timeout_s))
        self.timeout_s, self.engine = timeout_s, engine
        self.blocks = HierBlocks.of(sizing, self.G, self.P)
        self.t = shm_heap(self.blocks.all(), self.groups[1], self.local, self.P, timeout_s)
        # A partial, not a bound method: no reference cycle keeps the groups alive after close.
        self._rail_deadline = functools.partial(
            collective_deadline, self.groups[0], timeout_s, names=tuple(self.rail)
        )
        self.headers = CallHeaders(self.groups[0], self.G, 1, self._rail_deadline, names=tuple(self.rail))
        self._last_on_half = [0, 0]  # the seq of this rank's last call on each half of the node memory

    def _begin(self, call: CallId) -> CallId:
        """`call` as the node-local memory sees it (`in_node`), once every node peer is done with
        this rank's last call on the same half: only then may the half be overwritten. A call
        that completed on every rank implies it; one that failed early (at the rail header, on
        some ranks only) does not."""
        call = in_node(call)
        self.t.begin(call)
        before = self._last_on_half[call.parity]
        done = [self.t.words(self.blocks.done, p) for p in range(self.P)]
        others = [p for p in range(self.P) if p != self.local and done[p][0] < before]
        if others:
            lap(call.timers, "between")
            self.t.wait(self._phase("previous call"), call, others, lambda p: done[p][0] >= before)
            lap(call.timers, "wait")
        self._last_on_half[call.parity] = call.seq
        return call

    def _finish(self, call: CallId) -> None:
        """This rank is done with `call` (completed or given up): peers may overwrite its half."""
        done = self.t.words(self.blocks.done, self.local)
        done[0] = max(int(done[0]), call.seq)
        self.t.ring()

    def _phase(self, what: str) -> str:
        return f"{what} (peers named by node-local index of ranks {self.node_ranks})"

    # -- across nodes -----------------------------------------------------------------------------

    def _rail_header(
        self, call: CallId, header: CallHeader, mine_G1: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The call header over the rail (`ubep.across.call_header`), first in every call half:
        rail peers whose calls differ raise before any variable-size collective, and node peers
        learn at once. Returns the word each rail peer sent here (int64 [G, 1])."""
        lap(call.timers, "between")
        try:
            return self.headers.exchange(call, header, mine_G1)
        except BaseException:
            self.t.abort(call)
            raise
        finally:
            lap(call.timers, "send")  # a collective: it sends and waits in one call

    def _rail_all_to_all(
        self,
        phase: str,
        call: CallId,
        send_SX: torch.Tensor,
        send_G: torch.Tensor,
        recv_G: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """all_to_all_single over the rail group (into `out` if given); a failure tells the
        node peers at once and names the rail peers."""
        if out is None:
            out = send_SX.new_empty((int(recv_G.sum()), *send_SX.shape[1:]))
        lap(call.timers, "between")
        try:
            with self._rail_deadline(phase):
                dist.all_to_all_single(out, send_SX, recv_G.tolist(), send_G.tolist(), group=self.groups[0])
        except BaseException:
            self.t.abort(call)  # node peers learn at once
            raise
        finally:
            lap(call.timers, "send")  # a collective: it sends and waits in one call
        return out

    def _home_plan(
        self, is_token_in_rank_NR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(send_token_S, send_counts_G, own_token_O): which tokens cross to which node, once."""
        in_slot_NG = tokens_per_slot(is_token_in_rank_NR, self.slot_ranks_GV)
        own_O = torch.nonzero(in_slot_NG[:, self.slot]).flatten()
        in_slot_NG[:, self.slot] = False  # own tokens stay in the node
        slot_S, token_S = destination_major(in_slot_NG)
        return token_S, torch.bincount(slot_S, minlength=self.G), own_O

    def _relay_counts(self, call: CallId, plan: SendPlan, dtype, send_G: torch.Tensor) -> torch.Tensor:
        """Rows each rail peer will send here (int64 [G]): the call header carries the counts."""
        header = CallHeader.of(call, dtype=DTYPE_CODES[dtype], topk=plan.topk_idx_NK.shape[1])
        relay_G = self._rail_header(call, header, send_G[:, None])[:, 0].contiguous()
        bad = torch.nonzero((relay_G < 0) | (relay_G > self.sizing.capacity)).flatten().tolist()
        if bad:
            message = f"dispatch: rank {self.rail[bad[0]]} announced {int(relay_G[bad[0]])} tokens"
            self.t.abort(call)
            raise PeerDataError(f"{message}, capacity is {self.sizing.capacity}")
        return relay_G

    def _relay_routing(
        self, call: CallId, plan: SendPlan, dtype, send_token_S, send_G, relay_G, own_O
    ) -> None:
        """Stage 1 and 2 for routing: send each other node (once) the routing of the tokens
        it needs; publish the forward set's routing and stamp META."""
        b, t, me, idx, w = self.blocks, self.t, self.local, plan.topk_idx_NK, plan.topk_weights_NK
        parts = (send_token_S[:, None], idx[send_token_S], w[send_token_S])
        meta_SB = torch.cat([as_bytes(part) for part in parts], dim=1)
        got = self._rail_all_to_all("dispatch (routing across nodes)", call, meta_SB, send_G, relay_G)
        K = idx.shape[1]
        token_in, idx_in, w_in = columns(got, [(torch.int64, 1), (torch.int64, K), (torch.float32, K)])
        src_F = torch.cat(
            [
                torch.repeat_interleave(torch.tensor(self.rail, dtype=torch.int64, device="cpu"), relay_G),
                torch.full_like(own_O, self.me),
            ]
        )
        F = src_F.numel()
        t.view(b.ids, me, call)[:F].copy_(torch.stack([src_F, torch.cat([token_in[:, 0], own_O])], 1))
        t.view(b.topk, me, call)[:F, :K].copy_(torch.cat([idx_in, idx[own_O]]))
        t.view(b.weights, me, call)[:F, :K].copy_(torch.cat([w_in, w[own_O]]))
        t.publish(b.route, call, {"count": F, "dtype": DTYPE_CODES[dtype], "topk": K})

    def _relay_rows(self, call: CallId, x_NH: torch.Tensor, send_token_S, send_G, relay_G, own_O) -> None:
        """Stage 1 and 2 for rows: crossing rows land straight in this rank's forward set,
        followed by its own rows for its node; then stamp DATA."""
        S, F, H = int(relay_G.sum()), int(relay_G.sum()) + own_O.numel(), x_NH.shape[1]
        fwd_FH = rows(self.t.view(self.blocks.x, self.local, call), F, x_NH.dtype, H)
        crossing = as_bytes(x_NH[send_token_S])
        self._rail_all_to_all(
            "dispatch (across nodes)", call, crossing, send_G, relay_G, out=as_bytes(fwd_FH[:S])
        )
        self.engine.copy_rows(x_NH, own_O, fwd_FH[S:], None)
        self.t.publish(self.blocks.data, call, {"count": F, "dtype": DTYPE_CODES[x_NH.dtype]})  # rows visible
        lap(call.timers, "forward")

    # -- inside the node: dispatch ----------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        call = self._begin(call)
        got = self._dispatch(call, plan, handle)
        self._finish(call)
        return got

    def _dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        x_NX = plan.packed_rows()  # one tensor crosses: an FP8 pair travels as byte rows
        if handle is not None:
            return self._dispatch_cached(call, plan, x_NX, handle)
        send_token_S, send_G, own_O = self._home_plan(plan.is_token_in_rank_NR)
        relay_G = self._relay_counts(call, plan, x_NX.dtype, send_G)
        self._relay_routing(call, plan, x_NX.dtype, send_token_S, send_G, relay_G, own_O)
        self._relay_rows(call, x_NX, send_token_S, send_G, relay_G, own_O)
        return self._fan_out(call, plan, x_NX, (send_token_S, send_G, own_O, relay_G))

    def _fan_out(self, call: CallId, plan: SendPlan, x_NX: torch.Tensor, crossing: tuple) -> Received:
        """Once this rank's forward set is stamped, however its rows crossed: every node peer's routing,
        then this rank's rows from every forward set. `crossing`: the route's first fields (send
        tokens, send counts, own tokens, relay counts, as `HierRoute`)."""
        got = self._gather_routing(call, x_NX.dtype, plan.topk_idx_NK.shape[1])
        route = HierRoute(*crossing, got.fwd_in_node_FV, got.fwd_M, got.fwd_row_M, got.fwd_offset_V)
        prefix_R1 = prefix_offsets(torch.bincount(got.src_rank_M, minlength=self.sizing.num_ranks))
        recv_x_MX = self._gather_rows(call, x_NX, route, prefix_R1)
        recv = RecvRoute.of(got.src_token_M, prefix_R1, route)
        return Received.unpacking(plan, recv_x_MX, got.topk_MK, got.weights_MK, recv)

    def _dispatch_cached(self, call: CallId, plan: SendPlan, x_NX, handle: DispatchHandle) -> Received:
        """The same rows cross and fan out again, x only: the routing is in the handle."""
        r: HierRoute = handle.route
        self._rail_header(call, CallHeader.of(call, handle=handle.seq, dtype=DTYPE_CODES[x_NX.dtype]))
        self._relay_rows(call, x_NX, r.send_token_S, r.send_counts_G, r.relay_counts_G, r.own_token_O)
        recv_x_MX = self._gather_rows(call, x_NX, r, handle.recv_prefix_R1)
        return Received.unpacking(plan, recv_x_MX, None, None, handle.recv)

    def _forward_header(self, call: CallId, f: int, dtype: torch.dtype, header: Header) -> tuple[int, int]:
        """A landed forward set's (row count, top-k or 0), checked against this rank's call."""
        got = self.t.read(header, call, f)
        if CODE_DTYPES.get(got["dtype"]) != dtype:
            message = f"dispatch: rank {self.node_ranks[f]} sent {CODE_DTYPES.get(got['dtype'])}, not {dtype}"
            raise self.t.bad_data(call, f, message)
        return got["count"], got.get("topk", 0)

    def _read_routing(self, call: CallId, dtype: torch.dtype, K: int):
        """Every forward set's (ids [S, 2], topk [S, K], weights [S, K], rows per forwarder [P]), copied
        and checked: a value out of range blames the node peer whose forward set holds it."""
        b, t = self.blocks, self.t
        ids, topk, weights, counts = [], [], [], []
        for f in range(self.P):
            n, k = self._forward_header(call, f, dtype, b.route)
            if k != K:
                raise PeerDataError(f"dispatch: rank {self.node_ranks[f]} relays top-k {k}, this rank {K}")
            ids.append(t.view(b.ids, f, call)[:n])
            topk.append(t.view(b.topk, f, call)[:n, :K])
            weights.append(t.view(b.weights, f, call)[:n, :K])
            counts.append(n)
        ids_S2, topk_SK = torch.cat(ids), torch.cat(topk)  # copies: read once, checked, then used
        R, T, E = self.sizing.num_ranks, self.sizing.capacity, self.sizing.placement.num_experts
        bad_S = (ids_S2 < 0).any(dim=1) | (ids_S2[:, 0] >= R) | (ids_S2[:, 1] >= T)
        bad_S |= ((topk_SK < -1) | (topk_SK >= E)).any(dim=1)
        counts_V = torch.tensor(counts, dtype=torch.int64, device="cpu")
        if bad_S.any():
            f = int(torch.searchsorted(counts_V.cumsum(0), bad_S.nonzero()[0], right=True))
            message = f"dispatch: rank {self.node_ranks[f]} relays source ids or expert ids out of range"
            raise self._blame(call, f, message)
        return ids_S2, topk_SK, torch.cat(weights), counts_V

    def _blame(self, call: CallId, f: int, message: str) -> PeerDataError:
        """Node peer `f`'s published value failed a check: the node peers learn whom to blame (through
        the heap), and so do this rank's peers across nodes (the error's culprit, its EP rank)."""
        self.t.bad_data(call, f, message)
        return PeerDataError(message, culprit=self.node_ranks[f])

    def _gather_routing(self, call: CallId, dtype: torch.dtype, K: int) -> Routed:
        """Stage 2, fan-out: from every forward set's routing, the rows owned here, in final order."""
        placement = self.sizing.placement
        lap(call.timers, "between")
        self.t.wait_landed(self.blocks.route, call, range(self.P), self._phase("dispatch (routing)"))
        lap(call.timers, "wait")
        ids_S2, topk_SK, w_SK, counts_V = self._read_routing(call, dtype, K)
        fwd_S = torch.repeat_interleave(torch.arange(self.P, dtype=torch.int64, device="cpu"), counts_V)
        row_S = (
            torch.arange(fwd_S.numel(), dtype=torch.int64, device="cpu")
            - prefix_offsets(counts_V)[:-1][fwd_S]
        )
        local_SK, local_w_SK = localize_topk(topk_SK, w_SK, placement, self.me)
        here = torch.nonzero((local_SK >= 0).any(dim=1)).flatten()
        m = here[torch.argsort(ids_S2[here, 0] * self.sizing.capacity + ids_S2[here, 1])]  # (source, token)
        in_node_SV = token_in_rank(topk_SK, placement)[:, self.node_ranks]
        to_lower_S = in_node_SV[:, : self.local].sum(dim=1)  # pairs ahead of this rank's block
        offset_V = torch.bincount(fwd_S, weights=to_lower_S.double(), minlength=self.P).long()
        return Routed(
            local_SK[m],
            local_w_SK[m],
            ids_S2[m, 0],
            ids_S2[m, 1],
            fwd_S[m],
            row_S[m],
            offset_V,
            in_node_SV[fwd_S == self.local],
        )

    def _gather_rows(self, call: CallId, x_NH: torch.Tensor, route: HierRoute, prefix_R1) -> torch.Tensor:
        """recv_x [M, H]: each forwarder's rows, pulled as soon as its DATA stamp lands, in any order."""
        recv_x_MH = x_NH.new_empty((route.recv_fwd_M.numel(), x_NH.shape[1]))
        own_first = [(self.local + i) % self.P for i in range(self.P)]
        stamps = self.t.landed(self.blocks.data, call, own_first, self._phase("dispatch (tokens in node)"))
        lap(call.timers, "receive")  # the fan out's routing: which rows of the forward sets are this rank's
        for f in timed(stamps, call.timers):
            self._pull(call, f, recv_x_MH, route, prefix_R1)
            lap(call.timers, "receive")
        return recv_x_MH

    def _pull(self, call: CallId, f: int, recv_x_MH: torch.Tensor, route: HierRoute, prefix_R1) -> None:
        """Copy forwarder f's rows into place. Every source's rows come through one forwarder
        (the node rank with the source's local index), so each source block is one gather."""
        rows_here = route.recv_fwd_row_M[route.recv_fwd_M == f]
        if not rows_here.numel():
            return
        n, _ = self._forward_header(call, f, recv_x_MH.dtype, self.blocks.data)
        if int(rows_here.max()) >= n:
            message = f"dispatch: rank {self.node_ranks[f]} relays {n} rows, fewer than routed here"
            raise self.t.bad_data(call, f, message)
        source_FH = rows(self.t.view(self.blocks.x, f, call), n, recv_x_MH.dtype, recv_x_MH.shape[1])
        for src in self.sources_via[f]:
            a, z = int(prefix_R1[src]), int(prefix_R1[src + 1])
            self.engine.copy_rows(source_FH, route.recv_fwd_row_M[a:z], recv_x_MH[a:z], None)

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        call = self._begin(call)
        got = self._combine(call, x_MH, handle, topk_weights_MK)
        self._finish(call)
        return got

    def _combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        route: HierRoute = handle.route
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        header = CallHeader.of(call, handle=handle.seq, dtype=DTYPE_CODES[x_MH.dtype], topk=K or NONE)
        self._rail_header(call, header)
        self._put_to_forwarders(call, x_MH, topk_weights_MK, route)
        partial_FY = self._reduce_in_node(call, x_MH.dtype, x_MH.shape[1], K, route)
        S = int(route.relay_counts_G.sum())  # partials of other nodes' tokens; own ones follow
        back_SY = self._rail_all_to_all(
            "combine (across nodes)", call, partial_FY[:S], route.relay_counts_G, route.send_counts_G
        )
        # Every node's partials, added in rail order (this node's at this rank's slot).
        b, token_S = int(route.send_counts_G[: self.slot].sum()), route.send_token_S
        out_NY = torch.zeros(handle.num_tokens, partial_FY.shape[1], dtype=torch.float32, device=x_MH.device)
        out_NY.index_add_(0, token_S[:b], back_SY[:b])
        out_NY.index_add_(0, route.own_token_O, partial_FY[S:])
        out_NY.index_add_(0, token_S[b:], back_SY[b:])
        lap(call.timers, "receive")
        H = x_MH.shape[1]
        return out_NY[:, :H].to(x_MH.dtype), (out_NY[:, H:].contiguous() if K else None)

    def _put_to_forwarders(self, call: CallId, x_MH, w_MK, route: HierRoute) -> None:
        """Each forwarder's rows go to their final place in its combine buffer; then a stamp."""
        b, t, H = self.blocks, self.t, x_MH.shape[1]
        offsets = route.fwd_offset_V.tolist()
        for i in range(self.P):
            f = (self.local + i) % self.P
            pos = torch.nonzero(route.recv_fwd_M == f).flatten()
            pos = pos[torch.argsort(route.recv_fwd_row_M[pos])]  # in the forwarder's row order
            n, at = pos.numel(), offsets[f]
            self.engine.copy_rows(
                x_MH, pos, rows(t.view(b.back_x, f, call), n, x_MH.dtype, H, first=at), None
            )
            if w_MK is not None:
                self.engine.copy_rows(
                    w_MK, pos, t.view(b.back_w, f, call)[at : at + n, : w_MK.shape[1]], None
                )
            t.publish(b.slot, call, {"dtype": DTYPE_CODES[x_MH.dtype], "count": n}, to=f)
        lap(call.timers, "forward")

    def _reduce_in_node(self, call: CallId, dtype, H: int, K: int, route: HierRoute) -> torch.Tensor:
        """float32 [F, H + K]: each forwarded row summed over the node ranks it went to."""
        back_QH, back_QK, _, row_Q = self._rows_back(call, dtype, H, K, route)
        partial_FY = torch.zeros(route.fwd_in_node_FV.shape[0], H + K, dtype=torch.float32, device="cpu")
        self.engine.accumulate_rows(partial_FY[:, :H], back_QH, row_Q)
        if K:
            self.engine.accumulate_rows(partial_FY[:, H:], back_QK, row_Q)
        lap(call.timers, "forward")
        return partial_FY

    def _rows_back(self, call: CallId, dtype, H: int, K: int, route: HierRoute):
        """(rows [Q, H], weights [Q, K] or None, node rank [Q] and forwarded row [Q] of each): what the
        node ranks put into this rank's combine buffer, node-rank-major and ascending in each, once all
        landed and checked."""
        b, t = self.blocks, self.t
        t.wait_landed(b.slot, call, range(self.P), self._phase("combine (in node)"))
        lap(call.timers, "wait")
        expected_V = route.fwd_in_node_FV.sum(dim=0).tolist()
        for d in range(self.P):
            got = t.read(b.slot, call, d)
            if got["count"] != expected_V[d] or CODE_DTYPES.get(got["dtype"]) != dtype:
                raise self._blame(
                    call,
                    d,
                    f"combine: rank {self.node_ranks[d]} returned {got['count']} rows of "
                    f"{CODE_DTYPES.get(got['dtype'])}, expected {expected_V[d]} of {dtype}",
                )
        v_Q, row_Q = destination_major(route.fwd_in_node_FV)
        Q = row_Q.numel()
        back_QK = t.view(b.back_w, self.local, call)[:Q, :K] if K else None
        return rows(t.view(b.back_x, self.local, call), Q, dtype, H), back_QK, v_Q, row_Q

    def abort(self, call: CallId) -> None:
        """Node peers learn at once; rail peers too, from the call header, unless this rank
        has joined it already (then they time out at the next rail collective)."""
        call = in_node(call)
        self._finish(call)  # node peers waiting for this rank to be done with the call may go on
        self.t.abort(call)
        self.headers.abort(call)

    def close(self) -> None:
        self.t.close()
        for group in self.groups:
            dist.destroy_process_group(group)


def boundary_bytes(
    topk_idxs: list[torch.Tensor],
    placement: ExpertPlacement,
    node_of_rank: tuple[int, ...] | list[int],
    hidden: int,
    dtype: torch.dtype,
    combine_weights: bool = False,
) -> dict[str, list[int]]:
    """Bytes of each rank's tokens that cross the node boundary, flat ("dist") and deduplicated ("hier").

    Per home rank r, counting its tokens out (dispatch) and back (combine):
      dispatch_rows_flat / _dedup: (token, remote rank) / (token, remote node) pairs
      dispatch_bytes_flat / _dedup: those rows at their wire size, routing included
      combine_bytes_flat / _dedup: the rows back (x's dtype flat, float32 partials dedup),
                                   plus the top-k weights when `combine_weights`
    The per-call count exchange (a few int64 words per peer) is left out of both.
    Example: 2 nodes of 2 ranks, a token for ranks {0, 2, 3} on rank 0 crosses
    twice flat (to ranks 2 and 3) and once deduplicated (to node 1).
    """
    item, K = dtype.itemsize, (topk_idxs[0].shape[1] if topk_idxs else 0)
    returned_K = K if combine_weights else 0
    flat_row = hidden * item + 8 * (1 + 2 * K)  # bsp_flat's rows: x, then int64 token, local ids, weights
    node_R = torch.tensor(node_of_rank, dtype=torch.int64, device="cpu")
    out: dict[str, list[int]] = {}
    for rank, idx_NK in enumerate(topk_idxs):
        is_NR = token_in_rank(idx_NK, placement)
        remote_R = node_R != node_R[rank]
        flat = int(is_NR[:, remote_R].sum())
        dedup = sum(int(is_NR[:, node_R == n].any(dim=1).sum()) for n in set(node_R[remote_R].tolist()))
        counts = {
            "dispatch_rows_flat": flat,
            "dispatch_rows_dedup": dedup,
            "dispatch_bytes_flat": flat * flat_row,
            "dispatch_bytes_dedup": dedup * dispatch_row_bytes(hidden, item, K),
            "combine_bytes_flat": flat * (hidden * item + 4 * returned_K),
            "combine_bytes_dedup": dedup * partial_row_bytes(hidden, returned_K),
        }
        for key, value in counts.items():
            out.setdefault(key, []).append(value)
    return out

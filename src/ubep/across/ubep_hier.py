"""The hierarchical exchange with UBEP's crossing: rails over the fabric (`ubep.across.fabric`), no collective
inside a call (transport "hier", protocol "ubep").

Inside a node it is `HierExchange` as it stands (the forward sets, the fan-out
and the in-node reduction over the node's shared heap). Between nodes, where
`HierExchange` runs rail all-to-alls (the call header with the counts, then the
routing, then the rows, and the partials back), each rank pushes one message
to each rail peer as soon as it has its rows:

    dispatch  send     to each rail peer: the call header, the row count, then each crossing row's
                       routing (source token, global top-k ids, weights) and the row, once per node
              relay    as each rail peer's message lands, its rows go into this rank's forward set
                       (in slot order), then the set is stamped for the node (ROUTE, DATA)
              fan out  as in `HierExchange`: every node rank pulls its rows from every forward set
    combine   reduce   in the node, as in `HierExchange` (float32 partials per forwarded row)
              send     to each rail peer: the header, then the partials of its tokens
              sum      as each rail peer's partials land, added in rail order (the own node's at
                       this rank's slot), in float32; cast once

The counts travel with the rows: no count round, no barrier across nodes. A
forward set is stamped once all of its rail peers' rows are in (with two nodes,
one rail peer: its rows alone). Every message opens with the call header
(`ubep.across.call_header`): a rail peer whose call differs is named, one
that rejected its input tells its peers at once; a failure across a rail is
passed to the node peers through the heap, as `HierExchange` does.

Legend: see `ubep.across.collectives.bsp_hier`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import astuple

import torch

from ubep.across.call_header import NONE, WORDS, CallHeader, check_message, other_call_check
from ubep.across.collectives.bsp_hier import HierExchange, HierRoute, as_bytes, columns, in_node
from ubep.across.fabric.base import Fabric, Lane, Message
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import PeerDataError, UbepError
from ubep.group import GroupInfo
from ubep.layout import prefix_offsets
from ubep.nodes import NodeMap
from ubep.protocols.base import DTYPE_CODES, Received, SendPlan, Sizing, rows
from ubep.results import DispatchHandle
from ubep.timers import lap, timed
from ubep.transport.base import Agreement
from ubep.waiting import blame_of

COUNT = WORDS  # the header word after the call header: rows in this message


def rail_of(info: GroupInfo) -> tuple[int, ...]:
    """The ranks of `info.rank`'s rail (one per node, its own included)."""
    nodes = NodeMap(info.node_of_rank)
    return nodes.rail(nodes.local_index(info.rank))


def lanes(s: Sizing, rail: tuple[int, ...]) -> tuple[Lane, ...]:
    """The fabric's lanes between rail peers: T rows a message (routing beside each), and T float32
    partials back (weights beside each)."""
    T, K, B = s.capacity, s.max_topk, s.row_bytes
    return (
        Lane("hier_dispatch", WORDS + 1, T * (8 + 12 * K + B), peers=rail),
        Lane("hier_combine", WORDS + 1, T * 4 * (s.hidden + K), peers=rail),
    )


class HierFabric(HierExchange):
    """Hierarchical dispatch/combine whose crossings between nodes are fabric messages."""

    def __init__(
        self,
        info: GroupInfo,
        sizing: Sizing,
        timeout_s: float,
        engine: Engine,
        fabric: Fabric,
        reason: str = "",
    ):
        super().__init__(info, sizing, timeout_s, engine)
        self.fabric = fabric
        self.nodes = NodeMap(info.node_of_rank)
        self.across_hosts = (
            f"rails over the {fabric.name} fabric ({reason}), no collective inside a call; "
            "shared memory within a node"
        )
        self._told = 0  # the last call this rank told its rail peers it gave up on
        self.most_rows = sizing.capacity  # the most rows one rail message carries

    def _rail_peers(self) -> list[tuple[int, int]]:
        """(slot, rank) of every other node's rank on this rank's rail, from the next slot on; a masked
        one is left out (its whole node is: `_check_whole_nodes`)."""
        G, live = len(self.rail), self.fabric.live
        turns = [(self.slot + i) % G for i in range(1, G)]
        return [(g, self.rail[g]) for g in turns if self.rail[g] in live]

    def _masked(self) -> set[int]:
        """The ranks masked so far (the fabric keeps the membership)."""
        return set(range(self.sizing.num_ranks)).difference(self.fabric.live)

    def _masked_slots(self) -> set[int]:
        """The rail slots whose node is masked: nothing crosses to or from them."""
        return {g for g, rank in enumerate(self.rail) if rank not in self.fabric.live}

    def _header(self, call: CallId, **words: int) -> torch.Tensor:
        return torch.tensor(astuple(CallHeader.of(call, **words)), dtype=torch.int64, device="cpu")

    # -- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        self._check_whole_nodes(self._masked())
        x_NX = plan.packed_rows()  # one tensor crosses: an FP8 pair travels as byte rows
        try:
            if handle is not None:
                return self._dispatch_cached_over_fabric(call, plan, x_NX, handle)
            return self._dispatch_over_fabric(call, plan, x_NX)
        except UbepError as error:
            self._give_up(call, error)
            raise

    def _dispatch_over_fabric(self, call: CallId, plan: SendPlan, x_NX: torch.Tensor) -> Received:
        K = plan.topk_idx_NK.shape[1]
        mine = self._header(call, dtype=DTYPE_CODES[x_NX.dtype], topk=K)
        send_token_S, send_G, own_O = self._home_plan(plan.is_token_in_rank_NR)
        at_G = prefix_offsets(send_G)
        meta_SB = torch.cat(
            [as_bytes(t) for t in (send_token_S[:, None], plan.topk_idx_NK[send_token_S],
                                   plan.topk_weights_NK[send_token_S])], dim=1,
        )  # fmt: skip
        self.fabric.begin(call)
        lap(call.timers, "between")
        for g, peer in self._rail_peers():
            a, z = int(at_G[g]), int(at_G[g + 1])
            self._send_rows(call, "hier_dispatch", peer, mine, meta_SB[a:z], x_NX, send_token_S[a:z])
        lap(call.timers, "send")
        relay_G = self._relay_over_fabric(call, plan, x_NX, mine, own_O, K)
        return self._fan_out(call, plan, x_NX, (send_token_S, send_G, own_O, relay_G))

    def _send_rows(self, call, lane, peer, mine, meta_nB, rows_NX, index_n) -> None:
        """One message to a rail peer: the header, the rows' routing bytes (may be empty), the rows."""
        n, meta = index_n.numel(), meta_nB.shape[1] if meta_nB is not None else 0
        row_bytes = rows_NX.shape[1] * rows_NX.element_size()
        out = self.fabric.outbox(lane, peer, call, WORDS + 1, n * (meta + row_bytes))
        out.header[:WORDS], out.header[COUNT] = mine, n
        if meta:
            out.payload[: n * meta].view(n, meta).copy_(meta_nB)
        rows_nX = out.payload[n * meta :].view(rows_NX.dtype).view(n, rows_NX.shape[1])
        self.engine.copy_rows(rows_NX, index_n, rows_nX, None)
        self.fabric.send(out)

    def _relay_over_fabric(self, call, plan: SendPlan, x_NX, mine, own_O, K: int) -> torch.Tensor:
        """Stage 2: each rail peer's rows and routing into this rank's forward set as they land (in slot
        order), then its own; stamp ROUTE and DATA. Returns the rows each slot sent here (int64 [G])."""
        b, t, me, H = self.blocks, self.t, self.local, x_NX.shape[1]
        G, T = len(self.rail), self.sizing.capacity
        relay_G = torch.zeros(G, dtype=torch.int64, device="cpu")
        landed: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        ids, topk = t.view(b.ids, me, call), t.view(b.topk, me, call)
        weights, fwd_FX = t.view(b.weights, me, call), t.view(b.x, me, call)
        at = 0  # the forward set's next row
        turn = 0  # the next slot in order
        passed = {self.slot} | self._masked_slots()  # slots that send nothing here

        def place_ready() -> None:
            nonlocal at, turn
            while turn < G and (turn in passed or turn in landed):
                if turn not in passed:
                    n, (token_n, idx_nK, w_nK), rows_nX = landed.pop(turn)
                    ids[at : at + n, 0], ids[at : at + n, 1] = self.rail[turn], token_n
                    topk[at : at + n, :K], weights[at : at + n, :K] = idx_nK, w_nK
                    self.engine.copy_rows(rows_nX, None, rows(fwd_FX, n, x_NX.dtype, H, first=at), None)
                    relay_G[turn] = n
                    at += n
                    self.fabric.release("hier_dispatch", self.rail[turn], call)
                turn += 1

        meta = 8 + 12 * K
        for msg in self._landed("hier_dispatch", call, mine):
            slot = self.rail.index(msg.peer)
            n = self._count(call, msg, T, meta + H * x_NX.element_size())
            routing = self._routing(call, msg.peer, msg.payload[: n * meta].view(n, meta), K)
            landed[slot] = (n, routing, msg.payload[n * meta :].view(x_NX.dtype).view(n, H))
            place_ready()
            lap(call.timers, "forward")
        place_ready()
        F = at + own_O.numel()
        ids[at:F, 0], ids[at:F, 1] = self.me, own_O
        topk[at:F, :K], weights[at:F, :K] = plan.topk_idx_NK[own_O], plan.topk_weights_NK[own_O]
        self.engine.copy_rows(x_NX, own_O, rows(fwd_FX, own_O.numel(), x_NX.dtype, H, first=at), None)
        code = DTYPE_CODES[x_NX.dtype]
        t.publish(b.route, call, {"count": F, "dtype": code, "topk": K})
        t.publish(b.data, call, {"count": F, "dtype": code})  # rows visible
        lap(call.timers, "forward")
        return relay_G

    def _routing(self, call: CallId, peer: int, meta_nB: torch.Tensor, K: int):
        """(source token [n], global top-k ids [n, K], weights [n, K]) of a rail peer's rows, copied out
        of its message and checked before any is relayed: a token outside [0, T) or an expert id outside
        [-1, E) blames the peer (its node peers would read them in this rank's forward set)."""
        token_n1, idx_nK, w_nK = columns(meta_nB, [(torch.int64, 1), (torch.int64, K), (torch.float32, K)])
        T, E = self.sizing.capacity, self.sizing.placement.num_experts
        if token_n1.numel() and (token_n1.min() < 0 or token_n1.max() >= T):
            raise self._bad(call, peer, f"dispatch: rank {peer} sent source tokens outside [0, {T})")
        if idx_nK.numel() and (idx_nK.min() < -1 or idx_nK.max() >= E):
            raise self._bad(call, peer, f"dispatch: rank {peer} sent expert ids outside [-1, {E})")
        return token_n1[:, 0], idx_nK, w_nK

    def _dispatch_cached_over_fabric(self, call, plan: SendPlan, x_NX, handle: DispatchHandle) -> Received:
        """The same rows cross and fan out again, x only: the routing is in the handle, so each rail
        peer's rows go into place the moment they land."""
        r: HierRoute = handle.route
        mine = self._header(call, handle=handle.seq, dtype=DTYPE_CODES[x_NX.dtype])
        self.fabric.begin(call)
        lap(call.timers, "between")
        self._relay_cached(call, mine, x_NX, r)
        recv_x_MX = self._gather_rows(call, x_NX, r, handle.recv_prefix_R1)
        return Received.unpacking(plan, recv_x_MX, None, None, handle.recv)

    def _relay_cached(self, call: CallId, mine: torch.Tensor, x_NX: torch.Tensor, r: HierRoute) -> None:
        """A cached dispatch's crossing of the rail: rows `r.send_token_S` of `x_NX` to the rail peers,
        each peer's rows into this rank's forward set as they land, then rows `r.own_token_O`; DATA
        stamped."""
        at_G, relay_at = prefix_offsets(r.send_counts_G), prefix_offsets(r.relay_counts_G)
        for g, peer in self._rail_peers():
            a, z = int(at_G[g]), int(at_G[g + 1])
            self._send_rows(call, "hier_dispatch", peer, mine, None, x_NX, r.send_token_S[a:z])
        lap(call.timers, "send")
        b, t, me, H = self.blocks, self.t, self.local, x_NX.shape[1]
        fwd_FX, S = t.view(b.x, me, call), int(r.relay_counts_G.sum())
        for msg in self._landed("hier_dispatch", call, mine):
            peer, slot = msg.peer, self.rail.index(msg.peer)
            n = self._count(call, msg, self.most_rows, H * x_NX.element_size())
            if n != int(r.relay_counts_G[slot]):
                said = f"sends {n} rows here, this rank's handle expects {int(r.relay_counts_G[slot])}"
                raise self._bad(
                    call, peer, f"dispatch: rank {peer} {said} (all ranks must pass the same handle)"
                )
            into = rows(fwd_FX, n, x_NX.dtype, H, first=int(relay_at[slot]))
            self.engine.copy_rows(msg.payload.view(x_NX.dtype).view(n, H), None, into, None)
            self.fabric.release("hier_dispatch", peer, call)
            lap(call.timers, "forward")
        own = r.own_token_O.numel()
        self.engine.copy_rows(x_NX, r.own_token_O, rows(fwd_FX, own, x_NX.dtype, H, first=S), None)
        t.publish(b.data, call, {"count": S + own, "dtype": DTYPE_CODES[x_NX.dtype]})
        lap(call.timers, "forward")

    def _landed(self, lane: str, call: CallId, mine: torch.Tensor, peers: list[int] | None = None):
        """Each rail peer's (or each of `peers`') message of `call` on `lane` as it lands, its call
        header checked."""
        peers = [p for _, p in self._rail_peers()] if peers is None else peers
        differ = other_call_check(call, self.me, mine)
        arrivals = self.fabric.arrivals(lane, call, peers, f"{call.kind} (across nodes)", differ)
        for msg in timed(arrivals, call.timers):
            check_message(call, self.me, mine, msg.peer, msg.header, WORDS + 1)
            yield msg

    def _count(self, call: CallId, msg: Message, most: int, row_bytes: int) -> int:
        """A landed message's row count, within [0, most] and matching its payload, or the peer is blamed."""
        n = int(msg.header[COUNT])
        if not 0 <= n <= most or msg.payload.numel() != n * row_bytes:
            said = f"{n} rows in {msg.payload.numel()} bytes"
            raise self._bad(
                call, msg.peer, f"{call.kind}: rank {msg.peer} announced {said}, capacity is {most}"
            )
        return n

    # -- combine ----------------------------------------------------------------------------------

    def _combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        self._check_whole_nodes(self._masked())
        route: HierRoute = handle.route
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        mine = self._header(call, handle=handle.seq, dtype=DTYPE_CODES[x_MH.dtype], topk=K or NONE)
        try:
            self.fabric.begin(call)
            lap(call.timers, "between")
            self._put_to_forwarders(call, x_MH, topk_weights_MK, route)
            own_OY = self._reduce_to_rail(call, mine, x_MH.dtype, x_MH.shape[1], K, route)
            H, N = x_MH.shape[1], handle.num_tokens
            out_NH = torch.empty(N, H, dtype=x_MH.dtype, device="cpu")
            out_NK = torch.empty(N, K, dtype=torch.float32, device="cpu") if K else None
            self._sum_partials(call, mine, own_OY, route, [(out_NH, 0)] + ([(out_NK, H)] if K else []))
            return out_NH, out_NK
        except UbepError as error:
            self._give_up(call, error)
            raise

    def _reduce_to_rail(self, call, mine, dtype, H: int, K: int, route: HierRoute) -> torch.Tensor:
        """The in-node reduction (`_reduce_in_node`'s sums, in its order), each rail peer's block summed
        straight into its message, which is sent at once: no float32 partial of the crossing rows to
        fill and copy again. Returns the own tokens' partials (float32 [O, H + K])."""
        back_QH, back_QK, v_Q, row_Q = self._rows_back(call, dtype, H, K, route)
        F, Y = route.fwd_in_node_FV.shape[0], H + K
        relay_at = prefix_offsets(route.relay_counts_G).tolist()
        # The rows back are node-rank-major, ascending in each: a block of the forward set is one
        # run of them per node rank, found by searching (node rank, row) keys.
        key_Q = v_Q * F + row_Q
        start_V1 = F * torch.arange(self.P, dtype=torch.int64, device="cpu")[:, None]

        def reduce_into(out_nY: torch.Tensor, a: int, z: int) -> None:
            bounds_V2 = start_V1 + torch.tensor([a, z], dtype=torch.int64, device="cpu")
            ends = torch.searchsorted(key_Q, bounds_V2).tolist()
            out_nY.zero_()
            for lo, hi in ends:
                self.engine.accumulate_rows(out_nY[:, :H], back_QH[lo:hi], row_Q[lo:hi] - a)
                if K:
                    self.engine.accumulate_rows(out_nY[:, H:], back_QK[lo:hi], row_Q[lo:hi] - a)

        lap(call.timers, "forward")
        for g, peer in self._rail_peers():
            a, z = relay_at[g], relay_at[g + 1]
            out = self.fabric.outbox("hier_combine", peer, call, WORDS + 1, (z - a) * 4 * Y)
            out.header[:WORDS], out.header[COUNT] = mine, z - a
            reduce_into(out.payload.view(torch.float32).view(z - a, Y), a, z)
            lap(call.timers, "forward")
            self.fabric.send(out)
            lap(call.timers, "send")
        own_OY = torch.empty(F - relay_at[-1], Y, dtype=torch.float32, device="cpu")
        reduce_into(own_OY, relay_at[-1], F)
        lap(call.timers, "forward")
        return own_OY

    def _sum_partials(self, call, mine, own_OY, route: HierRoute, outs: list[tuple[torch.Tensor, int]]):
        """Every node's partials of this rank's tokens, once all have landed, summed in rail order (this
        node's, `own_OY`, at this rank's slot) in float32 and rounded once into each out [N, n] of
        `outs` from its first column on (`Engine.reduce_blocks`): each partial is read once, with no
        float32 [N, Y] sum to zero, add into and cast."""
        G, Y = len(self.rail), own_OY.shape[1]
        send_at = prefix_offsets(route.send_counts_G).tolist()
        # A masked node returns nothing: the rows a dispatch before the mask sent there are left out.
        landed: dict[int, torch.Tensor] = {self.slot: own_OY}
        for msg in self._landed("hier_combine", call, mine):
            slot = self.rail.index(msg.peer)
            want = send_at[slot + 1] - send_at[slot]
            n = self._count(call, msg, self.most_rows, 4 * Y)
            if n != want:
                raise self._bad(
                    call, msg.peer, f"combine: rank {msg.peer} returned {n} partials, expected {want}"
                )
            landed[slot] = msg.payload.view(torch.float32).view(n, Y)
            lap(call.timers, "receive")
        order = [g for g in range(G) if g in landed]
        tokens = [
            route.own_token_O if g == self.slot else route.send_token_S[send_at[g] : send_at[g + 1]]
            for g in order
        ]
        for out, first in outs:
            blocks = [landed[g][:, first : first + out.shape[1]] for g in order]
            self.engine.reduce_blocks(blocks, tokens, out)
        for g in order:
            if g != self.slot:
                self.fabric.release("hier_combine", self.rail[g], call)
        lap(call.timers, "receive")

    # -- failures ---------------------------------------------------------------------------------

    def _bad(self, call: CallId, culprit: int, message: str) -> PeerDataError:
        """Blame rail peer `culprit`: the node peers (through the heap) and the rail peers learn it."""
        self._tell(call, culprit, rejected=False)
        self.t.abort(call)
        return PeerDataError(message, culprit=culprit)

    def _give_up(self, call: CallId, error: UbepError) -> None:
        """This rank leaves `call` on `error`: its node peers and rail peers learn it (blame passed on)."""
        self._tell(call, blame_of(error), rejected=False)
        self.t.abort(call)

    def _tell(self, call: CallId, culprit: int | None, rejected: bool) -> None:
        if self._told != call.seq:
            self._told = call.seq
            self.fabric.abort(call, culprit, rejected)

    def abort(self, call: CallId) -> None:
        """The Buffer gives up on `call` outside the halves (it rejected this rank's input): node peers
        learn at once through the heap, rail peers from an abort notice."""
        self._tell(call, None, rejected=True)
        call = in_node(call)
        self._finish(call)
        self.t.abort(call)

    # -- membership -------------------------------------------------------------------------------

    def mask(self, ranks: Collection[int], seq: int) -> int:
        """Leave `ranks` out of every later call (`Fabric.mask`): whole nodes only, so the rails lose
        their masked slots and no route passes a masked forwarder."""
        self._check_whole_nodes(ranks)
        return self.fabric.mask(ranks, seq)

    def agree_to_mask(self, error: Exception, seq: int) -> Agreement | None:
        """Agree over the fabric on whom to leave out (`Fabric.agree_to_mask`); every staying rank
        raises alike where that is part of a node (`_check_whole_nodes`), and so does every later call."""
        agreed = self.fabric.agree_to_mask(error, seq)
        if agreed is not None:
            self._check_whole_nodes(agreed.gone)
        return agreed

    def _check_whole_nodes(self, ranks: Collection[int]) -> None:
        """NotImplementedError naming the masked ranks of a node whose other ranks stay: a node's rows
        from each other node cross through its rank on their rail, and routes around a masked
        forwarder (through another rank of its node) are not built. Raised before any call uses the
        membership, on every staying rank alike (they pass the same ranks)."""
        gone = set(ranks)
        for node in range(self.nodes.num_nodes):
            members = set(self.nodes.node_ranks(node))
            if gone & members and not members <= gone:
                raise NotImplementedError(
                    f"transport 'hier': rank(s) {sorted(gone & members)} of node {node} are masked and "
                    f"rank(s) {sorted(members - gone)} of it stay; hier masks whole nodes only (their rows "
                    "cross through the masked ranks as forwarders, and routes around a forwarder are not "
                    "built): mask all of its ranks, or build the Buffer again without them"
                )

    def close(self) -> None:
        super().close()
        self.fabric.close()

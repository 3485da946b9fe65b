"""Three tiers of distance: racks of hosts of ranks, the slow tier crossed once per token and rack
(transport "tiers", protocol "ubep"; rails over the fabric, no collective inside a call).

Racks are consecutive hosts: with Q racks of J hosts of P ranks, host h is in rack h // J. A rank's
*rack rail* is the rank at its place (same host index in the rack, same local index) in every
rack; its *host rail* is the rank with its local index on every host of its own rack.

    dispatch  slow     to each rack-rail peer: the header, the row count, each token that needs any
                       rank of that rack, once (source token, global top-k ids, weights, row)
              gather   the rows this rank distributes in its rack: the rack-rail peers' (in rack
                       order, the own rack's place holding this rank's own tokens for its rack)
              fast     as `HierFabric` over the host rail, each distributed row once per host of
                       the rack (its source rank travels with it); relay and fan out as there
    combine   reduce   in the host, as `HierExchange`; float32 partials back over the host rail,
                       summed per distributed row in host order
              slow     each rack-rail peer's rows' sums back to it; the home adds every rack's
                       sums in rack order, in float32, and casts once

So a token crosses the slow tier once per remote rack that needs it, the fast tier once per remote
host of that rack, and shared memory inside a host. With one host per rack it is hier over racks;
with one rack, hier. Every source's rows reach a host through the rank with the source's local
index (the rack-rail peer keeps the local index), as `HierExchange._pull` needs.

Legend: see `ubep.across.collectives.bsp_hier`; also Q racks, D rows this rank distributes in its
rack (own and from the rack-rail peers), J hosts per rack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ubep.across.call_header import NONE, WORDS
from ubep.across.collectives.bsp_hier import HierRoute, as_bytes, columns
from ubep.across.fabric.base import Fabric, Lane
from ubep.across.ubep_hier import HierFabric
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import UbepError
from ubep.group import GroupInfo
from ubep.layout import destination_major, prefix_offsets, token_in_rank
from ubep.nodes import NodeMap
from ubep.protocols.base import DTYPE_CODES, Received, SendPlan, Sizing, rows
from ubep.results import DispatchHandle, RecvRoute
from ubep.timers import lap

RACK_DISPATCH, RACK_COMBINE = "tier_rack_dispatch", "tier_rack_combine"  # the slow tier's lanes


@dataclass(frozen=True, slots=True)
class Racks:
    """Where a rank sits among Q racks of J consecutive hosts, and its two rails."""

    racks: int
    rack: int  # this rank's rack
    rack_rail: tuple[int, ...]  # the rank at this rank's place in every rack, by rack
    host_rail: tuple[int, ...]  # the rank with this rank's local index on every host of its rack
    host_slot: int  # this rank's host within its rack
    rack_ranks_QW: torch.Tensor  # int64 [Q, W]: the ranks of each rack, ascending
    host_ranks_JP: torch.Tensor  # int64 [J, P]: the ranks of each host of this rank's rack

    @classmethod
    def of(cls, node_of_rank: tuple[int, ...], rank: int, racks: int) -> Racks:
        nodes = NodeMap(node_of_rank)
        G = nodes.num_nodes
        if racks < 2 or G % racks:
            raise ValueError(
                f"transport='tiers': racks must be at least 2 and divide the {G} hosts, got {racks}"
            )
        J, local, node = G // racks, nodes.local_index(rank), node_of_rank[rank]
        rack, j = divmod(node, J)
        hosts = [[nodes.node_ranks(q * J + h) for h in range(J)] for q in range(racks)]
        return cls(
            racks=racks,
            rack=rack,
            rack_rail=tuple(hosts[q][j][local] for q in range(racks)),
            host_rail=tuple(hosts[rack][h][local] for h in range(J)),
            host_slot=j,
            rack_ranks_QW=torch.tensor(
                [sum(hosts[q], ()) for q in range(racks)], dtype=torch.int64, device="cpu"
            ),
            host_ranks_JP=torch.tensor(hosts[rack], dtype=torch.int64, device="cpu"),
        )


def lanes(s: Sizing, where: Racks) -> tuple[Lane, ...]:
    """The fabric's lanes: T rows a message between rack-rail peers (routing beside each), Q * T
    between host-rail peers (the rows distributed in a rack; source rank and routing beside each),
    and the float32 partials back on each."""
    T, K, B, Q = s.capacity, s.max_topk, s.row_bytes, where.racks
    return (
        Lane(RACK_DISPATCH, WORDS + 1, T * (8 + 12 * K + B), peers=where.rack_rail),
        Lane(RACK_COMBINE, WORDS + 1, T * 4 * (s.hidden + K), peers=where.rack_rail),
        Lane("hier_dispatch", WORDS + 1, Q * T * (16 + 12 * K + B), peers=where.host_rail),
        Lane("hier_combine", WORDS + 1, Q * T * 4 * (s.hidden + K), peers=where.host_rail),
    )


@dataclass(frozen=True, slots=True)
class TierRoute:
    """One dispatch's tables across the three tiers, kept in the handle (`DispatchHandle.route`).

    rack_send_token_S: own tokens sent over the slow tier, rack-major, ascending in each block
    rack_send_Q:       rows sent to each rack (0 at the own rack)
    held_Q:            rows this rank distributes from each rack (at the own rack: own tokens)
    own_token_O:       own tokens that need a rank of the own rack (the own rack's block)
    host:              the host tier's `HierRoute`, whose tokens index the D distributed rows
    """

    rack_send_token_S: torch.Tensor
    rack_send_Q: torch.Tensor
    held_Q: torch.Tensor
    own_token_O: torch.Tensor
    host: HierRoute


class Distributed(NamedTuple):
    """The D rows a rank distributes in its rack, in rack order."""

    ids_D2: torch.Tensor  # int64 (source rank, source token)
    topk_DK: torch.Tensor  # int64 global expert ids
    w_DK: torch.Tensor  # float32
    x_DX: torch.Tensor  # the rows


class TierFabric(HierFabric):
    """Dispatch/combine over racks of hosts: the slow tier once per token and rack, then `HierFabric`'s
    host rail within the rack, then shared memory within the host."""

    def __init__(self, info: GroupInfo, sizing: Sizing, timeout_s: float, engine: Engine, fabric: Fabric,
                 reason: str, where: Racks):  # fmt: skip
        super().__init__(info, sizing, timeout_s, engine, fabric, reason)
        self.where = where
        # the host tier is the own rack's hosts: `HierFabric` runs over that rail
        self.rail, self.slot, self.G = where.host_rail, where.host_slot, len(where.host_rail)
        self.slot_ranks_GV = where.host_ranks_JP
        self.most_rows = where.racks * sizing.capacity
        J = len(where.host_rail)
        self.across_hosts = (
            f"three tiers over the {fabric.name} fabric ({reason}), no collective inside a call: the "
            f"slow tier between {where.racks} racks once per token and rack, the fast tier between the "
            f"{J} hosts of a rack once per token and host, shared memory within a host"
        )

    def _rack_peers(self) -> list[tuple[int, int]]:
        """(rack, rank) of every other rack's rank on this rank's rack rail."""
        Q, me = self.where.racks, self.where.rack
        return [((me + i) % Q, self.where.rack_rail[(me + i) % Q]) for i in range(1, Q)]

    # -- dispatch ---------------------------------------------------------------------------------

    def _dispatch_over_fabric(self, call: CallId, plan: SendPlan, x_NX: torch.Tensor) -> Received:
        K, N = plan.topk_idx_NK.shape[1], plan.topk_idx_NK.shape[0]
        mine = self._header(call, dtype=DTYPE_CODES[x_NX.dtype], topk=K)
        Q, W = self.where.rack_ranks_QW.shape
        in_rack_NQ = plan.is_token_in_rank_NR[:, self.where.rack_ranks_QW.flatten()].view(N, Q, W).any(dim=2)
        own_O = torch.nonzero(in_rack_NQ[:, self.where.rack]).flatten()
        in_rack_NQ[:, self.where.rack] = False  # own tokens for the own rack stay in it
        rack_S, token_S = destination_major(in_rack_NQ)
        send_Q = torch.bincount(rack_S, minlength=Q)
        idx_NK, w_NK = plan.topk_idx_NK, plan.topk_weights_NK
        meta_SB = torch.cat(
            [as_bytes(token_S[:, None]), as_bytes(idx_NK[token_S]), as_bytes(w_NK[token_S])], dim=1
        )
        self.fabric.begin(call)
        lap(call.timers, "between")
        at_Q = prefix_offsets(send_Q)
        for q, peer in self._rack_peers():
            a, z = int(at_Q[q]), int(at_Q[q + 1])
            self._send_rows(call, RACK_DISPATCH, peer, mine, meta_SB[a:z], x_NX, token_S[a:z])
        lap(call.timers, "send")
        own = (
            torch.stack([torch.full_like(own_O, self.me), own_O], dim=1),
            idx_NK[own_O], w_NK[own_O], x_NX[own_O],
        )  # fmt: skip
        held, held_Q = self._gather_rack(call, mine, own, K, x_NX)
        is_DR = token_in_rank(held.topk_DK, self.sizing.placement)
        send_token_T, send_J, own_host_O = self._home_plan(is_DR)
        at_J = prefix_offsets(send_J)
        meta_TB = torch.cat(
            [as_bytes(held.ids_D2[send_token_T]), as_bytes(held.topk_DK[send_token_T]),
             as_bytes(held.w_DK[send_token_T])], dim=1,
        )  # fmt: skip
        lap(call.timers, "between")
        for g, peer in self._rail_peers():
            a, z = int(at_J[g]), int(at_J[g + 1])
            self._send_rows(call, "hier_dispatch", peer, mine, meta_TB[a:z], held.x_DX, send_token_T[a:z])
        lap(call.timers, "send")
        relay_J = self._relay_held(call, mine, held, own_host_O, K)
        got = self._gather_routing(call, x_NX.dtype, K)
        host = HierRoute(send_token_T, send_J, own_host_O, relay_J, got.fwd_in_node_FV, got.fwd_M,
                         got.fwd_row_M, got.fwd_offset_V)  # fmt: skip
        route = TierRoute(token_S, send_Q, held_Q, own_O, host)
        prefix_R1 = prefix_offsets(torch.bincount(got.src_rank_M, minlength=self.sizing.num_ranks))
        recv_x_MX = self._gather_rows(call, x_NX, host, prefix_R1)
        recv = RecvRoute.of(got.src_token_M, prefix_R1, route)
        return Received.unpacking(plan, recv_x_MX, got.topk_MK, got.weights_MK, recv)

    def _gather_rack(self, call: CallId, mine, own: tuple, K: int, x_NX) -> tuple[Distributed, torch.Tensor]:
        """The rows this rank distributes in its rack, in rack order (`own` at the own rack's place), as
        each rack-rail peer's message lands; returns them and the rows from each rack (int64 [Q])."""
        Q, H = self.where.racks, x_NX.shape[1]
        blocks: dict[int, tuple] = {self.where.rack: own}
        meta = 8 + 12 * K
        peers = [p for _, p in self._rack_peers()]
        for msg in self._landed(RACK_DISPATCH, call, mine, peers):
            q = self.where.rack_rail.index(msg.peer)
            n = self._count(call, msg, self.sizing.capacity, meta + H * x_NX.element_size())
            token_n, idx_nK, w_nK = self._routing(call, msg.peer, msg.payload[: n * meta].view(n, meta), K)
            rows_nX = msg.payload[n * meta :].view(x_NX.dtype).view(n, H).clone()  # the inbox goes back
            ids_n2 = torch.stack([torch.full_like(token_n, msg.peer), token_n], dim=1)
            blocks[q] = (ids_n2, idx_nK, w_nK, rows_nX)
            self.fabric.release(RACK_DISPATCH, msg.peer, call)
            lap(call.timers, "forward")
        parts = [blocks[q] for q in range(Q)]
        held_Q = torch.tensor([p[0].shape[0] for p in parts], dtype=torch.int64, device="cpu")
        return Distributed(*(torch.cat([p[i] for p in parts]) for i in range(4))), held_Q

    def _relay_held(self, call: CallId, mine, held: Distributed, own_O: torch.Tensor, K: int) -> torch.Tensor:
        """Each host-rail peer's rows and routing into this rank's forward set as they land (in host
        order), then the distributed rows `own_O` for this host; ROUTE and DATA stamped. Returns the
        rows each host sent here (int64 [J])."""
        b, t, me, H, dtype = self.blocks, self.t, self.local, held.x_DX.shape[1], held.x_DX.dtype
        J = len(self.rail)
        relay_J = torch.zeros(J, dtype=torch.int64, device="cpu")
        ids, topk = t.view(b.ids, me, call), t.view(b.topk, me, call)
        weights, fwd_FX = t.view(b.weights, me, call), t.view(b.x, me, call)
        landed: dict[int, tuple] = {}
        meta = 16 + 12 * K
        for msg in self._landed("hier_dispatch", call, mine):
            j = self.rail.index(msg.peer)
            n = self._count(call, msg, self.most_rows, meta + H * held.x_DX.element_size())
            ids_n2, idx_nK, w_nK = self._held_routing(
                call, msg.peer, msg.payload[: n * meta].view(n, meta), K
            )
            landed[j] = (ids_n2, idx_nK, w_nK, msg.payload[n * meta :].view(dtype).view(n, H))
            lap(call.timers, "forward")
        at = 0
        for j in range(J):  # in host order, the own host's rows last
            if j == self.slot:
                continue
            ids_n2, idx_nK, w_nK, rows_nX = landed.pop(j)
            n = ids_n2.shape[0]
            ids[at : at + n], topk[at : at + n, :K], weights[at : at + n, :K] = ids_n2, idx_nK, w_nK
            self.engine.copy_rows(rows_nX, None, rows(fwd_FX, n, dtype, H, first=at), None)
            self.fabric.release("hier_dispatch", self.rail[j], call)
            relay_J[j], at = n, at + n
        F = at + own_O.numel()
        ids[at:F], topk[at:F, :K], weights[at:F, :K] = (
            held.ids_D2[own_O],
            held.topk_DK[own_O],
            held.w_DK[own_O],
        )
        self.engine.copy_rows(held.x_DX, own_O, rows(fwd_FX, own_O.numel(), dtype, H, first=at), None)
        t.publish(b.route, call, {"count": F, "dtype": DTYPE_CODES[dtype], "topk": K})
        t.publish(b.data, call, {"count": F, "dtype": DTYPE_CODES[dtype]})
        lap(call.timers, "forward")
        return relay_J

    def _held_routing(self, call: CallId, peer: int, meta_nB: torch.Tensor, K: int):
        """(source ids [n, 2], global top-k ids [n, K], weights [n, K]) of a host-rail peer's rows,
        copied out and checked: a source rank outside [0, R) blames the peer, then as `_routing`."""
        rank_n1, rest_nB = columns(meta_nB, [(torch.int64, 1)])[0], meta_nB[:, 8:]
        R = self.sizing.num_ranks
        if rank_n1.numel() and (rank_n1.min() < 0 or rank_n1.max() >= R):
            raise self._bad(call, peer, f"dispatch: rank {peer} relays source ranks outside [0, {R})")
        token_n, idx_nK, w_nK = self._routing(call, peer, rest_nB, K)
        return torch.cat([rank_n1, token_n[:, None]], dim=1), idx_nK, w_nK

    def _dispatch_cached_over_fabric(self, call, plan: SendPlan, x_NX, handle: DispatchHandle) -> Received:
        """The same rows cross the three tiers again, x only: the routing is in the handle."""
        r: TierRoute = handle.route
        mine = self._header(call, handle=handle.seq, dtype=DTYPE_CODES[x_NX.dtype])
        self.fabric.begin(call)
        lap(call.timers, "between")
        at_Q, held_at = prefix_offsets(r.rack_send_Q), prefix_offsets(r.held_Q)
        for q, peer in self._rack_peers():
            a, z = int(at_Q[q]), int(at_Q[q + 1])
            self._send_rows(call, RACK_DISPATCH, peer, mine, None, x_NX, r.rack_send_token_S[a:z])
        lap(call.timers, "send")
        H, me = x_NX.shape[1], self.where.rack
        x_DX = x_NX.new_empty((int(r.held_Q.sum()), H))
        x_DX[int(held_at[me]) : int(held_at[me + 1])] = x_NX[r.own_token_O]
        for msg in self._landed(RACK_DISPATCH, call, mine, [p for _, p in self._rack_peers()]):
            q = self.where.rack_rail.index(msg.peer)
            n = self._count(call, msg, self.sizing.capacity, H * x_NX.element_size())
            if n != int(r.held_Q[q]):
                said = f"sends {n} rows here, this rank's handle expects {int(r.held_Q[q])}"
                raise self._bad(
                    call, msg.peer, f"dispatch: rank {msg.peer} {said} (all ranks must pass the same handle)"
                )
            x_DX[int(held_at[q]) : int(held_at[q]) + n] = msg.payload.view(x_NX.dtype).view(n, H)
            self.fabric.release(RACK_DISPATCH, msg.peer, call)
            lap(call.timers, "forward")
        self._relay_cached(call, mine, x_DX, r.host)
        recv_x_MX = self._gather_rows(call, x_NX, r.host, handle.recv_prefix_R1)
        return Received.unpacking(plan, recv_x_MX, None, None, handle.recv)

    # -- combine ----------------------------------------------------------------------------------

    def _combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        r: TierRoute = handle.route
        K = 0 if topk_weights_MK is None else topk_weights_MK.shape[1]
        mine = self._header(call, handle=handle.seq, dtype=DTYPE_CODES[x_MH.dtype], topk=K or NONE)
        try:
            self.fabric.begin(call)
            lap(call.timers, "between")
            self._put_to_forwarders(call, x_MH, topk_weights_MK, r.host)
            own_OY = self._reduce_to_rail(call, mine, x_MH.dtype, x_MH.shape[1], K, r.host)
            held_DY = torch.empty(int(r.held_Q.sum()), own_OY.shape[1], dtype=torch.float32, device="cpu")
            self._sum_partials(call, mine, own_OY, r.host, [(held_DY, 0)])
            out_NY = self._sum_racks(call, mine, held_DY, r, handle.num_tokens)
        except UbepError as error:
            self._give_up(call, error)
            raise
        H = x_MH.shape[1]
        return out_NY[:, :H].to(x_MH.dtype), (out_NY[:, H:].contiguous() if K else None)

    def _sum_racks(self, call: CallId, mine, held_DY: torch.Tensor, r: TierRoute, N: int) -> torch.Tensor:
        """float32 [N, Y]: each rack-rail peer's rows' sums back over the slow tier, then every rack's
        sums of this rank's tokens added in rack order (the own rack's from `held_DY`)."""
        Q, Y, me = self.where.racks, held_DY.shape[1], self.where.rack
        held_at, send_at = prefix_offsets(r.held_Q).tolist(), prefix_offsets(r.rack_send_Q).tolist()
        index_D = torch.arange(held_DY.shape[0], dtype=torch.int64, device="cpu")
        lap(call.timers, "between")
        for q, peer in self._rack_peers():
            self._send_rows(
                call, RACK_COMBINE, peer, mine, None, held_DY, index_D[held_at[q] : held_at[q + 1]]
            )
        lap(call.timers, "send")
        landed: dict[int, torch.Tensor] = {me: held_DY[held_at[me] : held_at[me + 1]]}
        for msg in self._landed(RACK_COMBINE, call, mine, [p for _, p in self._rack_peers()]):
            q = self.where.rack_rail.index(msg.peer)
            want = send_at[q + 1] - send_at[q]
            n = self._count(call, msg, self.sizing.capacity, 4 * Y)
            if n != want:
                raise self._bad(
                    call, msg.peer, f"combine: rank {msg.peer} returned {n} sums, expected {want}"
                )
            landed[q] = msg.payload.view(torch.float32).view(n, Y).clone()
            self.fabric.release(RACK_COMBINE, msg.peer, call)
            lap(call.timers, "receive")
        out_NY = torch.zeros(N, Y, dtype=torch.float32, device="cpu")
        for q in range(Q):  # in rack order: the same sum on every layout of arrivals
            tokens = r.own_token_O if q == me else r.rack_send_token_S[send_at[q] : send_at[q + 1]]
            out_NY.index_add_(0, tokens, landed[q])
        return out_NY

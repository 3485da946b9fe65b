"""The UBEP protocol: no global barrier, data as flag, every byte moved once.

Dispatch, on rank `me` for call epoch e (regions double-buffered by e % 2):
  1. routing role: write own top-k, and for every destination the ascending
     list of tokens it gets, then publish ROUTE (token count, dtype, top-k and
     the per-destination counts) stamped e. The counts travel with the routing:
     no count round, and no receiver recomputes membership over source rows.
  2. token role: copy own x into own memory once, then publish DATA stamped e.
  3. as each source's ROUTE lands: its rows for `me` are its list for `me`;
     their local expert ids come from those rows of its top-k only.
  4. as each source's DATA lands (any order): gather its rows straight from
     its memory into their final place in recv_x.
Combine is pull-and-reduce: each expert rank publishes its output rows (in
the order it received them) once, with the boundaries of each home's block;
each home reads its block from every expert rank, in ascending rank order
(the reference's accumulation order), accumulating float32 per token as the
blocks land. One read of each row, no staging copy, no barrier.

Why no barrier is needed between calls: a rank starts call e + 2 (which reuses
e's half) only after finishing call e + 1, which needed every peer's e + 1
stamp, which every peer writes only after finishing call e. See docs/design.md.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ubep import schedule, topology
from ubep.calls import CallId
from ubep.engine import Engine
from ubep.engine.base import BlockIndexError
from ubep.errors import PeerDataError
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.layout import prefix_offsets
from ubep.protocols import halves
from ubep.protocols.base import CODE_DTYPES, DTYPE_CODES, Received, SendPlan, Sizing, rows, spread
from ubep.protocols.combine.torch_halves import publish_back, reduce_home
from ubep.protocols.ubep.blocks import UbepBlocks
from ubep.registry import UBEP
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.base import Transport


class UbepExchange(halves.OnHalves):
    """UBEP dispatch/combine over any transport, with any engine."""

    name = UBEP.name

    def __init__(
        self,
        transport: Transport,
        engine: Engine,
        sizing: Sizing,
        faults: FaultPoints = NO_FAULTS,
        workers: int = 1,
        policy: str = schedule.DISTANCE,
        capturable: bool = False,
    ):
        self.t, self.engine, self.sizing, self.faults = transport, engine, sizing, faults
        self.me, self.R = transport.rank, transport.num_ranks
        self.blocks = UbepBlocks.of(sizing)
        placement = sizing.placement
        self._local_of_E = torch.where(placement.rank_of_expert_E == self.me, placement.local_index_E, -1)
        self.workers, self.policy = workers, schedule.policy_name(policy)
        self._topology = topology.host(cores=self.R) if workers > 1 else None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ubep-move") if workers > 1 else None

        def on_numba():
            from ubep.protocols.ubep.numba_driver import UbepNumba  # imports numba: only on its engine

            return UbepNumba(transport, self.blocks, sizing, faults, self._local_of_E)

        def on_triton():
            from ubep.protocols.ubep.triton_driver import UbepTriton  # imports triton: only on its engine

            return UbepTriton(transport, self.blocks, sizing, faults, self._local_of_E, engine, capturable)

        # each call half one compiled function, where the engine and memory allow
        on_heap = workers == 1 and hasattr(transport, "address_table")
        self._compiled = halves.compiled_form(engine, on_numba, on_triton) if on_heap else None
        halves.refuse_capturable(capturable, self._compiled, self.name)

    # -- dispatch ---------------------------------------------------------------------------------

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        self.t.begin(call)
        call = call.exact()
        if self._compiled is not None:
            return self._compiled.dispatch(call, plan, handle)
        self._publish(call, plan)
        self.faults.at("dispatch.sent", call)
        x_NH = plan.x_NH
        if handle is None:
            routes = self._routes(call, self.t.live, x_NH.dtype)
            counts_R, recv_idx, recv_w, src_token_M = self._routing(call, plan, routes)
        else:
            routes = None  # read per batch as payloads land
            counts_R, recv_idx, recv_w, src_token_M = (
                handle.recv_counts(),
                None,
                None,
                handle.recv_src_token_M,
            )
        prefix_R1 = prefix_offsets(counts_R)
        M = int(prefix_R1[-1])
        recv_x_MH = torch.empty(M, x_NH.shape[1], dtype=x_NH.dtype, device=x_NH.device)
        scales_NS = plan.scales_NS
        recv_scales_MS = (
            None
            if scales_NS is None
            else torch.empty(M, scales_NS.shape[1], dtype=scales_NS.dtype, device=scales_NS.device)
        )
        self._gather_tokens(call, x_NH, recv_x_MH, recv_scales_MS, src_token_M, prefix_R1.tolist(), routes)
        route = RecvRoute.of(src_token_M, prefix_R1) if handle is None else handle.recv
        self.t.check_member("dispatch")  # what was read above was whole
        return Received(recv_x_MH, recv_idx, recv_w, route, recv_scales_MS)

    def _publish(self, call: CallId, plan: SendPlan) -> None:
        b, t, me = self.blocks, self.t, self.me
        N, H = plan.x_NH.shape
        values = {
            "num_tokens": N,
            "dtype": DTYPE_CODES[plan.x_NH.dtype],
            "counts": plan.send_counts_R.tolist(),
        }
        if plan.topk_idx_NK is not None:
            K = plan.topk_idx_NK.shape[1]
            t.view(b.topk, me, call)[:N, :K].copy_(plan.topk_idx_NK)
            t.view(b.weights, me, call)[:N, :K].copy_(plan.topk_weights_NK)
            values["topk"] = K
        lists_RT = t.view(b.lists, me, call)
        for dst, tokens in enumerate(plan.send_tokens()):
            lists_RT[dst, : tokens.numel()].copy_(tokens)
        values["num_tokens"] = self.faults.count("dispatch.count", call, N)
        t.publish(b.route, call, values)  # routing and counts are visible from here on
        rows(t.view(b.x, me, call), N, plan.x_NH.dtype, H).copy_(plan.x_NH)
        if plan.scales_NS is not None:
            t.view(b.scales, me, call)[:N].copy_(plan.scales_NS)
        t.publish(b.data, call, {})  # the payload is visible from here on

    def _routes(self, call: CallId, sources, dtype: torch.dtype) -> dict:
        """The route records of `sources` (all landed), checked against this rank's call: one
        array row per rank, zero for ranks not among `sources` (masked: they send nothing)."""
        sources = list(sources)
        self.t.wait_landed(self.blocks.route, call, sources, "dispatch (routing)")
        routes = self.t.read_all(self.blocks.route, call, sources)
        wrong = np.flatnonzero(routes["dtype"] != DTYPE_CODES[dtype])
        if wrong.size:
            src, sent = sources[wrong[0]], CODE_DTYPES.get(int(routes["dtype"][wrong[0]]))
            raise self.t.bad_data(call, src, f"dispatch: rank {src} sent {sent}, this rank {dtype}")
        return spread(routes, sources, self.R)

    def _routing(self, call: CallId, plan: SendPlan, routes: dict):
        """Every source's rows for this rank, their top-k as seen here, in source-rank order.

        One kernel derives the local top-k of every source's listed rows, once all
        routing has landed (it is published first, so it normally has).
        """
        b, t, K = self.blocks, self.t, plan.topk_idx_NK.shape[1]
        wrong = [s for s in self.t.live if routes["topk"][s] != K]
        if wrong:
            src = wrong[0]
            raise PeerDataError(
                f"dispatch: rank {src} routed with top-k {routes['topk'][src]}, this rank with {K}"
            )
        counts, tokens = routes["counts"][:, self.me].tolist(), routes["num_tokens"].tolist()
        # one copy of every source's list, read once: what is checked is what is used
        src_token_M = torch.cat([t.view(b.lists, s, call)[self.me, : counts[s]] for s in range(self.R)])
        lists = src_token_M.split(counts)
        M = sum(counts)
        recv_idx_MK = torch.empty(M, K, dtype=torch.int64, device=src_token_M.device)
        recv_w_MK = torch.empty(M, K, dtype=torch.float32, device=src_token_M.device)
        topks = [t.view(b.topk, s, call)[: tokens[s], :K] for s in range(self.R)]
        weights = [t.view(b.weights, s, call)[: tokens[s], :K] for s in range(self.R)]
        try:
            self.engine.localize_blocks(topks, weights, lists, self._local_of_E, recv_idx_MK, recv_w_MK)
        except BlockIndexError as error:  # names the source: nothing is read again
            src, E = error.block, self.sizing.placement.num_experts
            said = {
                "row": f"listed tokens outside [0, {tokens[src]})",
                "expert": f"routed to expert ids outside [-1, {E})",
            }
            raise self.t.bad_data(call, src, f"dispatch: rank {src} {said[error.what]}") from None
        selects_none_M = (recv_idx_MK >= 0).sum(dim=1) == 0
        if M and selects_none_M.any():  # the source of the first such row: the counts run in source order
            src = int(
                torch.searchsorted(
                    torch.tensor(counts, dtype=torch.int64, device=selects_none_M.device).cumsum(0),
                    selects_none_M.nonzero()[0, 0],
                    right=True,
                )
            )
            raise self.t.bad_data(
                call,
                src,
                f"dispatch: rank {src} listed a token for this rank that selects none of its experts",
            )
        return torch.tensor(counts, dtype=torch.int64, device="cpu"), recv_idx_MK, recv_w_MK, src_token_M

    def _gather_tokens(self, call, x_NH, recv_x_MH, recv_scales_MS, src_token_M, prefix, routes) -> None:
        """Copy every source's rows from its memory into their final place, as their payloads land:
        one kernel for all the sources found landed at one look.

        With several workers this thread keeps the waiting role and hands each
        landed source's slices to the movers, which copy (GIL released) while it
        waits for the next source.
        """
        b, t, H = self.blocks, self.t, x_NH.shape[1]
        pieces, moving = self._pieces(prefix), []
        try:
            for landed in t.arrivals(b.data, call, t.live, "dispatch (tokens)"):
                batch_routes = routes or self._routes(call, landed, x_NH.dtype)  # cached dispatch: read now
                sent = batch_routes["num_tokens"][landed].tolist()
                self._check_payload(
                    call, landed, batch_routes["counts"][landed, self.me].tolist(), sent, prefix, src_token_M
                )
                batch = [(s, n) for s, n in zip(landed, sent, strict=True) if prefix[s + 1] > prefix[s]]
                sources_XH = [rows(t.view(b.x, s, call), n, x_NH.dtype, H) for s, n in batch]
                indices = [src_token_M[prefix[s] : prefix[s + 1]] for s, _ in batch]
                starts = [prefix[s] for s, _ in batch]
                if recv_scales_MS is not None:  # FP8: the scales into their own output
                    scales = [t.view(b.scales, s, call) for s, _ in batch]
                    self.engine.gather_blocks(scales, indices, recv_scales_MS, starts)
                if self._pool is None:
                    self.engine.gather_blocks(sources_XH, indices, recv_x_MH, starts)
                    continue
                for (src, _), source_XH, a in zip(batch, sources_XH, starts, strict=True):
                    for lo, hi in pieces[src]:
                        rows_n, out = src_token_M[a + lo : a + hi], recv_x_MH[a + lo : a + hi]
                        moving.append(self._pool.submit(self.engine.copy_rows, source_XH, rows_n, out, None))
        finally:
            for move in moving:
                move.result()

    def _check_payload(self, call: CallId, landed, counts, sent, prefix, src_token_M) -> None:
        """Landed sources must send this rank the rows it expects, from tokens they have."""
        for src, count, n in zip(landed, counts, sent, strict=True):
            a, z = prefix[src], prefix[src + 1]
            if count != z - a:  # a cached dispatch whose handles differ
                message = (
                    f"dispatch: rank {src} sends {count} rows here, this rank's "
                    f"handle expects {z - a} (all ranks must pass handles of the same dispatch)"
                )
                raise self.t.bad_data(call, src, message)
            if a < z and src_token_M[z - 1] >= n:  # rows ascend: the last is the largest
                raise self.t.bad_data(
                    call, src, f"dispatch: rank {src} sent {n} tokens, fewer than routed here"
                )

    def _pieces(self, prefix: list[int]) -> list[list[tuple[int, int]]]:
        """Per source, its row slices (within the source's block), one per worker's share.

        With several workers, `schedule.plan_rank` cuts the blocks into equal token
        slices, distance-aware; each source's slices then move concurrently.
        """
        counts = [prefix[s + 1] - prefix[s] for s in range(self.R)]
        if self._pool is None:
            return [[(0, c)] for c in counts]
        plan = schedule.plan_rank(
            counts,
            self.me,
            self._topology,
            workers=self.workers,
            row_bytes=self.sizing.row_bytes,
            policy=self.policy,
        )
        per_source: list[list[tuple[int, int]]] = [[] for _ in range(self.R)]
        for w in range(self.workers):
            for peer, sl, _ in plan.pieces(w):
                if sl.stop > sl.start:
                    per_source[peer].append((sl.start, sl.stop))
        return per_source

    # -- combine ----------------------------------------------------------------------------------

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        self.t.begin(call)
        call = call.exact()
        if self._compiled is not None:
            return self._compiled.combine(call, x_MH, handle, topk_weights_MK)
        back = self.blocks.back
        publish_back(self.t, back, call, x_MH, handle, topk_weights_MK)
        self.faults.at("combine.mid", call)
        self.t.wait_landed(back.back, call, self.t.live, "combine")
        combined = reduce_home(self.t, self.engine, back, call, handle, x_MH, topk_weights_MK)
        self.t.check_member("combine")  # what was read above was whole
        return combined

    def abort(self, call: CallId) -> None:
        self.t.abort(call)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.t.close()

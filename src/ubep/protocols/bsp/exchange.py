"""The BSP baseline: the same work as UBEP, in phases separated by global barriers,
as vendor EP libraries and Megatron structure it.

Dispatch: publish counts -> barrier -> token send (push each destination's rows
into its per-source staging slot, with their token indices and local top-k)
-> barrier -> flag verification -> prefix sums -> barrier -> reorder (staging
slots -> recv_x).
Combine: barrier -> publish output rows -> barrier -> pull and reduce (the same
kernels and accumulation order as UBEP's combine).

It is meant to be an honest baseline: the same engine kernels, one copy per row
per hop, barriers over the same memory rather than sockets. What it lacks, by
design, is UBEP's overlap: every rank waits at each barrier for the slowest
rank's slowest phase, and pays the count round and the reorder copy.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import torch

from ubep.calls import CallId
from ubep.engine import Engine
from ubep.errors import PeerDataError
from ubep.faults import NO_FAULTS, FaultPoints
from ubep.layout import prefix_offsets
from ubep.protocols import halves
from ubep.protocols.base import CODE_DTYPES, DTYPE_CODES, Received, SendPlan, Sizing, rows
from ubep.protocols.bsp.blocks import BspBlocks
from ubep.protocols.combine.torch_halves import publish_back, reduce_home
from ubep.registry import BSP
from ubep.results import DispatchHandle, RecvRoute
from ubep.transport.base import Transport


class BspExchange(halves.OnHalves):
    """Barrier-separated dispatch/combine over any transport, with any engine."""

    name = BSP.name

    def __init__(
        self,
        transport: Transport,
        engine: Engine,
        sizing: Sizing,
        faults: FaultPoints = NO_FAULTS,
        capturable: bool = False,
    ):
        self.t, self.engine, self.sizing, self.faults = transport, engine, sizing, faults
        self.me, self.R = transport.rank, transport.num_ranks
        self.blocks = BspBlocks.of(sizing)
        placement = sizing.placement
        self._local_of_RE = torch.stack(
            [torch.where(placement.rank_of_expert_E == r, placement.local_index_E, -1) for r in range(self.R)]
        )

        def on_numba():
            from ubep.protocols.bsp.numba_driver import BspNumba  # imports numba: only on its engine

            return BspNumba(transport, self.blocks, sizing, faults, self._local_of_RE)

        def on_triton():
            from ubep.protocols.bsp.triton_driver import BspTriton  # imports triton: only on its engine

            return BspTriton(transport, self.blocks, sizing, faults, self._local_of_RE, engine, capturable)

        # each call half one compiled function, where the engine and memory allow
        on_heap = hasattr(transport, "address_table")
        self._compiled = halves.compiled_form(engine, on_numba, on_triton) if on_heap else None
        halves.refuse_capturable(capturable, self._compiled, self.name)

    def dispatch(self, call: CallId, plan: SendPlan, handle: DispatchHandle | None) -> Received:
        self.t.begin(call)
        call = call.exact()
        if self._compiled is not None:
            return self._compiled.dispatch(call, plan, handle)
        b, t = self.blocks, self.t
        corrupted = self.faults.count("dispatch.count", call, plan.send_counts_R)
        counts = torch.as_tensor(corrupted, dtype=torch.int64, device="cpu").expand(self.R).tolist()
        t.publish(b.counts, call, {"counts": counts})
        t.barrier("dispatch (count exchange)", call)
        self._send_tokens(call, plan)
        self.faults.at("dispatch.sent", call)
        t.barrier("dispatch (token send)", call)
        counts_R = self._verify_and_count(call, plan)
        t.barrier("dispatch (prefix sums)", call)
        return self._reorder(call, plan, prefix_offsets(counts_R), cached=handle is not None)

    def _send_tokens(self, call: CallId, plan: SendPlan) -> None:
        b, t, me, H = self.blocks, self.t, self.me, plan.x_NH.shape[1]
        K = 0 if plan.topk_idx_NK is None else plan.topk_idx_NK.shape[1]
        tokens = plan.send_tokens()
        for dst in sorted(t.live, key=lambda r: (r - me) % self.R):  # own first, then the next ranks
            tokens_n, n = tokens[dst], tokens[dst].numel()
            self.engine.copy_rows(
                plan.x_NH, tokens_n, rows(t.view(b.stage_x, dst)[me], n, plan.x_NH.dtype, H), None
            )
            t.view(b.stage_tokens, dst)[me, :n].copy_(tokens_n)
            if plan.scales_NS is not None:
                self.engine.copy_rows(plan.scales_NS, tokens_n, t.view(b.stage_scales, dst)[me, :n], None)
            if K:
                self.engine.localize_rows(
                    plan.topk_idx_NK,
                    plan.topk_weights_NK,
                    tokens_n,
                    self._local_of_RE[dst],
                    t.view(b.stage_topk, dst)[me, :n, :K],
                    t.view(b.stage_weights, dst)[me, :n, :K],
                )
            t.publish(b.staged, call, {"dtype": DTYPE_CODES[plan.x_NH.dtype], "topk": K}, to=dst)
            t.check_member("dispatch (token send)")  # after each block it put into a peer

    def _verify_and_count(self, call: CallId, plan: SendPlan) -> torch.Tensor:
        """Rows from each source, after checking every source's flag, format and counts."""
        b, t = self.blocks, self.t
        missing = [s for s in t.live if not t.stamped(b.staged, call, s)]
        if missing:
            t.check_in_step(call, "dispatch (flag verification)")  # a peer in another call: say so
            raise PeerDataError(f"dispatch (flag verification): no tokens from rank(s) {missing}")
        K = 0 if plan.topk_idx_NK is None else plan.topk_idx_NK.shape[1]
        counts = [0] * self.R  # masked ranks send nothing
        for src in t.live:
            got = t.read(b.staged, call, src)
            if CODE_DTYPES.get(got["dtype"]) != plan.x_NH.dtype or got["topk"] != K:
                message = (
                    f"dispatch: rank {src} sent {CODE_DTYPES.get(got['dtype'])} with top-k {got['topk']}, "
                    f"this rank {plan.x_NH.dtype} with top-k {K}"
                )
                raise t.bad_data(call, src, message)
            counts[src] = int(t.read(b.counts, call, src)["counts"][self.me])
        return torch.tensor(counts, dtype=torch.int64, device="cpu")

    def _reorder(self, call: CallId, plan: SendPlan, prefix_R1: torch.Tensor, cached: bool) -> Received:
        b, t, H, dtype = self.blocks, self.t, plan.x_NH.shape[1], plan.x_NH.dtype
        M, prefix = int(prefix_R1[-1]), prefix_R1.tolist()
        K = None if cached else plan.topk_idx_NK.shape[1]
        device, scales_NS = plan.x_NH.device, plan.scales_NS
        recv_x = torch.empty(M, H, dtype=dtype, device=device)
        scales = (
            None
            if scales_NS is None
            else torch.empty(M, scales_NS.shape[1], dtype=scales_NS.dtype, device=device)
        )
        recv_idx = None if cached else torch.empty(M, K, dtype=torch.int64, device=device)
        recv_w = None if cached else torch.empty(M, K, dtype=torch.float32, device=device)
        src_token = torch.empty(M, dtype=torch.int64, device=device)
        for src in range(self.R):
            a, z = prefix[src], prefix[src + 1]
            self.engine.copy_rows(
                rows(t.view(b.stage_x, self.me)[src], z - a, dtype, H), None, recv_x[a:z], None
            )
            src_token[a:z] = t.view(b.stage_tokens, self.me)[src, : z - a]
            if scales is not None:
                scales[a:z] = t.view(b.stage_scales, self.me)[src, : z - a]
            if not cached:
                recv_idx[a:z] = t.view(b.stage_topk, self.me)[src, : z - a, :K]
                recv_w[a:z] = t.view(b.stage_weights, self.me)[src, : z - a, :K]
            self._check_received(call, src, src_token[a:z], None if cached else recv_idx[a:z])
        return Received(recv_x, recv_idx, recv_w, RecvRoute.of(src_token, prefix_R1), scales)

    def _check_received(
        self, call: CallId, src: int, src_token_M: torch.Tensor, recv_idx_MK: torch.Tensor | None
    ) -> None:
        """Token indices and local expert ids `src` staged here, as copied (the copy is what is used),
        must be in range; a bad one blames `src`, whose slot it is."""
        T, L = self.sizing.capacity, self.sizing.placement.num_local_experts
        if src_token_M.numel() and (src_token_M.min() < 0 or src_token_M.max() >= T):
            raise self.t.bad_data(
                call, src, f"dispatch: rank {src} sent source token indices outside [0, {T})"
            )
        if recv_idx_MK is not None and recv_idx_MK.numel():
            if recv_idx_MK.min() < -1 or recv_idx_MK.max() >= L:
                raise self.t.bad_data(
                    call, src, f"dispatch: rank {src} sent local expert ids outside [-1, {L})"
                )

    def combine(self, call: CallId, x_MH, handle: DispatchHandle, topk_weights_MK):
        self.t.begin(call)
        call = call.exact()
        if self._compiled is not None:
            return self._compiled.combine(call, x_MH, handle, topk_weights_MK)
        back = self.blocks.back
        self.t.barrier("combine (start)", call)
        publish_back(self.t, back, call, x_MH, handle, topk_weights_MK)
        self.faults.at("combine.mid", call)
        self.t.barrier("combine (token send)", call)
        self.t.wait_landed(back.back, call, self.t.live, "combine (reduce)")  # all, after the barrier
        combined = reduce_home(self.t, self.engine, back, call, handle, x_MH, topk_weights_MK)
        self.t.check_member("combine")  # what was read above was whole
        return combined

    def abort(self, call: CallId) -> None:
        self.t.abort(call)

    def close(self) -> None:
        self.t.close()

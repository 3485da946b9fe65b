"""Warming the compiled call halves up before the ranks meet.

numba compiles a half on its first call for each combination of argument types
(seconds), or loads it from its disk cache (milliseconds). A rank that compiled
inside its first call would keep every peer waiting, past short deadlines. So
every Buffer on the numba engine first runs the halves it will call once (its
protocol's normal mode, the low-latency mode if it has one: `needed`), for every
payload a call can carry (bf16, fp32, FP8; fresh and cached dispatch), on a
throwaway heap of one virtual rank. Each of these warm-ups compiles at most once per
host (`ubep.engine.compile_once`); once compiled or loaded in a process it costs a
few small calls.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import torch

from ubep import fp8
from ubep.calls import CallCounter
from ubep.engine import Engine
from ubep.layout import ExpertPlacement, expert_counts, token_in_rank
from ubep.protocols.base import SendPlan, Sizing
from ubep.protocols.bsp import BspBlocks, BspExchange
from ubep.protocols.ll import LLBlocks, LLExchange
from ubep.protocols.ll.plans import combine_plan, dispatch_outputs, dispatch_plan
from ubep.protocols.ubep import UbepBlocks, UbepExchange
from ubep.registry import BSP, UBEP
from ubep.results import DispatchHandle
from ubep.transport.virtual import VirtualRank, VirtualWorld, virtual_heap

H, T, K = fp8.BLOCK, 2, 2  # the smallest shape that carries FP8
TOPK_IDX_NK = torch.tensor(
    [[0, 1], [1, -1]], dtype=torch.int64, device="cpu"
)  # two local experts, one slot unused


NORMAL = {UBEP.name: (UbepBlocks, UbepExchange), BSP.name: (BspBlocks, BspExchange)}  # by protocol
LOW_LATENCY = "low_latency"
WARM_UPS = (*NORMAL, LOW_LATENCY)  # every warm-up, by name


def needed(protocol: str, low_latency: bool, workers: int) -> tuple[str, ...]:
    """The warm-ups of a Buffer with these options: its protocol's normal-mode halves (with one
    worker: more keep the protocol step by step in Python, on the engine's kernels) and the
    low-latency halves if it has that mode."""
    return ((protocol,) if workers == 1 else ()) + ((LOW_LATENCY,) if low_latency else ())


def warm_up(engine: Engine, name: str) -> None:
    """Run every compiled half of one warm-up (a protocol's name, or LOW_LATENCY) once on one virtual
    rank, for every payload its calls can carry (see the module doc)."""
    sizing = Sizing(hidden=H, capacity=T, max_topk=K, placement=ExpertPlacement.contiguous(2, 1))
    blocks = LLBlocks if name == LOW_LATENCY else NORMAL[name][0]
    heap = virtual_heap(blocks.of(sizing).all(), VirtualRank(VirtualWorld(1), 0), timeout_s=10.0)
    try:
        calls = CallCounter()
        x_NH = torch.ones(T, H, dtype=torch.float32, device="cpu")
        if name == LOW_LATENCY:
            low_latency = LLExchange(heap, engine, sizing)
            for payload in (x_NH, x_NH.bfloat16()):
                _low_latency_mode(low_latency, calls, sizing, payload)
            _low_latency_mode(low_latency, calls, sizing, x_NH, use_fp8=True)
            return
        exchange = NORMAL[name][1](heap, engine, sizing)
        for payload in (x_NH, x_NH.bfloat16(), fp8.quantize(x_NH)):
            _normal_mode(exchange, calls, sizing, payload)
    finally:
        heap.close()


def _normal_mode(exchange: UbepExchange | BspExchange, calls: CallCounter, sizing: Sizing, payload) -> None:
    x_NH, scales_NS = payload if fp8.is_pair(payload) else (payload, None)
    weights_NK = torch.ones(T, K, dtype=torch.float32, device="cpu")
    in_rank_NR = token_in_rank(TOPK_IDX_NK, sizing.placement)
    counts_R = in_rank_NR.sum(dim=0)
    plan = SendPlan(x_NH, TOPK_IDX_NK, weights_NK, in_rank_NR, counts_R, scales_NS)
    call = calls.next("dispatch")
    got = exchange.dispatch(call, plan, None)
    handle = DispatchHandle(
        num_tokens=T,
        is_token_in_rank_NR=in_rank_NR,
        send_counts_R=counts_R,
        recv=got.route,
        num_recv_tokens_per_expert_list=expert_counts(got.recv_topk_idx_MK, 2, 1),
        seq=call.seq,
    )
    cached = SendPlan(x_NH, None, None, in_rank_NR, counts_R, scales_NS)
    exchange.dispatch(calls.next("dispatch"), cached, handle)
    if scales_NS is None:
        for weights in (got.recv_topk_weights_MK, None):
            exchange.combine(calls.next("combine"), got.recv_x_MH, handle, weights)


def _low_latency_mode(exchange: LLExchange, calls: CallCounter, sizing: Sizing, x_NH, use_fp8=False) -> None:
    plan = dispatch_plan(x_NH, TOPK_IDX_NK, sizing.placement, T, use_fp8)
    call = calls.next("ll_dispatch")
    out = dispatch_outputs(plan, H, 1, TOPK_IDX_NK, 2, call.seq)
    exchange.dispatch_send(call, plan, out)()
    if use_fp8:
        return
    back = combine_plan(
        out.recv_x, torch.ones(T, K, dtype=torch.float32, device="cpu"), out.handle, sizing.placement
    )
    exchange.combine_send(calls.next("ll_combine"), back, torch.empty(T, H, dtype=x_NH.dtype, device="cpu"))()

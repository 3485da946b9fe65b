"""Normal mode's UBEP device halves on R virtual ranks of one GPU, with num_worst_tokens: no host sync,
graph capture, timings.

Each virtual rank has its own arena (the layout of `UbepBlocks`, one device allocation a rank) and its
own capturable `UbepTriton`; one address table reaches all arenas, as the CUDA heap's reaches every GPU.
One stream runs every rank's half in turn (all sends, then all receives), so no wait ever spins. The
send kernels derive the layout from top-k and check its values, as on `Buffer`'s path.
num_worst_tokens = R * T fixes every receive size, so nothing is read on the host.

1. `torch.cuda.set_sync_debug_mode("error")` around one eager dispatch + combine: a host sync raises.
2. dispatch + combine of every rank captured in one CUDA graph, replayed REPLAYS times; after each
   replay the outputs are compared on the device with `ubep.reference` (mismatches counted there, read
   once at the end): bit for bit, every replay a new epoch.
3. per-half latency (median over runs, all R ranks' kernels of that half) and bandwidth (bytes each
   kernel reads and writes once) as a fraction of the memory bandwidth, per token count.

    python scripts/device_normal.py [--smoke] [--peak-tbs 4.8] [--replays 1000]

--smoke runs tiny shapes (4 and 8 tokens) on the CPU under TRITON_INTERPRET=1 (no graph, no events):
a dry run of this script's logic, not a measurement.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from device_ll import VirtualDeviceHeap, graph_replays, half_rows, no_host_sync

from ubep import reference
from ubep.calls import CallCounter
from ubep.engine.triton_engine import TritonEngine
from ubep.faults import NO_FAULTS
from ubep.layout import ExpertPlacement, token_in_rank
from ubep.protocols.base import SendPlan, Sizing
from ubep.protocols.ubep import UbepBlocks
from ubep.protocols.ubep.triton_driver import UbepTriton
from ubep.results import DispatchHandle
from ubep.transport.heap import Layout


class Heap(VirtualDeviceHeap):
    """What `UbepTriton` needs of a heap: `VirtualDeviceHeap`, and no membership to check (nobody leaves)."""

    def check_member(self, phase: str) -> None:
        pass


def _expert(rows: torch.Tensor, rank: int) -> torch.Tensor:
    return (rows.float() * (0.5 + rank) - 1.0).to(torch.bfloat16)


class World:
    """R virtual ranks' inputs, device halves and the reference's outputs for one token count."""

    def __init__(self, R: int, T: int, H: int, K: int, E: int, device: str, check: bool, seed: int = 0):
        """check: compute the reference's outputs (for `mismatches`; the timings need none)."""
        self.R, self.T, self.H, self.worst = R, T, H, R * T
        self.label = f"normal dispatch + combine of {R} ranks (num_worst_tokens {R * T})"
        self.device = torch.device(device)
        sizing = Sizing(hidden=H, capacity=T, max_topk=K, placement=ExpertPlacement.contiguous(E, R))
        p = sizing.placement
        blocks = UbepBlocks.of(sizing)
        layout = Layout(R, blocks.all())
        arenas = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(R)]
        engine = TritonEngine()
        self.halves = []
        for r in range(R):
            local_of_E = torch.where(p.rank_of_expert_E == r, p.local_index_E, -1)
            heap = Heap(r, arenas, layout)
            self.halves.append(UbepTriton(heap, blocks, sizing, NO_FAULTS, local_of_E, engine, True, 10**7))
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(T, H, generator=g) * 3).to(torch.bfloat16) for _ in range(R)]
        idxs = [torch.rand(T, E, generator=g).topk(K, dim=1).indices for _ in range(R)]
        ws = [torch.rand(T, K, generator=g) for _ in range(R)]
        self.plans, self.in_rank = [], []  # the send kernels derive the layout: `Buffer`'s path
        for x, idx, w in zip(xs, idxs, ws, strict=True):
            self.in_rank.append(token_in_rank(idx, p).to(device))  # the reference's layout
            layout = (
                torch.zeros(T, R, dtype=torch.bool, device=device),
                torch.zeros(R, dtype=torch.int64, device=device),
            )
            x, idx, w = (t.to(device) for t in (x, idx, w))
            self.plans.append(SendPlan(x, idx, w, *layout, layout_by_send=True))
        self.M = [sum(int(in_rank[:, r].sum()) for in_rank in self.in_rank) for r in range(R)]
        if check:
            ref = reference.dispatch(xs, idxs, ws, E)
            want = reference.combine([_expert(d.recv_x_MH, r) for r, d in enumerate(ref)], ref, [T] * R)
            self.want_rows = [d.recv_x_MH.to(device) for d in ref]
            self.want_sum = [s.to(device) for s in want]
        self.y = [torch.empty(self.worst, H, dtype=torch.bfloat16, device=device) for _ in range(R)]
        self.rows = sum(self.M)  # rows dispatched, over all ranks
        self.calls = CallCounter()

    # the four halves of every rank, in the order one stream runs them
    def dispatch_send(self):
        call = self.calls.next("dispatch")
        self._seq = call.seq
        self._recv = [
            d.dispatch_send(call, replace(plan, num_worst_tokens=self.worst), None)
            for d, plan in zip(self.halves, self.plans, strict=True)
        ]

    def dispatch_recv(self):
        self.got = [receive() for receive in self._recv]

    def combine_send(self):
        call = self.calls.next("combine")
        self._reduce = []
        for r, (d, plan, got, y) in enumerate(zip(self.halves, self.plans, self.got, self.y, strict=True)):
            y.copy_(_expert(got.recv_x_MH, r))
            handle = DispatchHandle(
                num_tokens=self.T, is_token_in_rank_NR=plan.is_token_in_rank_NR,
                send_counts_R=plan.send_counts_R, recv=got.route, num_recv_tokens_per_expert_list=[],
                seq=self._seq,
            )  # fmt: skip
            self._reduce.append(d.combine_send(call, y, handle, None))

    def combine_recv(self):
        self.out = [reduce()[0] for reduce in self._reduce]

    def call(self):
        self.dispatch_send()
        self.dispatch_recv()
        self.combine_send()
        self.combine_recv()

    def mismatches(self) -> torch.Tensor:
        """Device int64 [1]: outputs that differ from the reference (nothing is read back)."""
        bad = torch.zeros(1, dtype=torch.int64, device=self.y[0].device)
        for r in range(self.R):
            got = self.got[r].recv_x_MH
            bad += (got[: self.M[r]].view(torch.int16) != self.want_rows[r].view(torch.int16)).any().long()
            bad += (got[self.M[r] :] != 0).any().long()  # the padding
            bad += (self.out[r].view(torch.int16) != self.want_sum[r].view(torch.int16)).any().long()
            bad += (self.plans[r].is_token_in_rank_NR != self.in_rank[r]).any().long()  # the kernel's layout
        return bad

    def check(self):
        for d in self.halves:
            d.check()


def timings(world: World, runs: int, peak: float, cuda: bool) -> None:
    R, T, H = world.R, world.T, world.H
    b, rows = H * 2, world.rows
    halves = [
        ("dispatch send", world.dispatch_send, 2 * R * T * b),
        ("dispatch recv", world.dispatch_recv, 2 * rows * b + rows * 40),
        ("combine send", world.combine_send, 2 * rows * b + 2 * R * world.worst * b),  # with the y copy
        ("combine recv", world.combine_recv, rows * b + R * T * b),
    ]
    half_rows(world, halves, runs, peak, cuda)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    cuda = not a.smoke
    device = "cuda" if cuda else "cpu"
    R, H, K, E = (2, 128, 2, 4) if a.smoke else (8, 7168, 8, 256)
    # Memory: each rank's blocks hold T rows of H * 4 bytes (x) and R * T (y), twice (both halves), and
    # its outputs R * T rows of H * 2: about 3 GB a rank at 4,096 tokens, 24 GB for 8.
    tokens = (4, 8) if a.smoke else (128, 4096)
    world = World(R, tokens[0], H, K, E, device, check=True)
    no_host_sync(world, cuda)
    graph_replays(world, 3 if a.smoke else a.replays, cuda)
    print(
        f"per half, {R} virtual ranks on one device (one stream: the ranks' kernels run one after another; "
        f"us/rank = the half's time / R), bf16, H {H}, top-{K} of {E}, num_worst_tokens R * T; "
        "bytes: every read and write once"
    )
    print("| tokens | half | us, all ranks | us/rank | MB | GB/s | of peak |")
    print("|---|---|---|---|---|---|---|")
    for T in tokens:
        if T != world.T:
            del world  # one world's memory at a time
            world = World(R, T, H, K, E, device, check=False)
        timings(world, 2 if a.smoke else a.runs, a.peak_tbs * 1e12, cuda)
    print("device_normal: ok")


if __name__ == "__main__":
    main()

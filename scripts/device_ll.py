"""Low-latency mode's device halves on R virtual ranks of one GPU: graph capture, no host sync, timings,
for both data-as-flag forms of the rows ("after-data": rows, then a released stamp; "in-word": 8-byte
words of payload and epoch, each its own flag, twice the slot bytes).

Each virtual rank has its own arena (the layout of `LLBlocks`, one device allocation a rank) and its
own capturable `LLTriton`; one address table reaches all arenas, as the CUDA heap's reaches every GPU.
One stream runs every rank's half in turn (all sends, then all receives), so no wait ever spins.

1. `torch.cuda.set_sync_debug_mode("error")` around one eager dispatch + combine: a host sync raises.
2. dispatch + combine of every rank captured in one CUDA graph, replayed REPLAYS times; after each
   replay the outputs are compared on the device with `ubep.reference` (mismatches counted there, read
   once at the end): bit for bit, every replay a new epoch.
3. per-half latency (median over runs, all R ranks' kernels of that half) and bandwidth (bytes each
   kernel reads and writes once, rows counted at their payload size) as a fraction of the memory
   bandwidth, per token count and flag.
Steps 1 and 2 run for each flag. A whole `Buffer` call is not captured here: a Buffer needs a process
group with one rank per GPU; tests/device/test_ll_device.py runs one with every host read made to fail.

    python scripts/device_ll.py [--smoke] [--peak-tbs 4.8] [--replays 1000]

--smoke runs tiny shapes on the CPU under TRITON_INTERPRET=1 (no graph, no events): a dry run of this
script's logic, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ubep import reference
from ubep.calls import CallCounter
from ubep.engine.triton_engine import TritonEngine
from ubep.errors import PeerDataError
from ubep.layout import ExpertPlacement
from ubep.protocols.base import DTYPE_CODES, Sizing
from ubep.protocols.ll import LLBlocks
from ubep.protocols.ll.plans import FLAGS, IN_WORD, dispatch_outputs
from ubep.protocols.ll.triton_driver import LLTriton
from ubep.transport.heap import Layout


class VirtualDeviceHeap:
    """What `LLTriton` needs of a heap, for rank `rank` of R arenas on one device."""

    def __init__(self, rank: int, arenas: list[torch.Tensor], layout: Layout):
        self.rank, self.num_ranks, self.live = rank, len(arenas), tuple(range(len(arenas)))
        self.device, self._arenas, self._layout = arenas[0].device, arenas, layout

    def address_table(self, blocks):
        table = torch.empty(self.num_ranks, len(blocks), 2, dtype=torch.int64)
        for r, arena in enumerate(self._arenas):
            for b, block in enumerate(blocks):
                for half in (0, 1):
                    offset = self._layout.offsets[(block.name, half * block.double)][0]
                    table[r, b, half] = arena.data_ptr() + offset
        return table.numpy(), torch.zeros(self.num_ranks, dtype=torch.int64).numpy()

    def bad_data(self, call, culprit, message):
        return PeerDataError(message)


class World:
    """R virtual ranks' inputs, device halves and the reference's outputs for one token count."""

    def __init__(self, R: int, T: int, H: int, K: int, E: int, device: str, flag: str, seed: int = 0):
        self.R, self.T, self.H, self.E, self.flag = R, T, H, E, flag
        self.label = f"dispatch + combine of {R} ranks ({flag})"
        self.device = torch.device(device)
        sizing = Sizing(hidden=H, capacity=T, max_topk=K, placement=ExpertPlacement.contiguous(E, R))
        blocks = LLBlocks.of(sizing, in_word=flag == IN_WORD)
        layout = Layout(R, blocks.all())
        arenas = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(R)]
        engine = TritonEngine()
        self.halves = [
            LLTriton(
                VirtualDeviceHeap(r, arenas, layout), blocks, sizing, _no_release, engine, True, 10**7, flag
            )
            for r in range(R)
        ]
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(T, H, generator=g) * 3).to(torch.bfloat16) for _ in range(R)]
        idxs = [torch.rand(T, E, generator=g).topk(K, dim=1).indices for _ in range(R)]
        ws = [torch.rand(T, K, generator=g) for _ in range(R)]
        ref = reference.low_latency_dispatch(xs, idxs, E, T)
        ys = [(r.recv_x_LMX.float() * (0.5 + i) - 1.0).to(torch.bfloat16) for i, r in enumerate(ref)]
        want = reference.low_latency_combine(ys, ref, idxs, ws)
        self.code = DTYPE_CODES[torch.bfloat16]
        self.x = [x.to(device) for x in xs]
        self.w = [w.to(device) for w in ws]
        plan = type("Plan", (), {"max_tokens": T, "code": self.code})
        self.out = [dispatch_outputs(plan, H, R, i.to(device), E) for i in idxs]
        self.y = [torch.empty_like(y, device=device) for y in ys]
        self.combined = [torch.empty(T, H, dtype=torch.bfloat16, device=device) for _ in range(R)]
        # the reference on the device: valid rows (flat indices into recv_x), counts, sums
        self.valid = [_valid_rows(r.recv_count_L, T * R).to(device) for r in ref]
        self.want_rows = [
            r.recv_x_LMX.reshape(-1, H)[v.cpu()].to(device) for r, v in zip(ref, self.valid, strict=True)
        ]
        self.want_count = [r.recv_count_L.to(device) for r in ref]
        self.want_sum = [s.to(device) for s in want]
        self.pairs = sum(int(r.recv_count_L.sum()) for r in ref)  # rows dispatched, over all ranks
        self.calls = CallCounter()

    # the four halves of every rank, in the order one stream runs them
    def dispatch_send(self):
        call = self.calls.next("ll_dispatch")
        self._recv = [
            d.dispatch_rows(call, x.view(torch.uint8), self.code, self.T, o)
            for d, x, o in zip(self.halves, self.x, self.out, strict=True)
        ]

    def dispatch_recv(self):
        for receive in self._recv:
            receive()

    def combine_send(self):
        call = self.calls.next("ll_combine")
        for i, (o, y) in enumerate(zip(self.out, self.y, strict=True)):
            y.copy_((o.recv_x.float() * (0.5 + i) - 1.0).to(torch.bfloat16))
        self._reduce = [
            d.combine_rows(call, y, w, o.handle, c)
            for d, y, w, o, c in zip(self.halves, self.y, self.w, self.out, self.combined, strict=True)
        ]

    def combine_recv(self):
        for reduce in self._reduce:
            reduce()

    def call(self):
        self.dispatch_send()
        self.dispatch_recv()
        self.combine_send()
        self.combine_recv()

    def mismatches(self) -> torch.Tensor:
        """Device int64 [1]: outputs that differ from the reference (nothing is read back)."""
        bad = torch.zeros(1, dtype=torch.int64, device=self.x[0].device)
        for r in range(self.R):
            got = self.out[r].recv_x.reshape(-1, self.H).index_select(0, self.valid[r])
            bad += (got.view(torch.int16) != self.want_rows[r].view(torch.int16)).any().long()
            bad += (self.out[r].handle.recv_count_L != self.want_count[r]).any().long()
            bad += (self.combined[r].view(torch.int16) != self.want_sum[r].view(torch.int16)).any().long()
        return bad

    def check(self):
        for d in self.halves:
            d.check()


def _no_release(call, kind):
    raise AssertionError("a half failed: see check()")


def _valid_rows(count_L: torch.Tensor, M: int) -> torch.Tensor:
    return torch.cat([j * M + torch.arange(int(c)) for j, c in enumerate(count_L)])


def no_host_sync(world, cuda: bool) -> None:
    """One eager call of `world` (any world with call, check, mismatches, label) under
    set_sync_debug_mode('error'), then checked against the reference."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        world.call()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    world.check()
    assert int(world.mismatches()) == 0, "eager call differs from the reference"
    print(f"no host sync: one {world.label} under set_sync_debug_mode('error'): ok")


def graph_replays(world, replays: int, cuda: bool) -> None:
    """`world`'s call captured in one CUDA graph (on CPU: called), replayed `replays` times, each
    replay checked against the reference on the device (mismatches read once at the end)."""
    bad = torch.zeros(1, dtype=torch.int64, device=world.device)
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            world.call()  # warm: every kernel compiled and loaded before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            world.call()
        replay = graph.replay
    else:
        replay = world.call
    t0 = time.perf_counter()
    for _ in range(replays):
        replay()
        bad += world.mismatches()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    world.check()
    assert int(bad) == 0, f"{int(bad)} mismatches over {replays} replays"
    print(
        f"graph: {world.label}, {replays} replays, bit for bit against the reference every replay "
        f"({seconds / replays * 1e6:.1f} us a replay with the checks)"
    )


def half_seconds(halves: list, runs: int, cuda: bool) -> dict[str, float]:
    """Median seconds of each (name, fn, bytes) half over `runs` rounds (CUDA events on a GPU)."""
    results = {name: [] for name, _, _ in halves}
    for _ in range(runs):
        for name, fn, _ in halves:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                results[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                results[name].append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, times in results.items()}


def half_rows(world, halves: list, runs: int, peak: float, cuda: bool, *labels: str) -> None:
    """Time each (name, fn, bytes) half (`half_seconds`), check the calls, and print a table row per
    half: tokens, `labels`, the half, microseconds for all ranks and per rank, MB, GB/s, share of `peak`
    (bytes per second)."""
    seconds = half_seconds(halves, runs, cuda)
    world.check()
    for name, _, nbytes in halves:
        s = seconds[name]
        cells = (f"{world.T:>5}", *labels, f"{name:<13}", f"{s * 1e6:10.1f}", f"{s * 1e6 / world.R:9.1f}",
                 f"{nbytes / 1e6:9.1f}", f"{nbytes / s / 1e9:8.1f}", f"{nbytes / s / peak:6.1%}")  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def timings(world: World, runs: int, peak: float, cuda: bool) -> None:
    R, T, H = world.R, world.T, world.H
    b = H * 2
    halves = [
        ("dispatch send", world.dispatch_send, 2 * world.pairs * b),
        ("dispatch recv", world.dispatch_recv, 2 * world.pairs * b + world.pairs * 24),
        ("combine send", world.combine_send, 2 * world.pairs * b),
        ("combine recv", world.combine_recv, world.pairs * b + R * T * H * 2),
    ]
    half_rows(world, halves, runs, peak, cuda, f"{world.flag:<10}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--peak-tbs", type=float, default=4.8)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    cuda = not a.smoke
    device = "cuda" if cuda else "cpu"
    R, H, K, E = (2, 128, 2, 4) if a.smoke else (8, 7168, 8, 256)
    # Memory: each rank's slots hold R * L * T rows of H * 4 bytes, twice (both halves): 2 GB a rank at
    # 128 tokens, 7.5 GB at 512, 60 GB at 4,096 (8 ranks: 480 GB, more than one GPU holds); in word
    # form twice that, so its table stops at 256 tokens (60 GB for 8 ranks).
    tokens = {f: (4,) for f in FLAGS} if a.smoke else {FLAGS[0]: (128, 512), IN_WORD: (128, 256)}
    for flag in FLAGS:
        world = World(R, tokens[flag][0], H, K, E, device, flag)
        no_host_sync(world, cuda)
        graph_replays(world, 3 if a.smoke else a.replays, cuda)
        del world  # one world's memory at a time
    print(
        f"per half, {R} virtual ranks on one device (one stream: the ranks' kernels run one after another; "
        f"us/rank = the half's time / R), bf16, H {H}, top-{K} of {E}; bytes: every read and write once, "
        "at the payload's size (in-word moves twice that through the slots)"
    )
    print("| tokens | flag | half | us, all ranks | us/rank | MB | GB/s | of peak |")
    print("|---|---|---|---|---|---|---|---|")
    for flag in FLAGS:
        for T in tokens[flag]:
            world = World(R, T, H, K, E, device, flag)
            timings(world, 2 if a.smoke else a.runs, a.peak_tbs * 1e12, cuda)
            del world
    print("device_ll: ok")


if __name__ == "__main__":
    main()

"""The Buffer reaches the CUDA heap: `transport="auto"` picks it for an NCCL group on one host, inputs
must live on the Buffer's device (a tensor elsewhere is refused by name), and the factory builds
low-latency mode over the heap's device address table with the Triton halves.

No GPU here: the choice runs with CUDA and NCCL mocked, the device checks on the meta device, and the
factory branch over a stand-in for torch symmetric memory (CPU arenas) with the kernels under Triton's
interpreter, in a subprocess: one rank dispatches to and combines from itself through the CUDA heap's
address table, checked against `ubep.reference`, with rows after data and (capturable) in word form.
The real thing runs in scripts/device_check.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from ubep import group, validate
from ubep.group import GroupInfo, choose_transport

ONE_HOST = GroupInfo(None, 0, 2, (0, 0))
TWO_HOSTS = GroupInfo(None, 0, 2, (0, 1))


@pytest.fixture
def nccl_on_gpus(monkeypatch):
    """CUDA available, torch.distributed up with the given backend (mocked; nothing is initialized)."""

    def with_backend(backend: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)

    return with_backend


def test_auto_picks_the_cuda_heap_for_an_nccl_group_on_one_host(nccl_on_gpus):
    nccl_on_gpus("nccl")
    transport, why = choose_transport("auto", ONE_HOST)
    assert transport == "cuda" and "NCCL" in why and "symmetric memory" in why
    assert choose_transport("cuda", ONE_HOST)[0] == "cuda"
    assert choose_transport("shm", ONE_HOST)[0] == "shm"  # asked for: kept


def test_auto_keeps_shared_memory_for_cpu_groups(nccl_on_gpus):
    nccl_on_gpus("gloo")
    assert choose_transport("auto", ONE_HOST)[0] == "shm"
    with pytest.raises(ValueError, match=r"transport='cuda' is not available: .*'gloo'"):
        choose_transport("cuda", ONE_HOST)


def test_the_cuda_heap_stays_within_one_host(nccl_on_gpus, monkeypatch):
    nccl_on_gpus("nccl")
    monkeypatch.setattr(group, "hier_supported", lambda info: (False, "test"))
    assert choose_transport("auto", TWO_HOSTS)[0] == "dist"
    with pytest.raises(ValueError, match="spans 2 nodes"):
        choose_transport("cuda", TWO_HOSTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(ValueError, match="CUDA is not available"):
        choose_transport("cuda", ONE_HOST)


def test_inputs_must_live_on_the_buffers_device():
    meta = torch.device("meta")
    x = torch.empty(3, 128, dtype=torch.bfloat16, device=meta)
    assert validate.payload("x", x, 128, 4, device=meta) is not None
    idx = torch.zeros(3, 2, dtype=torch.int64)  # on the CPU: a mixed call
    with pytest.raises(ValueError, match=r"topk_idx is on cpu; this Buffer's tensors live on meta"):
        validate.topk_idx(idx, 3, 8, 4, device=meta)
    with pytest.raises(ValueError, match=r"x is on meta; this Buffer's tensors live on cpu"):
        validate.low_latency_x(x, 128, 4, 4, use_fp8=False)


def test_a_cpu_buffer_names_the_argument_on_another_device():
    import ubep

    with ubep.Buffer(hidden=128, num_experts=4, max_tokens_per_rank=4, low_latency=True) as buf:
        assert buf.device == torch.device("cpu")
        x = torch.zeros(2, 128, dtype=torch.bfloat16)
        idx = torch.zeros(2, 1, dtype=torch.int64, device="meta")
        with pytest.raises(ValueError, match="topk_idx is on meta"):
            buf.low_latency_dispatch(x, idx, 4, 4)
        with pytest.raises(ValueError, match="x is on meta"):
            buf.low_latency_dispatch(x.to("meta"), torch.zeros(2, 1, dtype=torch.int64), 4, 4)


def test_low_latency_blocks_are_the_device_headers():
    from ubep.factory import DEVICE_HEADERS
    from ubep.layout import ExpertPlacement
    from ubep.protocols.base import Sizing
    from ubep.protocols.ll import LLBlocks
    from ubep.transport.base import Header

    sizing = Sizing(hidden=128, capacity=4, max_topk=2, placement=ExpertPlacement.contiguous(4, 2))
    blocks = LLBlocks.of(sizing).all()
    assert tuple(b.name for b in blocks if isinstance(b, Header)) == DEVICE_HEADERS


# --- the factory's CUDA branch over a stand-in for symmetric memory, kernels interpreted -------------

SCRIPT = textwrap.dedent(
    """
    import sys, types
    import torch
    import torch.distributed as dist

    arenas = []
    class Handle:
        def get_buffer(self, rank, sizes, dtype, storage_offset=0):
            assert rank == 0 and arenas[0].numel() == sizes[0]
            return arenas[0].view(dtype)
    fake = types.ModuleType("torch.distributed._symmetric_memory")
    fake.empty = lambda n, dtype, device: arenas.append(torch.full((n,), 7, dtype=dtype)) or arenas[-1]
    fake.enable_symm_mem_for_group = lambda name: None
    fake.rendezvous = lambda tensor, group: Handle()
    sys.modules["torch.distributed._symmetric_memory"] = fake
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(synchronize=lambda: None)

    from ubep import reference
    from ubep.calls import CallCounter
    from ubep.engine.triton_engine import TritonEngine
    from ubep.factory import Options, build
    from ubep.faults import FaultPoints
    from ubep.group import GroupInfo
    from ubep.layout import ExpertPlacement
    from ubep.protocols.base import Sizing
    from ubep.protocols.ll.plans import combine_plan, dispatch_outputs, dispatch_plan, wire_rows
    from ubep.transport.cuda import CudaHeap

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    H, E, T, K = 128, 4, 6, 2
    sizing = Sizing(hidden=H, capacity=T, max_topk=K, placement=ExpertPlacement.contiguous(E, 1))
    options = Options(transport="cuda", protocol="ubep", low_latency=True, timeout_s=20)
    info = GroupInfo(dist.group.WORLD, 0, 1, (0,))
    normal, ll = build(info, sizing, options, TritonEngine(), FaultPoints())
    try:
        assert isinstance(ll.t, CudaHeap) and type(ll._compiled).__name__ == "LLTriton", ll._compiled
        table, _ = ll.t.address_table(ll.blocks.all())
        arena = arenas[0].data_ptr()
        assert (table >= arena).all() and (table < arena + arenas[0].numel()).all()
        assert "Triton kernel" in ll.halves
        g = torch.Generator().manual_seed(1)
        calls = CallCounter()
        for step in range(3):  # both halves of the double-buffered slots, and one reuse
            x = (torch.randn(5, H, generator=g) * 3).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
            idx[0, 1] = -1
            w = torch.rand(5, K, generator=g)
            plan = dispatch_plan(x, idx, sizing.placement, T, False)
            out = dispatch_outputs(plan, H, 1, idx, E)
            ll.dispatch_send(calls.next("ll_dispatch"), plan, out)()
            want = reference.low_latency_dispatch([x], [idx], E, T)[0]
            assert torch.equal(out.handle.recv_count_L, want.recv_count_L)
            for j in range(E):
                c = int(want.recv_count_L[j])
                assert torch.equal(out.recv_x[j, :c], want.recv_x_LMX[j, :c])
            y = (out.recv_x.float() * 0.5 - 1).to(torch.bfloat16)
            combined = torch.empty(5, H, dtype=torch.bfloat16)
            back = combine_plan(y, w, out.handle, sizing.placement)
            ll.combine_send(calls.next("ll_combine"), back, combined)()
            ref_y = [(want.recv_x_LMX.float() * 0.5 - 1).to(torch.bfloat16)]
            assert torch.equal(combined, reference.low_latency_combine(ref_y, [want], [idx], [w])[0])
            if step == 1:  # a call rejected before its send (bad input): released on the device
                rejected = calls.next("ll_dispatch")
                ll.abort(rejected, "dispatch")
                assert int(ll.t.view(ll.blocks.rejected, 0)[0]) == rejected.epoch
    finally:
        ll.t.close()
    # rows in word form, capturable: the factory sizes the slots for words; one call from wire rows
    options = Options(transport="cuda", protocol="ubep", low_latency=True, timeout_s=20, ll_flag="in-word",
                      capturable=True)  # fmt: skip
    normal, ll = build(info, sizing, options, TritonEngine(), FaultPoints())
    try:
        assert ll._compiled.in_word and ll._compiled.capturable and "in-word" in ll.halves
        assert ll.blocks.slots.shape[-1] == 2 * sizing.row_bytes
        calls = CallCounter()
        x = (torch.randn(5, H, generator=g) * 3).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
        w = torch.rand(5, K, generator=g)
        wire = wire_rows(x, T, False)
        out = dispatch_outputs(wire, H, 1, idx, E)
        ll.dispatch_send(calls.next("ll_dispatch"), wire, out)()
        y = (out.recv_x.float() * 0.5 - 1).to(torch.bfloat16)
        combined = torch.empty(5, H, dtype=torch.bfloat16)
        ll.combine_rows(calls.next("ll_combine"), y, w, out.handle, combined, idx)()
        ll.check()
        want = reference.low_latency_dispatch([x], [idx], E, T)[0]
        assert torch.equal(out.handle.recv_count_L, want.recv_count_L)
        ref_y = [(want.recv_x_LMX.float() * 0.5 - 1).to(torch.bfloat16)]
        assert torch.equal(combined, reference.low_latency_combine(ref_y, [want], [idx], [w])[0])
        print("CUDA BRANCH OK")
    finally:
        ll.t.close()
        dist.destroy_process_group()
    """
)


@pytest.mark.timeout(200)
def test_the_factory_builds_low_latency_mode_on_the_cuda_heap():
    pytest.importorskip("triton")
    import ubep

    path = os.pathsep.join(
        [os.path.dirname(os.path.dirname(ubep.__file__)), os.environ.get("PYTHONPATH", "")]
    )
    env = dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert "CUDA BRANCH OK" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]

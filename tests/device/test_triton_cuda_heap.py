"""The CUDA heap (`ubep.transport.cuda`): it imports on the CPU build without touching symmetric memory,
refuses clearly without a GPU, and splits a heap between host segments and device regions correctly.

The split is checked here with a stand-in for `torch.distributed._symmetric_memory` (the documented calls
`empty`, `enable_symm_mem_for_group`, `rendezvous`, `get_buffer`, over CPU tensors); the `cuda` case runs
the same script on a GPU with the real module (scripts/device_check.sh). One rank, in a subprocess, since
it initializes a process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import sys, types
    import torch
    import torch.distributed as dist

    real = sys.argv[1] == "real"
    if not real:  # a stand-in with symmetric memory's documented calls, over CPU tensors
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
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(synchronize=lambda: None)
    else:
        torch.cuda.set_device(0)
    from ubep.calls import CallId
    from ubep.transport.base import Field, Header, Region
    from ubep.transport.cuda import cuda_heap

    dist.init_process_group("nccl" if real else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = Region("rows", (4, 256), torch.bfloat16, double=True)
    counts = Region("counts", (2, 2), torch.int64)
    head = Header("head", (Field("n", hi=4),))
    heap = cuda_heap([rows, counts, head], dist.group.WORLD, 0, 1, 10.0, torch.device("cuda"), {"counts"})
    try:
        call = CallId(1, 1)
        x = heap.view(rows, 0, call)
        other_half = heap.view(rows, 0, CallId(2, 2))
        assert x.dtype == torch.bfloat16 and tuple(x.shape) == (4, 256) and x.is_cuda == real
        assert x.data_ptr() != other_half.data_ptr()
        assert (x.view(torch.int16) == 0).all(), "device regions start zeroed"
        x.copy_(torch.arange(1024, dtype=torch.bfloat16).view(4, 256).to(x.device))
        again = heap.view(rows, 0, call)
        assert torch.equal(again.cpu(), torch.arange(1024, dtype=torch.bfloat16).view(4, 256))
        assert heap.pointer_table(rows, call).tolist() == [x.data_ptr()]
        assert not heap.view(counts, 0).is_cuda and heap.words(counts, 0).shape == (2, 2)
        try:
            heap.words(rows, 0)
            raise AssertionError("words() of a device region must refuse")
        except TypeError as e:
            assert "host_regions" in str(e)
        heap.publish(head, call, {"n": 3})
        assert list(heap.landed(head, call, [0], "test")) == [0]
        assert heap.stamped(head, call, 0) and heap.read(head, call, 0)["n"] == 3
        assert not heap.stamped(head, CallId(2, 2), 0)
        print("HEAP OK")
    finally:
        heap.close()
        dist.destroy_process_group()
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    import ubep

    path = os.pathsep.join(
        [os.path.dirname(os.path.dirname(ubep.__file__)), os.environ.get("PYTHONPATH", "")]
    )
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120
    )


def test_imports_without_symmetric_memory():
    code = "import sys, ubep.transport.cuda; print('torch.distributed._symmetric_memory' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_refuses_clearly_without_a_gpu():
    from ubep.transport.cuda import cuda_heap

    with pytest.raises(ValueError, match="needs a CUDA device"):
        cuda_heap([], None, 0, 1, 1.0, torch.device("cpu"))


def test_host_and_device_split_with_a_stand_in():
    run = _run("fake")
    assert "HEAP OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_with_torch_symmetric_memory():
    run = _run("real")
    assert "HEAP OK" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]

"""Every result a call returns belongs to the caller: the next calls on the Buffer leave it as it was.

DeepEP's low-latency receive buffers belong to its Buffer and are overwritten by the next call;
ubep's results are fresh tensors in both modes (docs/low_latency.md, "Who owns the results"). A
model that keeps recv_x for its backward pass, or overlaps two micro-batches, depends on it, so
an optimisation that hands out persistent buffers must fail here before it ships.
"""

from __future__ import annotations

import pytest
import torch

import ubep
from ubep.recycle import Recycler
from ubep.transport.virtual import VirtualWorld

T, H, E, K = 6, 32, 8, 3


def _inputs(rank: int, call: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_idx, topk_weights of one rank's call: new values and new routing every call."""
    g = torch.Generator().manual_seed(100 * call + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g)


def _tensors(result) -> list[torch.Tensor]:
    """Every tensor inside a result, handles' fields included."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for part in result for t in _tensors(part)]
    fields = getattr(result, "__dataclass_fields__", None)
    return [] if fields is None else [t for name in fields for t in _tensors(getattr(result, name))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes: uninitialised rows (low-latency recv_x past recv_count) may hold NaN, unequal to
    itself, and what is checked is that no byte changed."""
    return t.reshape(-1).view(torch.uint8)


def _calls(rank, engine: str) -> list[tuple[str, int, bool]]:
    """(call, tensors, whether all are unchanged) after three more calls of every kind."""
    kept = {}
    with ubep.Buffer(
        rank, hidden=H, num_experts=E, max_tokens_per_rank=T, engine=engine, low_latency=True
    ) as buf:
        for call in range(4):
            x, idx, w = _inputs(rank.rank, call)
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            again = buf.dispatch(x * 2, handle=got.handle)
            combined = buf.combine(got.recv_x * 3, got.handle, got.recv_topk_weights)
            ll = buf.low_latency_dispatch(x, idx, T, E)
            recv_x, _, handle = ll[:3]
            ll_combined = buf.low_latency_combine(recv_x, idx, w, handle)
            if call == 0:
                for name, result in [
                    ("dispatch", got[:5]), ("cached dispatch", again[0]), ("combine", combined[:2]),
                    ("low_latency_dispatch", ll[:3]), ("low_latency_combine", ll_combined[0]),
                ]:  # fmt: skip
                    tensors = _tensors(result)
                    kept[name] = (tensors, [t.clone() for t in tensors])
    return [
        (name, len(now), all(torch.equal(_bits(a), _bits(b)) for a, b in zip(now, then, strict=True)))
        for name, (now, then) in kept.items()
    ]


@pytest.mark.parametrize("engine", ["numba", "torch"])
def test_results_outlive_the_next_calls(engine):
    if engine == "numba":
        pytest.importorskip("numba")
    for rank, calls in enumerate(VirtualWorld(2, timeout_s=120).run(lambda r: _calls(r, engine))):
        for name, count, unchanged in calls:
            assert count > 0, f"rank {rank}: {name} returned no tensor"
            assert unchanged, f"rank {rank}: a later call changed a tensor {name} returned"


def test_recycled_memory_is_never_memory_a_result_still_holds():
    """`ubep.recycle.Recycler` (the memory of the low-latency recv_x) hands a block out again only once
    no tensor, view, storage or numpy array refers to it, and then does hand it out again."""
    recycler, shape = Recycler(keep=1), (2, 3, 4)
    holders = {
        "the tensor": lambda t: t,
        "a view": lambda t: t[1:].view(torch.uint8),
        "its storage": lambda t: t.untyped_storage(),
        "a numpy array": lambda t: t.view(torch.int16).numpy(),
    }
    for what, hold in holders.items():
        first = recycler.empty(shape, torch.bfloat16)
        at, held = first.data_ptr(), hold(first)
        del first
        busy = recycler.empty(shape, torch.bfloat16)
        assert busy.data_ptr() != at, f"a block was handed out while {what} held it"
        del busy, held
        again = recycler.empty(shape, torch.bfloat16)
        assert again.data_ptr() == at, f"a block was not handed out again once {what} was dropped"
        del again
    live = [recycler.empty(shape, torch.bfloat16) for _ in range(3)]
    assert len({t.data_ptr() for t in live}) == 3 and recycler.kept_bytes() == 2 * 3 * 4 * 2  # keep=1


def test_a_dropped_low_latency_recv_x_is_reused():
    """The low-latency dispatch takes recv_x from the Buffer's recycler: once the caller dropped an
    earlier recv_x, a later dispatch writes into the same memory (no page faults), and one still
    held keeps its bytes (test_results_outlive_the_next_calls)."""

    def body(rank) -> bool:
        x, idx, _ = _inputs(rank.rank, 0)
        with ubep.Buffer(rank, hidden=H, num_experts=E, max_tokens_per_rank=T, low_latency=True) as buf:
            at = buf.low_latency_dispatch(x, idx, T, E).recv_x.data_ptr()  # dropped at once
            return buf.low_latency_dispatch(x, idx, T, E).recv_x.data_ptr() == at

    assert all(VirtualWorld(2, timeout_s=120).run(body))

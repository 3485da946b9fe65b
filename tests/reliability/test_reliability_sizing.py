"""Sizing checked before construction: the cgroup's headroom read from v1 and v2
trees (built in a temporary directory, no privileges needed), the room check's
verdict and message, `size_hint` against the layouts, and segment names that
carry what the sweep needs to prove a creator dead."""

from __future__ import annotations

import os

import pytest
import torch

from ubep.errors import SharedMemorySizeError
from ubep.sizing import size_hint
from ubep.transport.segments import (
    Creator,
    Introduction,
    cgroup_free_bytes,
    check_room,
    memory_free_bytes,
    segment_creator,
    segment_name,
)

GiB = 2**30


def tree(tmp_path, files: dict[str, str], cgroup_lines: str):
    for path, text in files.items():
        full = tmp_path / "fs" / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)
    proc = tmp_path / "cgroup"
    proc.write_text(cgroup_lines)
    return str(proc), str(tmp_path / "fs")


def test_cgroup_v2_headroom_is_the_least_over_the_ancestors_less_the_working_set(tmp_path):
    proc, root = tree(
        tmp_path,
        {
            "cgroup.controllers": "memory",
            "memory.max": "max",
            "memory.current": "0",
            "job/memory.max": str(8 * GiB),
            "job/memory.current": str(3 * GiB),
            "job/memory.stat": f"anon 123\ninactive_file {2 * GiB}\nactive_file 5\n",  # reclaimable
            "job/rank/memory.max": "max",
            "job/rank/memory.current": str(1 * GiB),
        },
        "0::/job/rank\n",
    )
    assert cgroup_free_bytes(proc, root) == 7 * GiB


def test_cgroup_v1_headroom_and_no_limit(tmp_path):
    proc, root = tree(
        tmp_path,
        {
            "memory/docker/c1/memory.limit_in_bytes": str(2 * GiB),
            "memory/docker/c1/memory.usage_in_bytes": str(GiB),
            "memory/docker/c1/memory.stat": f"cache 7\ninactive_file 1\ntotal_inactive_file {GiB // 2}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "memory/memory.usage_in_bytes": "1",
        },
        "4:memory:/docker/c1\n1:cpu:/\n",
    )
    assert cgroup_free_bytes(proc, root) == GiB + GiB // 2
    proc, root = tree(tmp_path, {}, "4:memory:/\n")
    assert cgroup_free_bytes(proc, root) is None


def intro(shm_free: int, cgroup_free: int | None, memory_free: int | None = None) -> Introduction:
    return Introduction(Creator.this_process(), "t", shm_free, cgroup_free, memory_free)


def test_room_check_names_the_bytes_the_limit_and_the_arguments():
    check_room(GiB, [intro(4 * GiB, None)] * 4)  # fits exactly
    with pytest.raises(SharedMemorySizeError) as caught:
        check_room(GiB, [intro(64 * GiB, None)] * 7 + [intro(3 * GiB, None)])  # the least room decides
    assert (caught.value.needed, caught.value.free) == (8 * GiB, 3 * GiB)
    with pytest.raises(SharedMemorySizeError) as caught:
        check_room(GiB, [intro(64 * GiB, 3 * GiB)] * 4)
    error = caught.value
    assert (error.needed, error.free) == (4 * GiB, 3 * GiB)
    message = str(error)
    assert f"need {4 * GiB} bytes" in message and "4 ranks x 1073741824 bytes" in message
    assert "the memory cgroup's limit leaves 3221225472 bytes" in message
    assert "max_tokens_per_rank" in message and "max_topk" in message and "low_latency=True" in message
    assert isinstance(error, ValueError)


def test_room_check_counts_the_hosts_available_memory_where_dev_shm_is_larger():
    """/dev/shm as large as RAM (here 24 GiB on a 24 GiB host) let 8 x 2.25 GiB of low-latency
    segments through while the host had less memory to give: the bench then ran out of memory."""
    with pytest.raises(SharedMemorySizeError) as caught:
        check_room(9 * GiB // 4, [intro(24 * GiB, None, 16 * GiB)] * 8)
    assert (caught.value.needed, caught.value.free) == (18 * GiB, 16 * GiB)
    assert "the host's available memory (MemAvailable + SwapFree) is 17179869184 bytes" in str(caught.value)
    check_room(GiB, [intro(24 * GiB, None, 16 * GiB)] * 8)  # 8 GiB fits
    check_room(GiB, [intro(24 * GiB, None, None)] * 8)  # /proc/meminfo unreadable: /dev/shm decides


def test_available_memory_is_memavailable_plus_free_swap(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684148 kB\nMemAvailable:   20000000 kB\nSwapFree:        1000 kB\n")
    assert memory_free_bytes(str(meminfo)) == (20000000 + 1000) * 1024
    meminfo.write_text("MemTotal:       24684148 kB\n")  # a kernel too old to say
    assert memory_free_bytes(str(meminfo)) is None
    assert memory_free_bytes(str(tmp_path / "none")) is None


def test_size_hint_follows_the_arguments_that_the_error_names():
    base = dict(
        hidden=1024, num_experts=16, max_tokens_per_rank=64, num_ranks=8, max_topk=8, low_latency=True
    )
    full = size_hint(**base)
    assert full.host_bytes == 8 * full.segment_bytes
    for smaller in (
        dict(hidden=512),
        dict(max_tokens_per_rank=32),
        dict(max_topk=4),
        dict(low_latency=False),
    ):
        assert size_hint(**base | smaller).segment_bytes < full.segment_bytes, smaller
    assert size_hint(**base, protocol="bsp").segment_bytes != full.segment_bytes
    assert size_hint(**base, num_nodes=2).ranks_per_host == 4
    with pytest.raises(ValueError, match="num_ranks"):
        size_hint(**base | dict(num_ranks=6), num_nodes=4)


def test_names_carry_pid_namespace_and_start_time():
    me = Creator.this_process()
    assert me.start > 0 and me.pid_ns > 0
    assert segment_creator(segment_name(os.getpid())) == me
    assert not me.is_gone()
    assert Creator(me.pid, me.pid_ns, me.start + 1).is_gone(), "a reused pid is another process"
    assert not Creator(me.pid, me.pid_ns + 1, me.start + 1).is_gone(), "another namespace: never judged"
    assert segment_creator("ubep-12-feedface") is None and segment_creator("ubep-1-2-3-") is None


# -- a Buffer reserves only what its calls can touch (issue 42) -----------------------------------------

PAGE = 4096


def _ll_blocks_by_hand(R: int, H: int, T: int, K: int, L: int) -> tuple[int, int]:
    """(mapped, touchable) bytes of low-latency mode's blocks, from the shapes docs/low_latency.md gives
    them, written out here rather than taken from the code: both halves of the slots [R, L, T, 4H]
    and slot_info [R, L, T] int64, of which one call fills per source at most T * min(K, L) rows in
    at most min(L, T * min(K, L)) runs (each run's pages: its bytes, and up to two pages more); the
    rest whole: the inbox headers (per source: stamp, dtype, T, width, L counts; per expert rank:
    stamp, dtype, count), the back slots [R, T * min(K, L), 4H], 8 done and 2 rejected words."""
    S, rows, runs = 4 * H, T * min(K, L), min(L, T * min(K, L))
    slots, info = R * L * T * S, R * L * T * 8
    slots_touch = min(slots, R * (rows * S + 2 * runs * PAGE))
    info_touch = min(info, R * (rows * 8 + 2 * runs * PAGE))
    whole = 2 * R * (4 + L) * 8 + 2 * R * 3 * 8 + 2 * R * rows * S + 8 * 8 + 2 * 8
    return whole + 2 * (slots + info), whole + 2 * (slots_touch + info_touch)


@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") != PAGE, reason="the arithmetic below is for 4 KiB pages")
@pytest.mark.parametrize(
    ("R", "H", "T", "K", "E"), [(2, 7168, 8, 2, 32), (8, 7168, 128, 8, 256), (2, 64, 4, 2, 8)]
)
def test_touchable_bytes_are_the_normal_regions_and_one_calls_low_latency_rows(R, H, T, K, E):
    """size_hint's touchable bytes against the arithmetic of `_ll_blocks_by_hand`; the normal-mode
    regions count whole. Alignment pads the mapping a little (64-byte block starts), never the pages
    a call touches."""
    kw = dict(hidden=H, num_experts=E, max_tokens_per_rank=T, num_ranks=R, max_topk=K)
    normal, both = size_hint(**kw, low_latency=False), size_hint(**kw, low_latency=True)
    assert normal.touchable_bytes <= normal.segment_bytes < normal.touchable_bytes + 64 * 40
    mapped, touchable = _ll_blocks_by_hand(R, H, T, K, E // R)
    assert both.touchable_bytes - normal.touchable_bytes == touchable
    assert 0 <= (both.segment_bytes - normal.segment_bytes) - mapped < 64 * 20
    assert both.host_touchable_bytes == R * both.touchable_bytes


def test_the_room_check_counts_touchable_bytes_and_names_the_knobs():
    """8 ranks at the bench's decode shape with low-latency slots: 2.25 GiB a rank mapped, 0.94 GiB
    touchable; a host with 10 GiB free holds them (it refused before), one with 7 GiB does not."""
    hint = size_hint(hidden=7168, num_experts=256, max_tokens_per_rank=128, num_ranks=8, max_topk=8,
                     low_latency=True)  # fmt: skip
    assert hint.segment_bytes > 2 * GiB and hint.touchable_bytes < GiB
    check_room(hint.segment_bytes, [intro(10 * GiB, None)] * 8, hint.touchable_bytes)
    with pytest.raises(SharedMemorySizeError) as caught:
        check_room(hint.segment_bytes, [intro(7 * GiB, None)] * 8, hint.touchable_bytes)
    assert caught.value.needed == 8 * hint.touchable_bytes
    said = str(caught.value)
    assert f"8 ranks x {hint.touchable_bytes} bytes that calls can touch, of the {hint.segment_bytes}" in said
    for knob in ("max_tokens_per_rank", "max_topk", "without low_latency=True"):
        assert knob in said, knob


def _default_and_ll(rank) -> tuple[int, int, str, list[int]]:
    """(a default Buffer's heap bytes, a low_latency=True one's, the default's low-latency refusal,
    the pages of each half of this rank's low-latency slots that four calls touched)."""
    import ubep

    kw = dict(hidden=7168, num_experts=32, max_tokens_per_rank=8, max_topk=2, engine="torch")
    with ubep.Buffer(rank, **kw) as buf:
        default = buf._exchange.t._layout.nbytes
        x = torch.full((8, 7168), 3.0, dtype=torch.float32, device="cpu")  # full-width rows: every byte set
        idx = torch.tensor([[2 * t, 2 * t + 1] for t in range(8)], dtype=torch.int64, device="cpu")  # 16 runs
        with pytest.raises(ValueError) as refused:
            buf.low_latency_dispatch(x, idx, 8, 32)
    with ubep.Buffer(rank, low_latency=True, **kw) as buf:
        heap = buf._ll.t
        for _ in range(2):  # dispatch and combine, twice: both halves
            got = buf.low_latency_dispatch(x, idx, 8, 32)
            buf.low_latency_combine(got.recv_x, idx, torch.ones(8, 2, dtype=torch.float32), got.handle)
        pages = []
        for half in (0, 1):
            slots = heap._tensor_at("ll.slots", half, rank.rank).view(-1)
            at = torch.nonzero(slots).flatten() + slots.data_ptr()
            pages.append(len(set((at // PAGE).tolist())))
        return default, heap._layout.nbytes, str(refused.value), pages


def test_a_default_buffer_maps_no_low_latency_slots_and_a_call_stays_in_its_bound():
    """The default (low_latency=False, as DeepEP) maps what size_hint says without the slots; its
    low-latency call says how to get them. With them, two dispatches of 8 float32 tokens, each
    token on two of rank 0's 16 experts (16 runs a source), touch no more pages of a half than the
    bound of `_ll_blocks_by_hand` (one row of each source's 16 expert blocks of 8, not all 8), and at
    least the rows each rank stages there for its peers to copy (docs/low_latency.md)."""
    from ubep.transport.virtual import VirtualWorld

    hint = dict(hidden=7168, num_experts=32, max_tokens_per_rank=8, num_ranks=2, max_topk=2)
    got = VirtualWorld(2, timeout_s=60).run(_default_and_ll)
    for default, with_ll, refused, pages in got:
        assert (
            default
            == size_hint(**hint).segment_bytes
            < with_ll
            == size_hint(**hint, low_latency=True).segment_bytes
        )
        assert "low_latency=True" in refused and "low_latency=False, the default" in refused
        per_half = 2 * (16 * 4 * 7168 + 2 * 16 * PAGE) // PAGE  # R * (rows * S + 2 * runs pages)
        assert max(pages) <= per_half < 2 * 16 * 8 * 4 * 7168 // PAGE, (pages, per_half)
    staged = 8 * 7168 * 4 // PAGE  # each rank stages its 8 rows once in its own slots; peers copy from there
    assert min(min(pages) for *_, pages in got) >= staged, (
        "a rank's slots hold its own staged rows, each half"
    )

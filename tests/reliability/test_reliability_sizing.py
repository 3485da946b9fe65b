"""Sizing checked before construction: the cgroup's headroom read from v1 and v2
trees (built in a temporary directory, no privileges needed), the room check's
verdict and message, `size_hint` against the layouts, and segment names that
carry what the sweep needs to prove a creator dead."""

from __future__ import annotations

import os

import pytest

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
    assert "max_tokens_per_rank" in message and "low_latency=False" in message
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
    base = dict(hidden=1024, num_experts=16, max_tokens_per_rank=64, num_ranks=8, max_topk=8)
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

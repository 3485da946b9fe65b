"""Construction: ranks that disagree on the Buffer's configuration all raise, naming the
field and the ranks; a rank that never constructs makes the others fail by the deadline."""

from __future__ import annotations

import time

import torch.distributed as dist

import ubep
import ubep.buffer
import ubep.deadlines

BASE = dict(hidden=64, num_experts=8, max_tokens_per_rank=16, protocol="ubep", transport="shm")

# (name, rank that differs, its settings, text every rank's error must contain)
MISMATCHES = [
    ("hidden", 2, dict(hidden=128), "hidden (rank(s) 0, 1, 3: 64; rank(s) 2: 128)"),
    (
        "sizes",
        1,
        dict(num_experts=12, max_tokens_per_rank=32),
        "num_experts (rank(s) 0, 2, 3: 8; rank(s) 1: 12)",
    ),
    ("protocol", 3, dict(protocol="bsp"), "protocol (rank(s) 0, 1, 2: 'ubep'; rank(s) 3: 'bsp')"),
    ("transport", 0, dict(transport="dist"), "transport (rank(s) 0: 'dist'; rank(s) 1, 2, 3: 'shm')"),
    (
        "version",
        1,
        dict(version="0.0.0-other"),
        "version (rank(s) 0, 2, 3: '0.1.0'; rank(s) 1: '0.0.0-other')",
    ),
]


def mismatched_builds() -> list[tuple[str, str]]:
    me, seen = dist.get_rank(), []
    for name, odd, settings, _ in MISMATCHES:
        args = BASE | (settings if me == odd else {})
        version = args.pop("version", ubep.buffer.VERSION)
        saved, ubep.buffer.VERSION = ubep.buffer.VERSION, version
        try:
            ubep.Buffer(**args).close()
            seen.append(("none", name))
        except ubep.ConfigMismatchError as error:
            seen.append(("ConfigMismatchError", str(error)))
        finally:
            ubep.buffer.VERSION = saved
    with ubep.Buffer(**BASE) as buf:  # the group is still in step: an agreeing Buffer works
        seen.append(("built", buf.explain()))
    return seen


def test_mismatch_raises_on_every_rank_naming_field_and_ranks():
    results = ubep.LocalLaunch(world_size=4, timeout_s=90).run(mismatched_builds)
    for rank, seen in enumerate(results):
        for (_, _, _, text), (kind, message) in zip(MISMATCHES, seen, strict=False):
            assert kind == "ConfigMismatchError", (rank, message)
            assert text in message, (rank, message)
            assert message.startswith(f"Buffer on rank {rank}: ranks disagree on ")
        assert seen[len(MISMATCHES)][0] == "built"
    sizes = results[0][1][1]
    assert "max_tokens_per_rank (rank(s) 0, 2, 3: 16; rank(s) 1: 32)" in sizes, "every differing field"


def absent_rank(timeout_s: float) -> tuple[str, str, float]:
    """Rank 1 never builds its Buffer; the others must give up at their deadline."""
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 5.0)
        return "absent", "", 0.0
    start = time.monotonic()
    try:
        ubep.Buffer(**BASE, timeout_s=timeout_s).close()
        return "none", "", 0.0
    except ubep.CommTimeoutError as error:
        elapsed = time.monotonic() - start
        time.sleep(1.0)  # stay alive so no peer sees this rank exit instead
        return type(error).__name__, str(error), elapsed


def test_construction_has_a_deadline():
    timeout_s = ubep.deadlines.CONSTRUCTION_MIN_TIMEOUT_S  # a shorter timeout_s would be raised to this
    results = ubep.LocalLaunch(world_size=3, timeout_s=60).run(absent_rank, timeout_s)
    for rank, (kind, message, elapsed) in enumerate(results):
        if rank == 1:
            continue
        assert kind == "CommTimeoutError", message
        assert message.startswith("Buffer construction (joining the group): no signal from rank(s)"), message
        assert f"after {timeout_s:g} s" in message
        assert "1" in message.split("no signal from rank(s)")[1].split("after")[0]
        assert timeout_s * 0.9 <= elapsed < 3 * timeout_s + 1.0, elapsed  # docs/reliability.md's bound

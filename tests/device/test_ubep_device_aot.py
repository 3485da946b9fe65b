"""Normal mode's call halves (UBEP's: `ubep.protocols.ubep.triton_halves`; the combine's:
`ubep.protocols.combine.triton_halves`; BSP's phases: `ubep.protocols.bsp.triton_halves`) compile
ahead of time for sm_90 and sm_100 (no GPU needed), and their PTX says what docs/device.md's
ordering argument needs: every stamp (and barrier word) is a system-scope release, preceded by a block
barrier after the program's last plain store; every poll is a system-scope acquire; every loop that
polls is bounded by `max_spins`; the sum in combine has no fused multiply-add, no approximate division
and no flush-to-zero.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from test_ll_device_aot import _conjuncts, _loops  # noqa: E402  (after the skip without triton)
from test_triton_aot import ARCHS, _sig, bodies, ptx_of, unbarriered  # noqa: E402  (after the skip without triton)

HEAD = "table:*i64 live:*u8 me:i32 epochs:*i64"
# (kernel, runtime argument types, constexprs): one specialization each, as the Triton drivers
# launch it (bf16 rows as int32 words; top-8, 16 ranks at most; the layout derived from top-k).
SPECS = [
    ("ubep_dispatch_send_kernel", _sig(
        "table:*i64 me:i32 epochs:*i64 x:*i32 W:i32 scales:*i32 S:i32 topk:*i64 weights:*fp32 N:i32 K:i32 "
        "in_rank:*u8 counts:*i64 owner:*i64 E:i32 R:i32 announced:i32 code:i32 Kmax:i32 T:i32 arrivals:*i64 "
        "programs:i32 status:*i64"),
     {"WORD": tl.int32, "NB": 64, "KB": 8, "RB": 16, "WB": 128, "ROUTED": True}),
    ("ubep_dispatch_routes_kernel", _sig(
        f"{HEAD} R:i32 code:i32 K:i32 Kmax:i32 T:i32 dtype_lo:i32 dtype_hi:i32 counts:*i64 sent:*i64 "
        "prefix:*i64 worst:i32 state:*i64 status:*i64 max_spins:i32"),
     {"CACHED": False, "RB": 16}),
    ("ubep_dispatch_gather_kernel", _sig(
        f"{HEAD} R:i32 T:i32 Kmax:i32 E:i32 routes:*i64 counts:*i64 sent:*i64 prefix:*i64 "
        "local_of_expert:*i64 K:i32 recv_idx:*i64 recv_w:*fp32 src_token:*i64 src_rank:*i64 recv_x:*i32 "
        "W:i32 recv_scales:*i32 S:i32 state:*i64 blocks:i32 status:*i64 max_spins:i32"),
     {"WORD": tl.int32, "IB": 16, "KB": 8, "WB": 128}),
    ("combine_send_kernel", _sig(
        "table:*i64 me:i32 epochs:*i64 y:*i32 W:i32 weights:*fp32 K:i32 Kmax:i32 prefix:*i64 R:i32 "
        "seq:i32 code:i32 arrivals:*i64 programs:i32"),
     {"WORD": tl.int32, "IB": 16, "KB": 8, "RB": 16, "WB": 128}),
    ("combine_reduce_kernel", _sig(
        f"{HEAD} R:i32 N:i32 in_rank:*u8 place:*i64 send_counts:*i64 seq:i32 code:i32 dtype_lo:i32 "
        "dtype_hi:i32 K:i32 Kmax:i32 rows_max:i32 out:*i16 H:i32 out_w:*fp32 state:*i64 status:*i64 "
        "max_spins:i32"),
     {"KIND": 1, "RB": 16, "KB": 8, "HB": 256}),
    ("bsp_counts_kernel", _sig(
        "table:*i64 me:i32 epochs:*i64 counts:*i64 R:i32 topk:*i64 N:i32 K:i32 in_rank:*u8 owner:*i64 E:i32 "
        "forced:i32 status:*i64"),
     {"NB": 64, "KB": 8, "RB": 16, "ROUTED": True}),
    ("bsp_barrier_kernel", _sig("table:*i64 live:*u8 me:i32 targets:*i64 R:i32 status:*i64 max_spins:i32"),
     {}),
    ("bsp_send_kernel", _sig(
        f"{HEAD} x:*i32 W:i32 b:i32 scales:*i32 S:i32 topk:*i64 weights:*fp32 N:i32 K:i32 in_rank:*u8 "
        "R:i32 local_of_RE:*i64 E:i32 code:i32 Kmax:i32 T:i32 row_bytes:i32 arrivals:*i64 blocks:i32 "
        "status:*i64"),
     {"WORD": tl.int32, "NB": 64, "KB": 8, "WB": 128}),
    ("bsp_verify_kernel", _sig(
        f"{HEAD} R:i32 code:i32 K:i32 Kmax:i32 T:i32 dtype_lo:i32 dtype_hi:i32 counts:*i64 prefix:*i64 "
        "worst:i32 pending:*i64 status:*i64"),
     {"RB": 16}),
    ("bsp_reorder_kernel", _sig(
        "table:*i64 me:i32 prefix:*i64 R:i32 T:i32 Kmax:i32 L:i32 row_bytes:i32 recv_x:*i32 W:i32 "
        "recv_scales:*i32 S:i32 recv_idx:*i64 recv_w:*fp32 K:i32 src_token:*i64 src_rank:*i64 status:*i64"),
     {"WORD": tl.int32, "IB": 16, "KB": 8, "WB": 128}),
]  # fmt: skip
STAMPS = {"ubep_dispatch_send_kernel": 2, "combine_send_kernel": 1, "bsp_counts_kernel": 1,
          "bsp_send_kernel": 1, "bsp_barrier_kernel": 2}  # fmt: skip  # system-scope releases by exchange
# (the barrier's second: a rank that rejected its own input arrives without waiting)
POLLS = ("ubep_dispatch_routes_kernel", "ubep_dispatch_gather_kernel", "combine_reduce_kernel",
         "bsp_barrier_kernel")  # fmt: skip  # they wait, bounded (verify reads flags once, reorder none)


def _modules() -> dict[str, object]:
    """Each protocol's Triton halves by the prefix of their kernels' names."""
    from ubep.protocols.bsp import triton_halves as bsp_triton
    from ubep.protocols.combine import triton_halves as normal_triton
    from ubep.protocols.ubep import triton_halves as ubep_triton

    return {"bsp_": bsp_triton, "combine_": normal_triton, "ubep_": ubep_triton}


def _compile(name: str, arch: int) -> str:
    _, sig, consts = next(s for s in SPECS if s[0] == name)
    module = next(m for prefix, m in _modules().items() if name.startswith(prefix))
    return ptx_of(getattr(module, name), sig, consts, arch)


@pytest.fixture(scope="module")
def ptx() -> dict[tuple[str, int], list[str]]:
    """Instruction lines of every half for every architecture."""
    return bodies(_compile, [name for name, *_ in SPECS])


def test_every_half_compiles_for_sm90_and_sm100(ptx):
    kernels = {n for module in _modules().values() for n in dir(module) if n.endswith("_kernel")}
    assert kernels == {name for name, *_ in SPECS}
    for (name, arch), body in ptx.items():
        assert any(line.startswith(f".target sm_{arch}") for line in body), (name, arch)
        assert any(f".entry {name}" in line for line in body), (name, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [s[0] for s in SPECS])
def test_stamps_release_after_a_barrier_and_polls_acquire_at_system_scope(ptx, name, arch):
    """Every stamp and barrier word is a system-scope release exchange, after a block barrier that
    follows the last plain store before it (arrivals too); every poll is a system-scope acquire. A
    receive half releases nothing (UBEP needs no "consumed" word: see `ubep.protocols.ubep`)."""
    body = ptx[name, arch]
    atoms = [(i, line) for i, line in enumerate(body) if re.search(r"\batom\.", line)]
    releases = [(i, line) for i, line in atoms if ".release." in line or ".acq_rel." in line]
    acquires = [line for _, line in atoms if "acquire" in line]
    stamps = [line for _, line in releases if re.search(r"atom\.global\.sys\.release\.exch\.b64", line)]
    assert len(stamps) == STAMPS.get(name, 0), stamps  # ROUTE, DATA / BACK / counts / staged / barrier
    assert all(re.search(r"atom\.global\.acquire\.sys\.cas\.b64", a) for a in acquires), acquires
    assert bool(acquires) == (name in POLLS or name in ("bsp_verify_kernel", "bsp_barrier_kernel")), name
    assert all(".sys." in line for _, line in releases), releases
    assert not unbarriered(body, releases), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", POLLS)
def test_every_polling_loop_is_bounded_by_max_spins(ptx, name, arch):
    """Each innermost loop that polls (an acquire in its body) leaves once a compare against the
    `max_spins` parameter fails: its back-edge is predicated on an `and` with that compare."""
    body = ptx[name, arch]
    param = f"{name}_param_{list(next(s for s in SPECS if s[0] == name)[1]).index('max_spins')}"
    bound = {m.group(1) for line in body if (m := re.match(rf"ld\.param\.\w+\s+(%r\d+), \[{param}\]", line))}
    assert bound, f"{param} is never loaded"
    defs = {m.group(1): line for line in body if (m := re.match(r"[\w.]+\s+(%p\d+), (.*);", line))}
    loops = _loops(body)
    innermost = [(lines, p) for lines, p in loops if not any(other < lines for other, _ in loops)]
    polling = [(lines, p) for lines, p in innermost if any("acquire" in body[i] for i in lines)]
    assert polling, f"no polling loop found in {name}"
    for lines, pred in polling:
        assert pred, f"unconditional back-edge in {name} at line {max(lines)}"
        compares = _conjuncts(pred, defs)
        assert any(re.match(r"setp\.(lt|gt|le|ge)\.s32", c) and set(re.findall(r"%r\d+", c)) & bound
                   for c in compares), compares  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_the_combine_sum_is_unfused_and_ieee(ptx, arch):
    body = ptx["combine_reduce_kernel", arch]
    assert any(line.startswith(("add.rn.f32", "add.f32")) for line in body), "no float sum found"
    assert not [line for line in body if line.startswith("fma.")], "a multiply and add were fused"
    assert not [line for line in body if ".ftz" in line or "div.full" in line or "div.approx" in line]

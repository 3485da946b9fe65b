"""The low-latency call halves (`ubep.protocols.ll.triton_halves`) compile ahead of time for sm_90 and
sm_100 (no GPU needed), and their PTX says what docs/device.md's ordering argument needs: every stamp
and every "consumed" word is a system-scope release, preceded by a block barrier after the program's
last plain store; every poll of a stamp is a system-scope acquire; every loop that polls is bounded by
`max_spins`; the sum in combine has no fused multiply-add, no approximate division and no flush-to-zero.
In word form (rows as 8-byte words of payload and epoch), the send halves write rows with relaxed
system-scope 8-byte atomic exchanges and the receive halves poll them with volatile 8-byte loads, in
loops bounded the same.
"""

from __future__ import annotations

import itertools
import re

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from test_triton_aot import ARCHS, _sig, bodies, ptx_of, unbarriered  # noqa: E402  (after the skip without triton)

COMMON = "table:*i64 live:*u8 me:i32 epochs:*i64"
# kernel -> (runtime argument types, constexprs): the specialization `ll.triton_driver` launches
# (bf16 rows as int32 words; H 7168, top-8, 32 local experts, 8 ranks), rows after data.
KERNELS = {
    "ll_dispatch_send_kernel": (_sig(
        f"{COMMON} rows:*i32 topk:*i64 N:i32 K:i32 E:i32 experts:*i64 L:i32 code:i32 T:i32 Kmax:i32 "
        "Tcap:i32 slot_words:i32 slot_bytes:i32 W:i32 width:i32 arrivals:*i64 progress:*i64 status:*i64 "
        "max_spins:i32"),
     {"WORD": tl.int32, "IN_WORD": False, "NB": 64, "KB": 8, "WB": 128}),
    "ll_dispatch_recv_kernel": (_sig(
        f"{COMMON} R:i32 L:i32 code:i32 T:i32 Kmax:i32 Tcap:i32 slot_words:i32 slot_bytes:i32 row_bytes:i32 "
        "width:i32 dtype_lo:i32 dtype_hi:i32 plane0:*i32 W0:i32 plane1:*i32 W1:i32 M:i32 src_token:*i64 "
        "src_rank:*i64 src_k:*i64 layout_range:*i64 recv_count:*i32 state:*i64 arrivals:*i64 status:*i64 "
        "max_spins:i32"),
     {"WORD": tl.int32, "IN_WORD": False, "LB": 32, "IB": 16, "WB": 128}),
    "ll_combine_send_kernel": (_sig(
        f"{COMMON} x:*i32 L:i32 M:i32 W:i32 layout_range:*i64 R:i32 per_writer:i32 slot_words:i32 code:i32 "
        "topk:*i64 given:*i64 N:i32 K:i32 recv_count:*i32 arrivals:*i64 progress:*i64 status:*i64 "
        "max_spins:i32"),
     {"WORD": tl.int32, "IN_WORD": False, "LB": 32, "RB": 8, "NB": 64, "KB": 8, "IB": 16, "WB": 128}),
    "ll_combine_recv_kernel": (_sig(
        "table:*i64 me:i32 epochs:*i64 topk:*i64 K:i32 owner:*i64 expected:*i64 weights:*fp32 "
        "code:i32 dtype_lo:i32 dtype_hi:i32 count_hi:i32 slots:*i64 slot_bytes:i32 out:*i16 H:i32 state:*i64 "
        "arrivals:*i64 programs:i32 status:*i64 max_spins:i32"),
     {"Y_BF16": True, "IN_WORD": False, "HB": 256}),
}  # fmt: skip
WORD = "[in-word]"  # the suffix of a kernel's in-word specialization
# (name, kernel, runtime argument types, constexprs): each kernel after data, and in word form
SPECS = [(kernel, kernel, sig, consts) for kernel, (sig, consts) in KERNELS.items()] + [
    (kernel + WORD, kernel, sig, consts | {"IN_WORD": True}) for kernel, (sig, consts) in KERNELS.items()
]


def _compile(name: str, arch: int) -> str:
    from ubep.protocols.ll import triton_halves as ll_triton

    _, kernel, sig, consts = next(s for s in SPECS if s[0] == name)
    return ptx_of(getattr(ll_triton, kernel), sig, consts, arch)


@pytest.fixture(scope="module")
def ptx() -> dict[tuple[str, int], list[str]]:
    """Instruction lines of every half for every architecture."""
    return bodies(_compile, [name for name, *_ in SPECS])


def test_every_half_compiles_for_sm90_and_sm100(ptx):
    from ubep.protocols.ll import triton_halves as ll_triton

    assert {n for n in dir(ll_triton) if n.endswith("_kernel")} == set(KERNELS)
    for (name, arch), body in ptx.items():
        kernel = name.removesuffix(WORD)
        assert any(line.startswith(f".target sm_{arch}") for line in body), (name, arch)
        assert any(f".entry {kernel}" in line for line in body), (name, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [s[0] for s in SPECS])
def test_releases_follow_a_barrier_and_polls_acquire_at_system_scope(ptx, name, arch):
    """Every release (stamps, "consumed", arrivals, the `rejected` word) is system-scope and comes after a
    block barrier that follows the program's last plain store before it; every acquire is system-scope."""
    body = ptx[name, arch]
    atoms = [(i, line) for i, line in enumerate(body) if re.search(r"\b(atom|red)\.", line)]
    releases = [(i, line) for i, line in atoms if ".release." in line or ".acq_rel." in line]
    if "_send_" in name:  # a rejected input raises the `rejected` word: a release max (red: 3.9, atom: 3.6)
        assert any(re.search(r"(red|atom)\.global\.sys\.release\.max\.s64", line) for _, line in releases), (
            name
        )
    stamps = [line for _, line in releases if re.search(r"atom\.global\.sys\.release\.exch\.b64", line)]
    assert stamps, f"{name}: no system-scope release exchange (stamp or consumed word)"
    for _, line in releases:
        assert ".sys." in line or ".gpu.acq_rel.add" in line, line  # own-kernel arrivals may be gpu-scope
    assert not unbarriered(body, releases), name
    acquires = [line for _, line in atoms if "acquire" in line]
    assert acquires and all(re.search(r"atom\.global\.acquire\.sys\.cas\.b64", a) for a in acquires), acquires


def _loops(body: list[str]) -> list[tuple[set[int], str | None]]:
    """Every loop of the control-flow graph: (its body as line numbers, the predicate of its back-edge
    or None). A branch to an earlier label is a back-edge only if that label's block reaches it: code
    layout also places some exits (an epilogue) above the branches that jump to them."""
    starts = [0] + [i for i, line in enumerate(body) if re.fullmatch(r"\$\w+:", line)] + [len(body)]
    starts = sorted(set(starts))
    blocks = list(itertools.pairwise(starts))
    block_of = {line[:-1]: b for b, (a, _) in enumerate(blocks) if re.fullmatch(r"\$\w+:", (line := body[a]))}
    succ: dict[int, set[int]] = {b: set() for b in range(len(blocks))}
    branches = []
    for b, (a, end) in enumerate(blocks):
        falls = True
        for i in range(a, end):
            if m := re.match(r"(@!?(%p\d+) )?bra(\.uni)?\s+(\$\w+);", body[i]):
                succ[b].add(block_of[m.group(4)])
                negated = "!" if m.group(1) and "!" in m.group(1) else ""  # a negation is no bound
                branches.append((b, i, block_of[m.group(4)], m.group(2) and negated + m.group(2)))
                falls = falls and m.group(1) is not None
            elif body[i].startswith("ret"):
                falls = False
        if falls and b + 1 < len(blocks):
            succ[b].add(b + 1)
    pred: dict[int, set[int]] = {b: set() for b in succ}
    for b, targets in succ.items():
        for t in targets:
            pred[t].add(b)
    loops = []
    for source, line, head, predicate in branches:
        if blocks[head][0] > line:
            continue
        members, todo = {head}, [source]  # the natural loop: what reaches the back-edge without the head
        while todo:
            b = todo.pop()
            if b not in members:
                members.add(b)
                todo.extend(pred[b])
        reach, todo = set(), [head]
        while todo:
            b = todo.pop()
            if b not in reach:
                reach.add(b)
                todo.extend(succ[b])
        if source in reach:
            loops.append(({i for b in members for i in range(*blocks[b])}, predicate))
    return loops


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [s[0] for s in SPECS])
def test_every_polling_loop_is_bounded_by_max_spins(ptx, name, arch):
    """Each innermost loop that polls (an acquire, or in word form a volatile load, in its body) leaves once
    a compare against the `max_spins` parameter fails: its back-edge is predicated on an `and` with that
    compare."""
    body = ptx[name, arch]
    _, kernel, sig, _ = next(s for s in SPECS if s[0] == name)
    param = f"{kernel}_param_{list(sig).index('max_spins')}"
    bound = {m.group(1) for line in body if (m := re.match(rf"ld\.param\.\w+\s+(%r\d+), \[{param}\]", line))}
    assert bound, f"{param} is never loaded"
    defs = {m.group(1): line for line in body if (m := re.match(r"[\w.]+\s+(%p\d+), (.*);", line))}
    loops = _loops(body)
    innermost = [(lines, p) for lines, p in loops if not any(other < lines for other, _ in loops)]
    polls = ("acquire", "ld.volatile")
    polling = [(lines, p) for lines, p in innermost if any(w in body[i] for i in lines for w in polls)]
    assert polling, f"no polling loop found in {name}"
    for lines, pred in polling:
        assert pred, f"unconditional back-edge in {name} at line {max(lines)}"
        compares = _conjuncts(pred, defs)
        assert any(re.match(r"setp\.(lt|gt|le|ge)\.s32", c) and set(re.findall(r"%r\d+", c)) & bound
                   for c in compares), compares  # fmt: skip


def _conjuncts(pred: str, defs: dict[str, str]) -> list[str]:
    """The definitions a predicate is the `and` of (through nested `and.pred`; anything else is a leaf)."""
    line = defs.get(pred, "")
    if not line.startswith("and.pred"):
        return [line]
    return [c for p in re.findall(r"%p\d+", line)[1:] for c in _conjuncts(p, defs)]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_combine_sum_is_unfused_and_ieee(ptx, arch):
    body = ptx["ll_combine_recv_kernel", arch]
    assert any(line.startswith(("mul.rn.f32", "mul.f32")) for line in body), "no float product found"
    assert not [line for line in body if line.startswith("fma.")], "a multiply and add were fused"
    assert not [line for line in body if ".ftz" in line or "div.full" in line or "div.approx" in line]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_in_word_rows_are_relaxed_8_byte_atomics_polled_volatile(ptx, kernel, arch):
    """In word form the send halves write rows as 8-byte words by relaxed system-scope atomic exchanges
    (after data: none), and the receive halves poll words with volatile 8-byte loads (after data: none)."""
    plain, word = ptx[kernel, arch], ptx[kernel + WORD, arch]

    def relaxed(body):
        return [line for line in body if re.search(r"atom\.global\.sys\.relaxed\.exch\.b64", line)]

    def volatile(body):
        return [line for line in body if re.search(r"\bld\.volatile\.global\.(b64|u64|s64)", line)]

    if "_send_" in kernel:
        assert relaxed(word) and not relaxed(plain), relaxed(plain)
        assert not [line for line in word if re.search(r"atom\.\S*relaxed\S*exch\.b32", line)]
    else:
        assert volatile(word) and not volatile(plain), volatile(plain)

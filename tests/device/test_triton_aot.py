"""Every Triton kernel compiles ahead of time for sm_90 and sm_100 (no GPU needed), and its PTX says what
the memory-ordering argument of docs/device.md needs: system-scope release writes and acquire reads on
flags, 8-byte relaxed atomics for data-as-flag words, wait loops bounded by their iteration count, and no
fused multiply-add or approximate division where results must equal the torch engine's bit for bit.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

ARCHS = (90, 100)
OPTIONS = {"enable_fp_fusion": False}  # what the engine passes to every launch
ARITHMETIC = (
    "accumulate_rows_kernel",
    "weighted_sum_kernel",
    "quantize_rows_kernel",
    "dequantize_rows_kernel",
)
COPY = "src_peer_n:*i64 src_index_n:*i64 src_stride:i64 dst_peer_n:*i64 dst_index_n:*i64 dst_stride:i64 W:i32"
INDEXED = {"SRC_INDEXED": True, "DST_INDEXED": True}


def _sig(text: str) -> dict[str, str]:
    """ "name:type name:type ..." -> a signature dict (triton's type names: *i64 a pointer, i32 a scalar)."""
    return dict(item.split(":") for item in text.split())


# (kernel name, runtime argument types, constexprs): one specialization each, as the engine launches it.
SPECS = [
    ("copy_rows_kernel", _sig(f"src:*i64 dst:*i64 {COPY}"),
     INDEXED | {"WORD": tl.int64, "SRC_PEERS": True, "DST_PEERS": False, "BLOCK": 1024}),
    ("put_rows_flag_kernel", _sig(f"src:*i64 dst:*i64 {COPY} arrivals:*i64 flag:*i64 epoch:i64 programs:i32"),
     INDEXED | {"WORD": tl.int64, "SRC_PEERS": False, "DST_PEERS": True, "BLOCK": 1024}),
    ("flag_write_kernel", _sig("flag_n:*i64 epoch:i64"), {}),
    ("flag_wait_kernel", _sig("flag_n:*i64 epoch:i64 landed_n:*i32 max_spins:i32"), {}),
    ("pack_put_kernel", _sig("src:*i32 src_index_n:*i64 src_stride:i64 dst:*i64 dst_index_n:*i64 "
                             "dst_stride:i64 epoch:i64 W:i32"), INDEXED | {"BLOCK": 1024}),
    ("unpack_wait_kernel", _sig("src:*i64 src_index_n:*i64 src_stride:i64 dst:*i32 dst_index_n:*i64 "
                                "dst_stride:i64 epoch:i64 W:i32 max_spins:i32 missing:*i32"),
     INDEXED | {"BLOCK": 1024}),
    ("accumulate_rows_kernel", _sig("acc:*fp32 acc_stride:i64 rows:*bf16 rows_stride:i64 order_n:*i64 "
                                    "starts_N:*i64 weight_n:*fp32 H:i32"), {"WEIGHTED": True, "BLOCK": 512}),
    ("weighted_sum_kernel", _sig("y:*bf16 y_stride_n:i64 y_stride_k:i64 w:*fp32 valid:*u8 K:i32 "
                                 "out:*fp32 H:i32"),
     {"BLOCK": 512}),
    ("localize_rows_kernel", _sig("topk:*i64 topk_stride:i64 weights:*fp32 weights_stride:i64 rows_n:*i64 "
                                  "local_of_expert_E:*i64 out_idx:*i64 out_weights:*fp32 count:i32 K:i32"),
     {"WEIGHTED": True, "BLOCK": 256}),
    ("quantize_rows_kernel", _sig("x:*bf16 x_stride:i64 src_index_n:*i64 values:*u8 values_stride:i64 "
                                  "scales:*fp32 scales_stride:i64 dst_index_n:*i64 NB:i32"),
     INDEXED | {"BB": 8}),
    ("dequantize_rows_kernel", _sig("values:*u8 values_stride:i64 scales:*fp32 scales_stride:i64 "
                                    "src_index_n:*i64 out:*i16 out_stride:i64 dst_index_n:*i64 NB:i32"),
     INDEXED | {"OUT_BF16": True, "BB": 8}),
]  # fmt: skip


def ptx_of(fn, sig: dict, consts: dict, arch: int) -> str:
    """PTX of the Triton kernel `fn` for sm_`arch`, specialized as the engine launches it: runtime
    argument types `sig`, compile-time values `consts`, the engine's options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = sig | {k: "constexpr" for k in consts}
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", arch, 32), options=OPTIONS
    )
    return compiled.asm["ptx"]


def _compile(name: str, arch: int) -> str:
    from ubep.engine import triton_kernels

    _, sig, consts = next(s for s in SPECS if s[0] == name)
    return ptx_of(getattr(triton_kernels, name), sig, consts, arch)


def compiled_or_skip(compile_one, names: list[str]) -> dict[tuple[str, int], str]:
    """PTX of every name for every architecture, each compiled once by compile_one(name, arch); skip
    the module's tests where the first compile shows triton cannot target CUDA here."""
    first = (names[0], ARCHS[0])
    try:
        got = {first: compile_one(*first)}
    except Exception as e:  # no CUDA backend or toolchain in this triton build
        pytest.skip(f"triton cannot compile for CUDA here: {type(e).__name__}: {e}")
    got.update({(n, a): compile_one(n, a) for n in names for a in ARCHS if (n, a) != first})
    return got


@pytest.fixture(scope="module")
def ptx() -> dict[tuple[str, int], str]:
    """PTX of every kernel for every architecture, compiled once."""
    return compiled_or_skip(_compile, [name for name, *_ in SPECS])


def _body(ptx: str) -> list[str]:
    """Instruction lines, without debug sections, comments and location markers."""
    code = ptx.split(".section\t.debug")[0]
    lines = (line.split("//")[0].strip() for line in code.splitlines())
    return [line for line in lines if line and not line.startswith((".loc", ".file"))]


def bodies(compile_one, names: list[str]) -> dict[tuple[str, int], list[str]]:
    """Instruction lines (`_body`) of every name for every architecture (`compiled_or_skip`)."""
    return {key: _body(code) for key, code in compiled_or_skip(compile_one, names).items()}


def unbarriered(body: list[str], releases: list[tuple[int, str]]) -> list[str]:
    """The releases (line index, line) that a plain store precedes with no block barrier between the
    last such store and the release: each must be ordered after the stores it publishes."""
    bad = []
    for i, line in releases:
        stores = [s for s, other in enumerate(body[:i]) if re.search(r"\bst\.global", other)]
        if stores and not any(other.startswith("bar.sync") for other in body[stores[-1] : i]):
            bad.append(line)
    return bad


def test_every_kernel_compiles_for_sm90_and_sm100(ptx):
    from ubep.engine import triton_kernels

    kernels = {n for n in dir(triton_kernels) if n.endswith("_kernel")}
    assert kernels == {name for name, *_ in SPECS}, "a kernel lacks an ahead-of-time specialization"
    for (name, arch), text in ptx.items():
        assert f".target sm_{arch}" in text and f".entry {name}" in text


@pytest.mark.parametrize("arch", ARCHS)
def test_flags_are_released_and_acquired_at_system_scope(ptx, arch):
    def atoms(name: str) -> list[str]:
        return [line for line in _body(ptx[name, arch]) if "atom." in line]

    assert any(re.search(r"atom\.global\.sys\.release\.exch\.b64", a) for a in atoms("flag_write_kernel"))
    put = atoms("put_rows_flag_kernel")
    assert any(re.search(r"atom\.global\.sys\.acq_rel\.add", a) for a in put), put  # arrivals
    assert re.search(r"atom\.global\.sys\.release\.exch\.b64", put[-1]), put  # the stamp comes last
    wait = atoms("flag_wait_kernel")
    assert wait and all(re.search(r"atom\.global\.acquire\.sys\.cas\.b64", a) for a in wait), wait
    words = atoms("pack_put_kernel")
    assert words and all(re.search(r"atom\.global\.sys\.relaxed\.exch\.b64", a) for a in words), words


@pytest.mark.parametrize("arch", ARCHS)
def test_data_writes_precede_the_release_behind_a_block_barrier(ptx, arch):
    body = _body(ptx["put_rows_flag_kernel", arch])
    last_store = max(i for i, line in enumerate(body) if re.search(r"\bst\.global", line))
    first_arrival = next(i for i, line in enumerate(body) if "acq_rel" in line)
    assert any(line.startswith("bar.sync") for line in body[last_store:first_arrival])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["flag_wait_kernel", "unpack_wait_kernel"])
def test_wait_loops_are_bounded_by_their_spin_count(ptx, name, arch):
    """Every backward branch is taken only while a compare against the `max_spins` parameter holds."""
    body = _body(ptx[name, arch])
    spec = next(s for s in SPECS if s[0] == name)[1]
    param = f"{name}_param_{list(spec).index('max_spins')}"
    bound = {m.group(1) for line in body if (m := re.match(rf"ld\.param\.\w+\s+(%r\d+), \[{param}\]", line))}
    assert bound, f"{param} is never loaded"
    defs = {}
    for line in body:
        if m := re.match(r"[\w.]+\s+(%p\d+), (.*);", line):
            defs[m.group(1)] = line
    labels = {line[:-1]: i for i, line in enumerate(body) if re.fullmatch(r"\$\w+:", line)}
    loops = 0
    for i, line in enumerate(body):
        m = re.match(r"(@(%p\d+) )?bra(\.uni)?\s+(\$\w+);", line)
        if not m or labels[m.group(4)] > i:
            continue
        loops += 1
        assert m.group(2), f"unconditional backward branch in {name}: {line}"
        conjunction = defs[m.group(2)]
        assert conjunction.startswith("and.pred"), conjunction
        operands = re.findall(r"%p\d+", conjunction)[1:]
        compares = [defs[p] for p in operands]
        assert any(re.match(r"setp\.(lt|gt|le|ge)\.s32", c) and set(re.findall(r"%r\d+", c)) & bound
                   for c in compares), compares  # fmt: skip
    assert loops >= 1, f"no wait loop found in {name}"
    if name == "unpack_wait_kernel":
        assert any(re.search(r"\bld\.volatile\.global", line) for line in body), (
            "words must be polled volatile"
        )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ARITHMETIC)
def test_arithmetic_is_unfused_and_ieee(ptx, name, arch):
    """No FMA contraction, no approximate division, no flush-to-zero: the torch engine's rounding exactly."""
    body = _body(ptx[name, arch])
    assert not [line for line in body if line.startswith("fma.")], "a multiply and add were fused"
    assert not [line for line in body if ".ftz" in line or "div.full" in line or "div.approx" in line]
    if name == "quantize_rows_kernel":
        assert any(line.startswith("div.rn.f32") for line in body)

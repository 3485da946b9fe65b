"""The triton engine against the torch engine and `ubep.reference`, bit for bit (NaN positions exact).

On CPU the kernels run under the Triton interpreter, which must be enabled before triton is imported:
`test_interpreter_suite` reruns this module in a subprocess with TRITON_INTERPRET=1 (and the CPU cases
skip in the parent process). With a CUDA device the `cuda`-marked cases run the same checks compiled
(scripts/device_check.sh). Shapes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from interpreted import INTERPRETED, interpreter_env, run_interpreted

from ubep import fp8, reference
from ubep.engine.torch_engine import TorchEngine

CUDA = not INTERPRETED and torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="runs in test_interpreter_suite")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device")]),
]
SPINS = 50  # bounded waits that are expected to time out stay short under the interpreter


@pytest.mark.timeout(420)
def test_interpreter_suite():
    """This module under TRITON_INTERPRET=1 in a fresh interpreter, so no other test sees the interpreter."""
    run_interpreted(__file__, 400, "-m", "not cuda")  # ~100 s here, unloaded


@pytest.fixture
def engine():
    from ubep.engine.triton_engine import TritonEngine

    return TritonEngine()


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, except that any NaN equals any NaN (torch's own paths differ in NaN payloads)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype in (torch.float32, torch.bfloat16, torch.float16):
        nan = got.isnan()
        assert torch.equal(nan, want.isnan()), "NaN positions differ"
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differ = got.view(bits) != want.view(bits)
    assert not differ.any(), f"{int(differ.sum())} elements differ, first at {differ.nonzero()[0].tolist()}"


def _x(n: int, h: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows with the values that break sloppy kernels: NaN, +-Inf, -0, subnormals, large."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.logspace(-3, 2, n)[:, None]
    x.view(-1)[:: max(1, h // 3)] = -0.0
    x[0, 1], x[n - 1, 2], x[n // 2, 3] = float("nan"), float("inf"), -float("inf")
    x[n // 2, 4] = 1e-40
    return x.to(dtype)


# --- rows as words ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bf16", "fp32", "fp8-wire", "odd-bytes"])
def test_copy_rows_is_the_torch_engines(engine, device, kind):
    rows = {
        "bf16": _x(7, 160, torch.bfloat16),
        "fp32": _x(7, 96, torch.float32),
        "fp8-wire": fp8.to_rows(*fp8.quantize(_x(7, 256, torch.float32).nan_to_num())),
        "odd-bytes": torch.arange(7 * 6, dtype=torch.uint8).view(7, 6),  # 2-byte words
    }[kind].to(device)
    src_index = torch.tensor([6, 0, 3, 3], device=device)
    dst_index = torch.tensor([1, 4, 0, 2], device=device)
    for s_idx, d_idx in (
        (src_index, None),
        (None, torch.arange(6, -1, -1, device=device)),
        (src_index, dst_index),
    ):
        got, want = torch.zeros_like(rows), torch.zeros_like(rows)
        engine.copy_rows(rows, s_idx, got, d_idx)
        TorchEngine().copy_rows(rows, s_idx, want, d_idx)
        assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_and_scatter_through_a_pointer_table(engine, device):
    """One launch reads rows from three peers' regions (and writes rows into them)."""
    peers = [_x(5, 128, torch.bfloat16, seed=p).to(device) for p in range(3)]
    peer_n = torch.tensor([2, 0, 1, 2, 0], device=device)
    index_n = torch.tensor([4, 1, 0, 3, 0], device=device)
    got = torch.zeros(5, 128, dtype=torch.bfloat16, device=device)
    engine.gather_rows(peers, peer_n, index_n, got, None)
    want = torch.stack([peers[p][i] for p, i in zip(peer_n.tolist(), index_n.tolist(), strict=True)])
    assert_same(got, want)
    engine.gather_rows(peers[1:2], torch.zeros_like(peer_n), index_n, got, None)  # a table of one peer
    assert_same(got, peers[1][index_n])

    targets = [torch.zeros(5, 128, dtype=torch.bfloat16, device=device) for _ in range(3)]
    engine.scatter_rows(want, None, targets, peer_n, index_n)
    expected = [torch.zeros(5, 128, dtype=torch.bfloat16) for _ in range(3)]
    for i, (p, r) in enumerate(zip(peer_n.tolist(), index_n.tolist(), strict=True)):
        expected[p][r] = want[i].cpu()
    for t, e in zip(targets, expected, strict=True):
        assert_same(t, e)


# --- reductions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_accumulate_rows_is_the_torch_engines(engine, device, dtype, weighted):
    """Sums in row order per token, NaN and Inf rows included; untouched tokens keep their bits."""
    rows = _x(11, 200, dtype).to(device)
    token_n = torch.tensor([3, 0, 3, 1, 3, 0, 4, 4, 3, 1, 0], device=device)
    weight_n = torch.rand(11, generator=torch.Generator().manual_seed(1)).to(device) if weighted else None
    start = _x(6, 200, torch.float32, seed=2).to(device)
    got, want = start.clone(), start.clone()
    engine.accumulate_rows(got, rows, token_n, weight_n)
    TorchEngine().accumulate_rows(want, rows, token_n, weight_n)
    assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighted_sum_is_the_reference(engine, device, dtype):
    y_NKH = _x(5 * 3, 200, dtype).view(5, 3, 200)
    w_NK = torch.rand(5, 3, generator=torch.Generator().manual_seed(3))
    valid_NK = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 1, 0]], dtype=torch.bool)
    y_NKH[1, 0, :] = float("nan")  # an invalid slot's NaN must not leak
    got = engine.weighted_sum(y_NKH.to(device), w_NK.to(device), valid_NK.to(device))
    assert_same(got, reference.weighted_sum(y_NKH, w_NK, valid_NK))


# --- routing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_localize_rows(engine, device):
    """This rank owns experts 2, 3 (local 0, 1): [3, 0, -1] -> [1, -1, -1], weight kept where local."""
    topk_XK = torch.tensor([[3, 0, -1], [2, 5, 1], [7, 3, 2], [-1, -1, -1]], device=device)
    weights_XK = torch.rand(4, 3, generator=torch.Generator().manual_seed(4)).to(device)
    local_of_expert_E = torch.tensor([-1, -1, 0, 1, -1, -1, -1, -1], device=device)
    rows_n = torch.tensor([2, 0, 3, 1], device=device)
    out_idx = torch.empty(4, 3, dtype=torch.int64, device=device)
    out_w = torch.empty(4, 3, device=device)
    engine.localize_rows(topk_XK, weights_XK, rows_n, local_of_expert_E, out_idx, out_w)
    want_idx = torch.tensor([[-1, 1, 0], [1, -1, -1], [-1, -1, -1], [0, -1, -1]])
    assert torch.equal(out_idx.cpu(), want_idx)
    assert_same(out_w, torch.where(want_idx >= 0, weights_XK.cpu()[rows_n.cpu()], 0.0))


# --- FP8 while moving ---------------------------------------------------------------------------------------


def _rounding_sweep() -> torch.Tensor:
    """Rows whose blocks all hold 448 (scale 1), so values are rounded as given: every e4m3 code, every
    midpoint between neighbours (the ties), points just off them, and the subnormal range."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    off = (mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)))
    tiny = (torch.linspace(-(2.0**-6), 2.0**-6, 301), torch.tensor([2.0**-10, -(2.0**-10), 3e-40]))
    values = torch.cat([finite, mids, *off, *tiny])
    per_row = 127
    rows = -(-values.numel() // per_row)
    x = torch.zeros(rows, per_row)
    x.view(-1)[: values.numel()] = values
    return torch.cat([torch.full((rows, 1), 448.0), x], dim=1)  # [rows, 128]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_is_fp8_quantize(engine, device, dtype):
    """Into a wire row (values, then scales) at an index, from a source row at another: move and cast."""
    x = torch.cat([_x(4, 256, torch.float32), _rounding_sweep().repeat(1, 2)[:, :256]]).to(dtype)
    x[1, 128:] = 0  # an all-zero block: scale 0, values 0
    x[2, :128] = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 1e-30  # tiny scale
    n = x.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    wire = torch.zeros(n, fp8.row_bytes(256), dtype=torch.uint8, device=device)
    values, scales = wire[:, :256].view(fp8.VALUE_DTYPE), wire[:, 256:].view(torch.float32)
    engine.quantize_rows(x.to(device), order.to(device), values, scales, torch.arange(n, device=device))
    want_values, want_scales = fp8.quantize(x[order])
    assert_same(values.contiguous().view(torch.uint8), want_values.view(torch.uint8))
    assert_same(scales.contiguous(), want_scales)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_rows_is_fp8_dequantize(engine, device, dtype):
    """Every e4m3 code (NaN included) times scales from tiny to Inf, into rows picked by index."""
    codes = torch.arange(512, dtype=torch.int64).remainder(256).to(torch.uint8).view(4, 128)
    codes = torch.cat([codes, codes.flip(1)], dim=1)  # two blocks per row
    values = codes.view(fp8.VALUE_DTYPE)
    scales = torch.tensor([[1.0], [3e-38], [0.0], [float("inf")]]).expand(4, 1).contiguous()
    scales = torch.cat([scales, scales.flip(0) * 7.5], dim=1)
    out = torch.zeros(4, 256, dtype=dtype, device=device)
    dst = torch.tensor([2, 0, 3, 1], device=device)
    engine.dequantize_rows(values.to(device), scales.to(device), None, out, dst)
    want = torch.zeros(4, 256, dtype=dtype)
    want[dst.cpu()] = fp8.dequantize(values, scales, dtype)
    assert_same(out, want)


# --- flags and the two data-as-flag variants, one process ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_flags_land_only_at_their_epoch_and_waits_time_out(engine, device):
    flags = torch.zeros(3, dtype=torch.int64, device=device)
    engine.write_flags(flags[1:2], 7)
    assert engine.wait_flags(flags, 7, SPINS).tolist() == [False, True, False]
    assert engine.wait_flags(flags[1:2], 8, SPINS).tolist() == [False]  # a stale epoch is not this call's

    rows = _x(6, 160, torch.bfloat16).to(device)
    arrivals = torch.zeros(1, dtype=torch.int64, device=device)
    for epoch in (1, 2):
        landed = torch.zeros(4, 160, dtype=torch.bfloat16, device=device)
        src_index = torch.tensor([5, 0, 2, 2], device=device) + (epoch - 1) % 2
        engine.put_rows_flag(rows, src_index.clamp(max=5), landed, None, flags[0:1], arrivals, epoch)
        assert engine.wait_flags(flags[0:1], epoch, SPINS).tolist() == [True]
        assert arrivals.item() == 0  # the last program reset the counter for the next message
        assert_same(landed, rows[src_index.clamp(max=5)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_epoch_words_carry_rows_and_report_what_did_not_land(engine, device, dtype):
    rows = _x(5, 128, dtype).to(device)
    width = 128 * rows.element_size() // 4
    words = torch.zeros(5, width, dtype=torch.int64, device=device)
    engine.pack_put(rows, None, words, torch.tensor([4, 3, 2, 1, 0], device=device), 3)
    got = torch.zeros_like(rows)
    assert (
        engine.unpack_wait(words, torch.tensor([4, 3, 2, 1, 0], device=device), got, None, 3, SPINS).item()
        == 0
    )
    assert_same(got, rows)

    engine.pack_put(rows[:2], None, words, None, 4)  # rows 0 and 1 of epoch 4; rows 2..4 still hold epoch 3
    got = torch.zeros_like(rows)
    missing = engine.unpack_wait(words, None, got, None, 4, SPINS)
    assert missing.item() == 3 * width
    assert_same(got[:2], rows[:2])
    assert (
        not got[2:].view(torch.int16 if dtype == torch.bfloat16 else torch.int32).any()
    )  # stale rows untouched


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_devices_and_epochs_are_refused(engine, device):
    other = "cuda" if device == "cpu" else "cpu"
    if other == "cuda" and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="epoch"):
            engine.pack_put(torch.zeros(1, 4), None, torch.zeros(1, 4, dtype=torch.int64), None, 2**32)
        return
    with pytest.raises(ValueError, match="tensors"):
        engine.copy_rows(torch.zeros(2, 4, device=other), None, torch.zeros(2, 4, device=other), None)


# --- virtual ranks: R ranks' memory in one allocation, one process ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_virtual_ranks_dispatch_and_combine_equal_the_reference(engine, device, num_ranks, payload):
    """Every receiver gathers its rows from all ranks' regions (one pointer-table launch), localizes the
    routing; every home rank gathers expert outputs back and sums them per token in rank order."""
    T, H, E, K = 6, 256, 4 * num_ranks, 3
    g = torch.Generator().manual_seed(num_ranks)
    x_RTH = torch.randn(num_ranks, T, H, generator=g).to(torch.bfloat16).to(device)  # one allocation
    topk = [torch.rand(T, E, generator=g).topk(K).indices for _ in range(num_ranks)]
    topk[0][1, 2] = -1
    weights = [torch.rand(T, K, generator=g) for _ in range(num_ranks)]
    want = reference.dispatch([x.cpu() for x in x_RTH], topk, weights, E)
    if payload == "fp8":
        wire = torch.zeros(num_ranks, T, fp8.row_bytes(H), dtype=torch.uint8, device=device)
        for r in range(num_ranks):  # each sender quantizes into its own region
            engine.quantize_rows(x_RTH[r], None, wire[r, :, :H].view(fp8.VALUE_DTYPE), wire[r, :, H:].view(
                torch.float32), None)  # fmt: skip
        regions = list(wire)
    else:
        regions = list(x_RTH)
    L = E // num_ranks
    ys = []
    for dst in range(num_ranks):
        got = want[dst]
        recv = torch.zeros(got.src_rank_M.numel(), regions[0].shape[1], dtype=regions[0].dtype, device=device)
        engine.gather_rows(regions, got.src_rank_M.to(device), got.src_token_M.to(device), recv, None)
        if payload == "fp8":
            pair = fp8.quantize(got.recv_x_MH)
            assert_same(recv[:, :H].contiguous(), pair[0].view(torch.uint8))
            assert_same(recv[:, H:].contiguous().view(torch.float32), pair[1])
        else:
            assert_same(recv, got.recv_x_MH)
        local_of_expert = torch.full((E,), -1, dtype=torch.int64)
        local_of_expert[dst * L : (dst + 1) * L] = torch.arange(L)
        for src in range(num_ranks):
            mine = got.src_rank_M == src
            idx = torch.empty(int(mine.sum()), K, dtype=torch.int64, device=device)
            w = torch.empty(int(mine.sum()), K, device=device)
            rows_n = got.src_token_M[mine].to(device)
            local_E = local_of_expert.to(device)
            engine.localize_rows(topk[src].to(device), weights[src].to(device), rows_n, local_E, idx, w)
            assert torch.equal(idx.cpu(), got.recv_topk_idx_MK[mine])
            assert_same(w, got.recv_topk_weights_MK[mine])
        ys.append((got.recv_x_MH.float() * (dst + 1.5)).to(torch.bfloat16).to(device))
    for home, out in enumerate(reference.combine([y.cpu() for y in ys], want, [T] * num_ranks)):
        acc = torch.zeros(T, H, device=device)
        for expert_rank in range(num_ranks):  # ascending rank: the reference's order
            back = want[expert_rank].src_rank_M == home
            rows = torch.zeros(int(back.sum()), H, dtype=torch.bfloat16, device=device)
            peer_n = torch.full((rows.shape[0],), expert_rank, device=device)
            engine.gather_rows(ys, peer_n, torch.nonzero(back).flatten().to(device), rows, None)
            engine.accumulate_rows(acc, rows, want[expert_rank].src_token_M[back].to(device))
        assert_same(acc.to(torch.bfloat16), out)


# --- across processes over a shared mapping -----------------------------------------------------------------

PEER = textwrap.dedent(
    """
    import sys, time
    import torch
    from ubep.engine.triton_engine import TritonEngine

    role, variant, path = sys.argv[1:4]
    R, H, EPOCH = 6, 128, 5
    mem = torch.from_file(path, shared=True, size=64 + R * H * 4, dtype=torch.uint8)
    flag, arrivals, ready = (mem[i : i + 8].view(torch.int64) for i in (0, 8, 16))
    region = mem[64:].view(R, H * 4)  # bf16 rows [R, H] (flag variant) or epoch words [R, H // 2]
    bf16_rows = region[:, : 2 * H].view(torch.bfloat16)
    rows = torch.randn(R, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    rows[1, 3] = float("nan")
    engine = TritonEngine()
    deadline = time.monotonic() + 60
    if role == "writer":
        while ready.item() != 1:  # the reader polls before anything is written
            assert time.monotonic() < deadline, "reader never got ready"
            time.sleep(0.01)
        time.sleep(0.2)
        if variant == "flag":
            engine.put_rows_flag(rows, None, bf16_rows, None, flag, arrivals, EPOCH)
        else:
            engine.pack_put(rows, None, region.view(torch.int64), None, EPOCH)
        print("WROTE")
    else:
        got = torch.zeros_like(rows)
        polls = 0
        ready.fill_(1)
        while True:
            polls += 1
            if variant == "flag":
                if engine.wait_flags(flag, EPOCH, 20).item():
                    engine.copy_rows(bf16_rows, None, got, None)
                    break
            elif engine.unpack_wait(region.view(torch.int64), None, got, None, EPOCH, 20).item() == 0:
                break
            assert time.monotonic() < deadline, "nothing landed in 60 s"
        same = torch.equal(got.view(torch.int16), rows.view(torch.int16))
        print("READ", "same" if same else "DIFFERENT", "polls", polls)
    """
)


@pytest.mark.parametrize("variant", ["flag", "words"])
def test_two_processes_over_a_shared_mapping(variant, tmp_path):
    """A reader process polls (bounded waits, retried to a deadline) while a writer process, started
    after the reader is polling, puts rows: flag after data, or epoch-stamped words."""
    if not INTERPRETED:
        pytest.skip("runs in test_interpreter_suite")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(shm, f"triton-flag-test-{os.getpid()}-{variant}")
    with open(path, "wb") as f:
        f.write(bytes(64 + 6 * 128 * 4))
    env = interpreter_env()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", PEER, role, variant, path],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for role in ("reader", "writer")
        ]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=90))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"{variant}: a peer process hung past 90 s")
        assert all(p.returncode == 0 for p in procs), outs
        reader = outs[0][0]
        assert "READ same" in reader, outs
        assert int(reader.split("polls")[1]) > 1, f"the reader never waited: {reader}"
    finally:
        os.unlink(path)


# --- on the device: a reader kernel waits while a writer kernel runs on another stream ----------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("variant", ["flag", "words"])
def test_concurrent_streams_on_the_device(engine, variant):
    """Epoch 1 runs in order (every kernel compiled and loaded: loading a module while a kernel spins
    could wait for it); epoch 2's reader is launched first and must spin until the writer's data lands."""
    rows = _x(64, 7168, torch.bfloat16).cuda()
    reader, writer = torch.cuda.Stream(), torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    arrivals = torch.zeros(1, dtype=torch.int64, device="cuda")
    region = torch.zeros(64, 7168 // 2, dtype=torch.int64, device="cuda")
    slot = region.view(torch.bfloat16)[:, :7168]  # the flag variant's rows

    def write(epoch: int) -> None:
        if variant == "flag":
            engine.put_rows_flag(rows, None, slot, None, flag, arrivals, epoch)
        else:
            engine.pack_put(rows, None, region, None, epoch)

    def read(epoch: int, got: torch.Tensor) -> torch.Tensor:
        if variant == "flag":
            landed = engine.wait_flags(flag, epoch, 10**7)
            engine.copy_rows(slot, None, got, None)
            return landed.logical_not().int()
        return engine.unpack_wait(region, None, got, None, epoch, 10**7)

    for epoch in (1, 2):
        got = torch.zeros_like(rows)
        torch.cuda.synchronize()
        if epoch == 1:
            write(epoch)
            missing = read(epoch, got)
        else:
            with torch.cuda.stream(reader):
                missing = read(epoch, got)
            with torch.cuda.stream(writer):
                torch.cuda._sleep(10**6)
                write(epoch)
        torch.cuda.synchronize()
        assert int(missing.sum()) == 0, f"epoch {epoch}: the reader timed out"
        assert_same(got, rows)


# --- the protocols with engine="triton": every call of a Buffer goes through these kernels ------------------

NORMAL = ("minus-one-and-nowhere", "zipf-float32")  # bf16 with -1 slots and a rank nobody sends to; fp32
LOW_LATENCY = ("fp8", "float32")


def buffer_calls(rank: object) -> int:
    """A few normal-mode scenarios and low-latency cases (bf16, fp32, FP8) on engine="triton", each
    checked against ubep.reference by the same helpers as every other transport's tests."""
    from scenarios import scenarios_for
    from test_exchange import check_scenario
    from test_low_latency import CAPACITY, HIDDEN, cases, run_case

    import ubep

    virtual = not isinstance(rank, int)  # a VirtualRank, or a placeholder under LocalLaunch
    group = rank if virtual else None
    me = rank.rank if virtual else torch.distributed.get_rank()
    R = rank.world_size if virtual else torch.distributed.get_world_size()
    checked = 0
    for sc in (s for s in scenarios_for(R) if s.name in NORMAL):
        with ubep.Buffer(group, hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity,
                         timeout_s=60, engine="triton") as buf:  # fmt: skip
            assert buf.engine.name == "triton"
            check_scenario(buf, sc, me)
            checked += 1
    E = 2 * R
    with ubep.Buffer(group, hidden=HIDDEN, num_experts=E, max_tokens_per_rank=CAPACITY, timeout_s=60,
                     engine="triton", low_latency=True) as buf:  # fmt: skip
        for case in (c for c in cases(R) if c.name in LOW_LATENCY):
            run_case(buf, case, me, R, E)
            checked += 1
    return checked


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_buffer_on_virtual_ranks_with_the_triton_engine(num_ranks):
    if not INTERPRETED:
        pytest.skip("runs in test_interpreter_suite")
    from ubep.transport.virtual import VirtualWorld

    assert VirtualWorld(num_ranks, timeout_s=120).run(buffer_calls) == [4] * num_ranks


def test_buffer_on_shared_memory_with_the_triton_engine():
    """Rank processes over the shared-memory heap (each inherits TRITON_INTERPRET=1)."""
    if not INTERPRETED:
        pytest.skip("runs in test_interpreter_suite")
    import ubep

    assert ubep.LocalLaunch(world_size=2, timeout_s=120).run(buffer_calls, 0) == [4, 4]

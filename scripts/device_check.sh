#!/usr/bin/env bash
# One prepared check on a machine with one NVIDIA GPU (written for an H200: 141 GB HBM3e, 4.8 TB/s),
# no network, python3 with torch (CUDA), triton and numba already installed. Installs nothing from
# outside: the project goes into a venv that sees the system's packages (pip --no-deps), or onto
# PYTHONPATH if that fails. Then: the CUDA subset of the tests (pytest -m cuda, plus the AOT test with
# this machine's triton), then the kernels' bandwidth on virtual ranks in one allocation (8 ranks,
# H 7168, 128 tokens per rank, top-8 of 256 experts, bf16) as a fraction of the memory bandwidth.
# Then low-latency mode's device halves (scripts/device_ll.py): one dispatch + combine of 8 virtual ranks
# under torch.cuda.set_sync_debug_mode("error"), the same captured in a CUDA graph and replayed 1,000
# times against the reference, and a per-half latency/bandwidth table; then the same for normal mode's
# UBEP device halves with num_worst_tokens (scripts/device_normal.py), last, in what is left of the budget.
# Every step's timeout is cut to what is left of an 8-minute budget.
#
#   bash scripts/device_check.sh            # from the repository root
#   PEAK_TBS=3.35 bash scripts/device_check.sh   # another GPU: its memory bandwidth in TB/s
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PEAK_TBS=${PEAK_TBS:-4.8}
VENV=$(mktemp -d)/venv
status=0
budget() {  # seconds for the next step: at most $1, and never past 470 s since the start
    local left=$((470 - SECONDS))
    if ((left < 5)); then echo 5; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}

echo "== machine"
timeout "$(budget 20)" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout "$(budget 60)" "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| triton', triton.__version__, '| device', torch.cuda.get_device_name(0))" || status=1

echo "== install (no network: --no-deps, no build isolation)"
if timeout "$(budget 60)" "$PY" -m venv --system-site-packages "$VENV" &&
   timeout "$(budget 90)" "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . ; then
    PY="$VENV/bin/python"
else
    echo "install failed: using PYTHONPATH=src"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== tests: the CUDA subset, and every kernel compiled ahead of time with this triton"
timeout "$(budget 200)" "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/device/test_triton_engine.py \
    tests/device/test_triton_cuda_heap.py || status=1
timeout "$(budget 90)" "$PY" -m pytest -q -p no:cacheprovider tests/device/test_triton_aot.py \
    tests/device/test_ll_device_aot.py tests/device/test_ubep_device_aot.py || status=1

echo "== kernel bandwidth: virtual ranks in one allocation (peak ${PEAK_TBS} TB/s)"
timeout "$(budget 100)" "$PY" - 8 128 7168 8 256 20 "$PEAK_TBS" <<'EOF' || status=1
"""Each kernel's bytes moved / median time, over R virtual ranks' memory in one device allocation.

dispatch: one launch gathers every receiver's rows from all ranks' regions (pointer table);
combine: one launch sums every token's returned rows in float32, weighted, in rank order;
and the low-latency sum, FP8 conversions, and both data-as-flag variants (flag after data; epoch words).
Results are checked against the torch engine before anything is timed.
"""
import statistics
import sys
import time

import torch

from ubep.engine.torch_engine import TorchEngine
from ubep.engine.triton_engine import TritonEngine

R, T, H, K, E, ITERS = (int(a) for a in sys.argv[1:7])
PEAK = float(sys.argv[7]) * 1e12
dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1
eng, ref = TritonEngine(), TorchEngine()
g = torch.Generator().manual_seed(0)
x_RTH = torch.randn(R, T, H, generator=g).to(torch.bfloat16).to(dev)  # every rank's tokens, one allocation
topk_RTK = torch.rand(R, T, E, generator=g).topk(K, dim=2).indices
owner_RTK = topk_RTK // (E // R)
to_rank_RTR = torch.zeros(R, T, R, dtype=torch.bool).scatter_(2, owner_RTK, True)
# receiver-major rows: for each receiver, (source rank, token) ascending, as ubep.reference orders them
dst_M, src_M, tok_M = (t.flatten() for t in torch.nonzero(to_rank_RTR.permute(2, 0, 1), as_tuple=True))
M = dst_M.numel()
src_M, tok_M = src_M.to(dev), tok_M.to(dev)
recv_MH = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
regions = list(x_RTH)


def timed(fn, nbytes, name):
    for _ in range(2):
        fn()
    times = []
    for _ in range(ITERS):
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    print(f"{name:<34} {nbytes / 1e6:9.1f} MB {s * 1e6:10.1f} us {nbytes / s / 1e9:9.1f} GB/s "
          f"{nbytes / s / PEAK:7.1%} of peak")


# correctness first: the same bits as the torch engine
eng.gather_rows(regions, src_M, tok_M, recv_MH, None)
assert torch.equal(recv_MH, x_RTH[src_M, tok_M]), "dispatch gather differs"
w_M = torch.rand(M, generator=g).to(dev)
token_M = src_M * T + tok_M  # the token's global row: combine back into each home rank's slice
order = torch.argsort(token_M * R + dst_M.to(dev), stable=True)  # per token, rows in expert-rank order
rows_MH, token_M, w_M = recv_MH[order].contiguous(), token_M[order].contiguous(), w_M[order].contiguous()
acc, acc_ref = torch.zeros(R * T, H, device=dev), torch.zeros(R * T, H, device=dev)
eng.accumulate_rows(acc, rows_MH, token_M, w_M)
ref.accumulate_rows(acc_ref, rows_MH, token_M, w_M)
assert torch.equal(acc, acc_ref), "combine sum differs"
print(f"R={R} T={T} H={H} top-{K} of {E}: {M} rows dispatched ({M / (R * T):.2f} ranks per token); "
      f"checked against the torch engine")

row = H * 2
timed(lambda: eng.gather_rows(regions, src_M, tok_M, recv_MH, None), 2 * M * row,
      "dispatch gather (copy_rows)")
timed(lambda: eng.accumulate_rows(acc, rows_MH, token_M, w_M), M * row + 2 * R * T * H * 4,
      "combine sum (accumulate_rows)")
y_NKH = torch.randn(R * T, K, H, generator=g).to(torch.bfloat16).to(dev)
w_NK, valid_NK = torch.rand(R * T, K, generator=g).to(dev), (torch.rand(R * T, K, generator=g) > 0.1).to(dev)
assert torch.equal(eng.weighted_sum(y_NKH, w_NK, valid_NK), ref.weighted_sum(y_NKH, w_NK, valid_NK))
timed(lambda: eng.weighted_sum(y_NKH, w_NK, valid_NK), y_NKH.numel() * 2 + R * T * H * 4,
      "low-latency sum (weighted_sum)")
x_NH = x_RTH.view(R * T, H)
values = torch.empty(R * T, H, dtype=torch.float8_e4m3fn, device=dev)
scales = torch.empty(R * T, H // 128, device=dev)
timed(lambda: eng.quantize_rows(x_NH, None, values, scales, None), R * T * (2 * H + H + H // 32),
      "FP8 quantize (quantize_rows)")
out = torch.empty(R * T, H, dtype=torch.bfloat16, device=dev)
timed(lambda: eng.dequantize_rows(values, scales, None, out, None), R * T * (H + H // 32 + 2 * H),
      "FP8 dequantize (dequantize_rows)")
flag, arrivals = torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
epoch = iter(range(1, 10**6))
timed(lambda: eng.put_rows_flag(x_NH, None, out, None, flag, arrivals, next(epoch)), 2 * R * T * row,
      "flag after data (put_rows_flag)")
words = torch.zeros(R * T, H // 2, dtype=torch.int64, device=dev)
timed(lambda: eng.pack_put(x_NH, None, words, None, next(epoch)), R * T * (row + 2 * row),
      "epoch words, send (pack_put)")
last = next(epoch)
eng.pack_put(x_NH, None, words, None, last)
timed(lambda: eng.unpack_wait(words, None, out, None, last, 1000), R * T * (2 * row + row),
      "epoch words, receive (unpack_wait)")
assert torch.equal(out, x_NH), "epoch words round trip differs"

# the two variants head to head on a decode-sized message (one token per rank), on one stream: the
# kernels' own cost per message (launches included), not the cross-GPU latency
msg, got = x_NH[:R].contiguous(), torch.empty(R, H, dtype=torch.bfloat16, device=dev)
slot = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
msg_words = torch.zeros(R, H // 2, dtype=torch.int64, device=dev)


def flag_after_data():
    e = next(epoch)
    eng.put_rows_flag(msg, None, slot, None, flag, arrivals, e)
    eng.wait_flags(flag, e, 1000)
    eng.copy_rows(slot, None, got, None)


def epoch_words():
    e = next(epoch)
    eng.pack_put(msg, None, msg_words, None, e)
    eng.unpack_wait(msg_words, None, got, None, e, 1000)


timed(flag_after_data, 4 * R * row, "decode message: flag after data")
timed(epoch_words, 6 * R * row, "decode message: epoch words")
assert torch.equal(got, msg), "decode message differs"
print("bytes: every read and write the kernel makes once; peak is the device's memory bandwidth")
EOF

echo "== low-latency device halves: 8 virtual ranks, no host sync, CUDA graph x1000, per-half table"
timeout "$(budget 150)" "$PY" scripts/device_ll.py --peak-tbs "$PEAK_TBS" --replays 1000 || status=1

echo "== normal-mode device halves: 8 virtual ranks, num_worst_tokens, no host sync, CUDA graph x1000, table"
timeout "$(budget 120)" "$PY" scripts/device_normal.py --peak-tbs "$PEAK_TBS" --replays 1000 || status=1

echo "== device_check: $([ $status = 0 ] && echo PASSED || echo FAILED) in ${SECONDS} s"
exit $status

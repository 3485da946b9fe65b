"""The synchronization variants' message patterns, on one piece where every time has a closed form.

Fabric: nvl72 (one switch hop of 1.0 us, 900 GB/s ports, 1500 GB/s local copy), no
per-message overhead and no window limit, so a lone message of b bytes lands at
1.0 + b / 900e3 us. One piece of two 4,800 B rows goes from rank 0 to rank 1.
"""

import numpy as np
import pytest

from ubep import topology
from ubep.costmodel import CostParams
from ubep.sim import engine, sync

TOPO = topology.nvl72()
PARAMS = CostParams(msg_overhead_us=0.0, link_efficiency=1.0, window_bytes=1e12, poll_us=0.05, flag_bytes=64)
ROW, ROWS = 4800, 2
B, LAT, LOCAL = 900e3, 1.0, 1500e3  # port and local copy rates in bytes per us


def _one_piece() -> engine.Messages:
    one = np.zeros(1, dtype=np.int64)
    return engine.Messages(src_Z=one, dst_Z=one + 1, worker_Z=one, seq_Z=np.zeros(1),
                           bytes_Z=np.array([ROW * ROWS]), ready_Z=np.zeros(1))  # fmt: skip


def _usable(variant: str, capacity_rows: int = 4) -> sync.Delivery:
    none = engine.Messages(src_Z=np.zeros(0, dtype=np.int64), dst_Z=np.zeros(0, dtype=np.int64),
                           worker_Z=np.zeros(0, dtype=np.int64), seq_Z=np.zeros(0),
                           bytes_Z=np.zeros(0, dtype=np.int64), ready_Z=np.zeros(0))  # fmt: skip
    return sync.deliver(variant, _one_piece(), none, TOPO, PARAMS, workers=1, num_ranks=2,
                        row_bytes=ROW, capacity_rows=capacity_rows)  # fmt: skip


def test_tff_pays_a_32_byte_flag_in_every_512_byte_write():
    d = _usable("tff")
    wire = 20 * 512  # 9,600 B of payload in 480 B slices: 20 writes of 512 B
    assert sync.wire_bytes("tff", np.array([9600])).tolist() == [wire]
    assert d.usable_RR[0, 1] == pytest.approx(LAT + wire / B + 0.05, rel=1e-9)
    assert d.reorder_factor == pytest.approx(512 / 480)


def test_dc_sends_one_checksum_after_the_senders_pass_and_the_receiver_validates():
    d = _usable("dc")
    issued = ROW * ROWS / B + ROW * ROWS / LOCAL  # payload, then the checksum pass over it
    assert d.usable_RR[0, 1] == pytest.approx(issued + LAT + 64 / B + 0.05, rel=1e-9)
    assert d.reorder_factor == 2.0  # validation read, then the reorder copy


def test_sp_data_lands_only_once_the_receiver_armed_its_sentinels():
    assert _usable("sp").usable_RR[0, 1] == pytest.approx(LAT + ROW * ROWS / B + 0.05, rel=1e-9)
    armed = 100_000 * 64 / LOCAL  # 100k receive slots, one 64 B sentinel line each: 4.27 us > LAT
    late = _usable("sp", capacity_rows=100_000)
    assert late.usable_RR[0, 1] == pytest.approx(armed + ROW * ROWS / B + 0.05, rel=1e-9)
    assert late.reorder_factor == 1.0


def test_stop_and_wait_pays_a_round_trip_and_a_flag_per_row():
    d = _usable("stop-and-wait")
    flag_sent = ROW * ROWS / B + ROWS * 2 * LAT + ROWS * 64 / B  # data, two fences, two flags
    assert d.usable_RR[0, 1] == pytest.approx(flag_sent + LAT + 0.05, rel=1e-9)


def test_an_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match="sync must be one of"):
        _usable("flags")

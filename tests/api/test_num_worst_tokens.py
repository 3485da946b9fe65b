"""`Buffer.dispatch(num_worst_tokens=W)` (issue 20): every output W rows, the received rows first and
then padding (recv_x 0, recv_topk_idx -1, weights 0), an empty per-expert list, a combine that takes
the padded rows back, a cached dispatch padded as its handle, and a ValueError on a rank that receives
more than W. Compared with `ubep.reference` on both protocols and engines; the Triton halves run the
same through tests/device/test_ubep_device.py's interpreter suite."""

from __future__ import annotations

import pytest
import torch
from scenarios import Scenario, expert_output

import ubep
from ubep import reference
from ubep.transport.virtual import VirtualWorld

SC = Scenario(name="worst", num_ranks=3, num_experts=12, hidden=32, topk=3, capacity=6, drop=0.2, seed=7)


def _padded(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:]).fill_(value)])


def _step(rank, protocol: str, engine: str, worst: int) -> None:
    me = rank.rank
    xs, idxs, ws = SC.inputs()
    want = reference.dispatch(xs, idxs, ws, SC.num_experts)
    ys = [expert_output(d.recv_x_MH, r) for r, d in enumerate(want)]
    combined = reference.combine(ys, want, [x.shape[0] for x in xs])[me]
    with ubep.Buffer(rank, hidden=SC.hidden, num_experts=SC.num_experts, max_tokens_per_rank=SC.capacity,
                     protocol=protocol, engine=engine, timeout_s=20) as buf:  # fmt: skip
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me], num_worst_tokens=worst)
        mine = want[me]
        assert torch.equal(got.recv_x, _padded(mine.recv_x_MH, worst, 0))
        assert torch.equal(got.recv_topk_idx, _padded(mine.recv_topk_idx_MK, worst, -1))
        assert torch.equal(got.recv_topk_weights, _padded(mine.recv_topk_weights_MK, worst, 0))
        assert got.num_recv_tokens_per_expert_list == []
        y = _padded(ys[me], worst, 0)  # the experts' output for the padded rows, padding included
        out = buf.combine(y, got.handle)
        assert torch.equal(out.combined_x, combined)
        again = buf.dispatch(xs[me] * 2, handle=got.handle)  # cached: padded as its handle was
        twice = reference.dispatch([x * 2 for x in xs], idxs, ws, SC.num_experts)[me]
        assert torch.equal(again.recv_x, _padded(twice.recv_x_MH, worst, 0))
        most = max(d.recv_x_MH.shape[0] for d in want)
        mine_rows = mine.recv_x_MH.shape[0]
        try:  # too few rows for the rank that receives most: it raises, naming the count
            buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me], num_worst_tokens=most - 1)
        except ValueError as error:
            assert (
                mine_rows == most
                and f"receives {most} rows, more than num_worst_tokens={most - 1}" in str(error)
            )
        except ubep.UbepError:
            assert mine_rows < most  # a peer rejected the call: this rank learns it in the call or later
        else:
            assert mine_rows < most


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "numba"])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
def test_num_worst_tokens_pads_every_output_and_combine_takes_them_back(protocol, engine):
    if engine == "numba":
        pytest.importorskip("numba")
    worst = SC.num_ranks * SC.capacity
    VirtualWorld(SC.num_ranks, timeout_s=100).run(lambda rank: _step(rank, protocol, engine, worst))


def test_num_worst_tokens_must_be_a_non_negative_int():
    def step(rank) -> None:
        with ubep.Buffer(rank, hidden=8, num_experts=2, max_tokens_per_rank=4, timeout_s=5) as buf:
            x, idx, w = torch.ones(2, 8), torch.tensor([[0], [1]]), torch.ones(2, 1)
            for bad, kind in ((-1, ValueError), (2.5, TypeError), (True, TypeError)):
                with pytest.raises(kind, match="num_worst_tokens"):
                    buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=bad)

    VirtualWorld(1, timeout_s=30).run(step)

"""Issue 45, item 17: messages that named the wrong thing, and size hints that took any number.

- FP8 at a hidden size that is no multiple of 128 said "must have shape (4, 1), got (4, 1)";
- ElasticBuffer's size hints answered zero and negative sizes with a size;
- a peer's call of another kind was named by its wire code ("call #2 (2)").
(The fourth, NIXL naming a peer that closed its Buffer, is in test_fabric_nixl.py.)
"""

from __future__ import annotations

import pytest
import torch

import ubep
from ubep import fp8
from ubep.across.fabric.base import is_this_call
from ubep.calls import KINDS, CallId
from ubep.compat.deep_ep.elastic import ElasticBuffer


def test_fp8_at_a_hidden_size_off_the_block_names_the_hidden_size():
    H = fp8.BLOCK + 2  # 130: one scale column either way, so the shapes agree
    with ubep.Buffer(hidden=H, num_experts=4, max_tokens_per_rank=8) as buf:  # a group of one
        values = torch.zeros(4, H, dtype=fp8.VALUE_DTYPE)
        scales = torch.ones(4, H // fp8.BLOCK, dtype=fp8.SCALE_DTYPE)
        idx = torch.tensor([[0], [1], [2], [3]], dtype=torch.int64)
        with pytest.raises(ValueError) as caught:
            buf.dispatch((values, scales), topk_idx=idx, topk_weights=torch.ones(4, 1))
    said = str(caught.value)
    assert said == f"x[0] has hidden size {H}: FP8 needs a multiple of 128 (one scale per 128 channels)", said


HINTS = [  # (hint, good arguments, the argument a bad value goes to)
    (lambda **a: ElasticBuffer.get_buffer_size_hint(None, **a), dict(num_max_tokens_per_rank=8, hidden=16),
     "num_max_tokens_per_rank"),
    (lambda **a: ElasticBuffer.get_buffer_size_hint(None, **a), dict(num_max_tokens_per_rank=8, hidden=16),
     "hidden"),
    (ElasticBuffer.get_engram_storage_size_hint, dict(num_entries=10, hidden=16, num_max_tokens_per_rank=8),
     "num_entries"),
    (ElasticBuffer.get_engram_storage_size_hint, dict(num_entries=10, hidden=16, num_max_tokens_per_rank=8),
     "num_max_tokens_per_rank"),
    (ElasticBuffer.get_pp_buffer_size_hint, dict(num_max_tensor_bytes=1000, num_max_inflight_tensors=3),
     "num_max_tensor_bytes"),
    (ElasticBuffer.get_pp_buffer_size_hint, dict(num_max_tensor_bytes=1000, num_max_inflight_tensors=3),
     "num_max_inflight_tensors"),
    (lambda **a: ElasticBuffer.get_agrs_buffer_size_hint(None, **a), dict(num_max_session_bytes=96),
     "num_max_session_bytes"),
]  # fmt: skip


@pytest.mark.parametrize("bad", [0, -1])
@pytest.mark.parametrize("hint,good,name", HINTS, ids=[f"{i}-{h[2]}" for i, h in enumerate(HINTS)])
def test_elastic_size_hints_refuse_sizes_below_one(hint, good, name, bad):
    sized = hint(**good)  # the good arguments are sized (engram: GPU and CPU bytes)
    assert min(sized if isinstance(sized, tuple) else (sized,)) > 0
    with pytest.raises(ValueError, match=rf"^{name} must be >= 1, got {bad}$"):
        hint(**{**good, name: bad})


def test_elastic_size_hints_refuse_a_negative_dimension_and_too_many_topk():
    with pytest.raises(ValueError, match=r"shapes \(dimension 1\) must be >= 0, got -5"):
        ElasticBuffer.get_agrs_num_max_session_bytes(None, (3, -5), torch.float32)
    with pytest.raises(ValueError, match=r"num_topk must be >= 0, got -1"):
        ElasticBuffer.get_buffer_size_hint(None, 8, 16, num_topk=-1)


def test_a_peer_in_a_call_of_another_kind_is_named_by_the_method():
    call = CallId(seq=3, epoch=2, kind="ll_dispatch")
    with pytest.raises(ubep.PeerDataError) as caught:
        is_this_call("dispatch", call, peer=1, seq=4, kind=KINDS["combine"], notice=lambda peer: None)
    assert str(caught.value) == (
        "dispatch: rank 1 sent a message of call #4 (combine), this rank is in call #3 "
        "(low_latency_dispatch): the ranks' calls are out of step"
    )

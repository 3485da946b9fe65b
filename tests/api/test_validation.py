"""Every input rule at the public boundary: the right exception type, and a message
that names the argument and the rule. Checked on a one-rank Buffer (the checks run
before any transport is involved); that a rejecting rank stops its peers is in
test_faults.py."""

from __future__ import annotations

import pytest
import torch

import ubep
from ubep.faults import FaultPlan

H, E, T, K = 16, 8, 6, 2


@pytest.fixture
def buf():
    with ubep.Buffer(hidden=H, num_experts=E, max_tokens_per_rank=T, max_topk=4) as b:
        yield b


def good(n: int = 4):
    idx = torch.tensor([[0, 1], [2, -1], [-1, -1], [7, 3]], dtype=torch.int64)[:n]
    return torch.randn(n, H), idx, torch.rand(n, K)


def dispatch_with(buf, **change):
    x, idx, w = good()
    args = dict(x=x, topk_idx=idx, topk_weights=w) | change
    return buf.dispatch(args.pop("x"), **args)


DISPATCH_RULES = [
    # (argument override, exception, words the message must contain)
    (dict(x=[[0.0] * H]), TypeError, ["x must be a torch.Tensor"]),
    (dict(x=torch.zeros(4, H, dtype=torch.int32)), TypeError, ["x must be bfloat16 or float32", "int32"]),
    (dict(x=torch.zeros(4, H, 1)), ValueError, ["x must have 2 dimensions"]),
    (dict(x=torch.zeros(4, H + 1)), ValueError, ["x has hidden size 17", "built for 16"]),
    (dict(x=torch.zeros(4, H, device="meta")), ValueError, ["x is on meta", "tensors live on cpu"]),
    (dict(topk_idx=None), ValueError, ["dispatch needs topk_idx and topk_weights"]),
    (dict(topk_idx=torch.zeros(4, K, dtype=torch.int16)), TypeError, ["topk_idx must be int64 or int32"]),
    (dict(topk_idx=torch.zeros(3, K, dtype=torch.int64)), ValueError, ["topk_idx has 3 rows", "4 tokens"]),
    (dict(topk_idx=torch.zeros(4, 5, dtype=torch.int64)), ValueError, ["top-k 5", "max_topk=4"]),
    (dict(topk_idx=torch.full((4, K), E)), ValueError, ["topk_idx values must lie in [-1, 8)", "found 8"]),
    (dict(topk_idx=torch.full((4, K), -2)), ValueError, ["topk_idx values must lie in [-1, 8)", "found -2"]),
    (
        dict(topk_idx=torch.tensor([[0, 1], [5, 5], [1, 2], [3, 4]])),
        ValueError,
        ["topk_idx row 1 lists the same expert twice", "[5, 5]"],
    ),
    (dict(topk_weights=torch.rand(4, K).double()), TypeError, ["topk_weights must be float32"]),
    (dict(topk_weights=torch.rand(4, K + 1)), ValueError, ["topk_weights has shape (4, 3)", "(4, 2)"]),
    (dict(expert_alignment=0), ValueError, ["expert_alignment must be >= 1"]),
    (dict(handle="not a handle"), TypeError, ["handle must come from Buffer.dispatch", "str"]),
    (
        dict(is_token_in_rank=torch.zeros(4, 1, dtype=torch.bool)),
        ValueError,
        ["is_token_in_rank does not match topk_idx"],
    ),
    (
        dict(num_tokens_per_rank=torch.tensor([0], dtype=torch.int32)),
        ValueError,
        ["num_tokens_per_rank does not match topk_idx"],
    ),
]


@pytest.mark.parametrize("change,error,words", DISPATCH_RULES, ids=lambda v: None)
def test_dispatch_rule(buf, change, error, words):
    with pytest.raises(error) as info:
        dispatch_with(buf, **change)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_minus_one_and_no_expert_rows_are_allowed(buf):
    got = dispatch_with(buf)  # the good input has -1 entries and a row routed nowhere
    assert got.recv_x.shape == (3, H)


def test_token_count_against_capacity(buf):
    x = torch.zeros(T + 1, H)
    idx = torch.zeros(T + 1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x has 7 tokens, more than max_tokens_per_rank=6"):
        buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(T + 1, 1))


def test_combine_rules(buf):
    got = dispatch_with(buf)
    M = got.recv_x.shape[0]
    with pytest.raises(ValueError, match=r"x has 2 rows, expected 3"):
        buf.combine(torch.zeros(2, H), got.handle)
    with pytest.raises(ValueError, match=r"x has hidden size 15, the Buffer was built for 16"):
        buf.combine(torch.zeros(M, H - 1), got.handle)
    with pytest.raises(TypeError, match=r"x must be bfloat16 or float32, got float64"):
        buf.combine(torch.zeros(M, H, dtype=torch.float64), got.handle)
    with pytest.raises(TypeError, match=r"handle must come from Buffer.dispatch, got tuple"):
        buf.combine(got.recv_x, tuple(got.handle.recv_prefix_R1))
    with pytest.raises(ValueError, match=r"topk_weights has shape \(2, 2\), expected \(3, 2\)"):
        buf.combine(got.recv_x, got.handle, topk_weights=torch.zeros(2, K))
    with pytest.raises(ValueError, match=r"x has 3 rows, expected 4"):  # cached dispatch: rows of the handle
        buf.dispatch(torch.zeros(3, H), handle=got.handle)
    assert buf.combine(got.recv_x, got.handle).combined_x.shape == (4, H)  # the good call still works


def test_layout_rules(buf):
    _, idx, _ = good()
    with pytest.raises(ValueError, match=r"num_experts is 16, the Buffer was built for 8"):
        buf.get_dispatch_layout(idx, 16)
    with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 8\)"):
        buf.get_dispatch_layout(idx + 8, E)


CONSTRUCTOR_RULES = [
    (dict(hidden=0), ValueError, "hidden must be >= 1"),
    (dict(hidden=16.0), TypeError, "hidden must be an int"),
    (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
    (dict(num_experts=2**40), ValueError, "num_experts=1099511627776 is too large: the per-expert tables"),
    (dict(max_tokens_per_rank=-1), ValueError, "max_tokens_per_rank must be >= 1"),
    (dict(max_topk=0), ValueError, "max_topk must be >= 1"),
    (dict(protocol="nccl"), ValueError, "protocol must be one of"),
    (dict(transport="rdma"), ValueError, "transport must be one of"),
    (dict(timeout_s=0), ValueError, "timeout_s must be > 0"),
    (dict(timeout_s=float("inf")), ValueError, r"timeout_s must be > 0 and at most 604800 s \(a week\)"),
    (dict(timeout_s=1e300), ValueError, "timeout_s must be > 0 and at most 604800 s"),
    (dict(timeout_s=float("nan")), ValueError, "timeout_s must be > 0 and at most 604800 s"),
    (dict(timeout_s="5"), TypeError, "timeout_s must be a number of seconds, got str"),
    (dict(expert_placement=[0] * 4), ValueError, "expert_placement lists 4 experts, num_experts is 8"),
]


@pytest.mark.parametrize("change,error,words", CONSTRUCTOR_RULES, ids=lambda v: None)
def test_constructor_rule(change, error, words):
    args = dict(hidden=H, num_experts=E, max_tokens_per_rank=T) | change
    with pytest.raises(error, match=words):
        ubep.Buffer(**args)


def test_a_size_hint_refuses_too_many_experts_before_allocating():
    with pytest.raises(ValueError, match="num_experts=1099511627776 is too large"):
        ubep.Buffer.size_hint(hidden=H, num_experts=2**40, max_tokens_per_rank=T, num_ranks=8)


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(point="dispatch.middle"), "FaultPlan.point must be one of"),
        (dict(action="explode"), "FaultPlan.action must be one of"),
        (dict(action="corrupt"), "'corrupt' goes with point 'dispatch.count'"),
        (dict(call=0), "call must be >= 1"),
    ],
)
def test_fault_plan_rules(change, words):
    args = dict(rank=0, point="dispatch.start", action="kill") | change
    with pytest.raises(ValueError, match=words):
        FaultPlan(**args)


# -- autograd: one rule for every transport and protocol (see ubep.validate) ----------------------


def calls_with_grad_inputs(protocol: str, transport: str) -> list[str]:
    """Every rank: dispatch, combine and the low-latency pair with inputs that require grad.
    Returns the problems found (outputs requiring grad, or differing from the reference)."""
    from scenarios import Scenario, expert_output

    from ubep import reference

    me = torch.distributed.get_rank()
    sc = Scenario(name="grad", num_ranks=2, num_experts=4, hidden=H, tokens=(5, 5), topk=2, seed=4)
    xs, idxs, ws, ref = sc.expected()
    ys = [expert_output(ref[r].recv_x_MH, r).float() for r in range(2)]
    want = reference.combine(ys, ref, [x.shape[0] for x in xs])[me]
    problems = []
    with ubep.Buffer(
        hidden=H,
        num_experts=4,
        max_tokens_per_rank=T,
        protocol=protocol,
        transport=transport,
        timeout_s=20,
        low_latency=True,
    ) as b:
        x = xs[me].float().requires_grad_()
        w = ws[me].clone().requires_grad_()
        got = b.dispatch(x, topk_idx=idxs[me], topk_weights=w)
        if not torch.equal(got.recv_x, ref[me].recv_x_MH.float()):
            problems.append("dispatch differs from the reference")
        y = ys[me].clone().requires_grad_()
        out = b.combine(y, got.handle, topk_weights=got.recv_topk_weights.clone().requires_grad_())
        if not torch.equal(out.combined_x, want):
            problems.append("combine differs from the reference")
        ll = b.low_latency_dispatch(x, idxs[me], T, 4, use_fp8=False)
        ll_out = b.low_latency_combine(ll.recv_x.clone().requires_grad_(), idxs[me], w, ll.handle)
        returned = [got.recv_x, got.recv_topk_weights, out.combined_x, ll.recv_x, ll_out.combined_x]
        if any(t is not None and t.requires_grad for t in returned):
            problems.append("an output requires grad")
    return problems


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("protocol", "transport"), [("ubep", "shm"), ("bsp", "shm"), ("bsp", "dist")])
def test_inputs_that_require_grad_are_read_as_data(protocol, transport):
    results = ubep.LocalLaunch(world_size=2, timeout_s=100).run(calls_with_grad_inputs, protocol, transport)
    assert results == [[], []]

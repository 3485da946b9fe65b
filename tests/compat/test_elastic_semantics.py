"""DeepEP V2's ElasticBuffer semantics that its own EP test cannot see, on 4 CPU ranks.

DeepEP's test sums a few bf16 rows in float32, where any order gives the same bits. The
probes here choose rows (2^24, -2^24, 1, 2^-9 ...) for which the order of the sum and each
rounding change the result, and check each against the recipe spelled out as plain float32
steps, after checking that the other recipes would give a different answer.
Also here: DeepEP's top-k weights regression test (tests/elastic/test_combine_topk_weights.py),
a program written from DeepEP's README after install_as_deep_ep(), the buffer's lifetime,
and FP8 with packed UE8M0 scales.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import ubep
from ubep.compat import deep_ep, install_as_deep_ep

R, H = 4, 128
BIG = 2.0**24


def f32_sum(values, start: float = 0.0) -> float:
    acc = torch.tensor(start, dtype=torch.float32)
    for v in values:
        acc = acc + torch.tensor(v, dtype=torch.float32)
    return float(acc)


def bf16(v: float) -> float:
    return float(torch.tensor(v).bfloat16())


def buffer_for(hybrid=True, multiple=True, tokens=2) -> deep_ep.ElasticBuffer:
    return deep_ep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=tokens,
        hidden=H,
        num_topk=4,
        allow_hybrid_mode=hybrid,
        allow_multiple_reduction=multiple,
        explicitly_destroy=True,
        num_cpu_timeout_secs=60,
    )


# ---- order and roundings --------------------------------------------------------------------------


def probe(mode: str):
    """Rank 0 sends one token; each rank answers with chosen values; rank 0 returns its combined value.

    Experts: 2 per rank (E = 8). Lane values by (rank, local expert) come from VALUES[mode]."""
    me = dist.get_rank()
    spec = ALL_PROBES[mode]
    expand, multiple, lanes = spec["expand"], spec["multiple"], spec["lanes"]
    buffer = buffer_for(multiple=multiple)
    n = 1 if me == 0 else 0
    idx = torch.tensor([lanes] * n, dtype=torch.int64).view(n, 4)
    x = torch.zeros(n, H).bfloat16()
    recv_x, recv_idx, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=8, do_expand=expand)
    values = spec["values"]
    if expand:
        y = torch.zeros(recv_x.shape[0], H).bfloat16()
        for m in range(handle.num_recv_tokens):
            for k in range(4):
                slot = int(handle.recv_src_metadata[m, 2 + k])
                if slot >= 0:
                    y[slot] = values[(me, lanes[k] % 2)]
    else:
        y = torch.zeros(recv_x.shape[0], H).bfloat16()
        for m in range(recv_x.shape[0]):  # the rank's own rows, summed here as DeepEP's users do
            y[m] = bf16(f32_sum(values[(me, int(e))] for e in recv_idx[m] if e >= 0))
    bias = torch.full((n, H), spec.get("bias", 0.0)).bfloat16()
    combined, _, _ = buffer.combine(y, handle, bias=bias)
    buffer.destroy()
    return float(combined[0, 0]) if me == 0 else None


PROBES = {
    # lanes on ranks [1, 2, 3, 1]: rank 1's last lane is 3, so the order is ranks 2, 3, 1
    "flat": dict(
        lanes=[2, 4, 6, 3],
        expand=False,
        multiple=True,
        values={(1, 0): 1.0, (1, 1): 0.0, (2, 0): BIG, (3, 0): -BIG},
        expected=f32_sum([BIG, -BIG, 1.0]),
        wrong=[f32_sum([1.0, BIG, -BIG])],  # by rank, or by first lane
    ),
    "bias-first": dict(
        lanes=[2, 4, 6, -1],
        expand=False,
        multiple=True,
        bias=-BIG,
        values={(1, 0): 0.0, (2, 0): BIG, (3, 0): 1.0},
        expected=f32_sum([BIG, 1.0], start=-BIG),
        wrong=[f32_sum([BIG, 1.0, -BIG])],
    ),
    # rank 1 holds lanes 0 and 3: summed (and rounded) there first, unless multiple reduction is off
    "expand-local-sum": dict(
        lanes=[2, 4, 6, 3],
        expand=True,
        multiple=True,
        values={(1, 0): 1.0, (1, 1): 2.0**-9, (2, 0): BIG, (3, 0): -BIG},
        expected=f32_sum([BIG, -BIG, bf16(1.0 + 2.0**-9)]),
        wrong=[f32_sum([1.0, BIG, -BIG, 2.0**-9])],
    ),
    "expand-every-lane": dict(
        lanes=[2, 4, 6, 3],
        expand=True,
        multiple=False,
        values={(1, 0): 1.0, (1, 1): 2.0**-9, (2, 0): BIG, (3, 0): -BIG},
        expected=f32_sum([1.0, BIG, -BIG, 2.0**-9]),
        wrong=[f32_sum([BIG, -BIG, bf16(1.0 + 2.0**-9)])],
    ),
}
# 2 x 2: domain 1 (ranks 2, 3) holds lanes 0 and 1, domain 0 (ranks 0, 1) lanes 2 and 3
HYBRID = dict(
    lanes=[4, 6, 2, 0],
    expand=False,
    multiple=True,
    values={(0, 0): 0.0, (1, 0): 2.0**-8, (2, 0): 1.0, (3, 0): 2.0**-9},
    expected=f32_sum([bf16(f32_sum([1.0, 2.0**-9])), bf16(f32_sum([2.0**-8, 0.0]))]),
    wrong=[f32_sum([1.0, 2.0**-9, 2.0**-8, 0.0])],
)
ALL_PROBES = PROBES | {"hybrid": HYBRID}


@pytest.mark.parametrize("mode", list(PROBES))
def test_combine_order_and_roundings_flat(mode):
    spec = PROBES[mode]
    assert all(bf16(spec["expected"]) != bf16(w) for w in spec["wrong"])  # the probe can tell them apart
    got = ubep.LocalLaunch(world_size=R, timeout_s=120).run(probe, mode)
    assert got[0] == bf16(spec["expected"])


def test_combine_rounds_per_scaleout_domain():
    assert bf16(HYBRID["expected"]) != bf16(HYBRID["wrong"][0])
    got = ubep.LocalLaunch(world_size=R, ranks_per_node=2, timeout_s=120).run(probe, "hybrid")
    assert got[0] == bf16(HYBRID["expected"])


# ---- DeepEP's top-k weights regression test, ported -----------------------------------------------


def topk_weights_regression(allow_multiple_reduction: int) -> list[str]:
    """DeepEP's test_combine_topk_weights.py: combine returns, per lane, the weight the lane's owner
    sent back (here a backward-style gradient nonzero only at each rank's own routes)."""
    torch.use_deterministic_algorithms(True)
    num_tokens, num_topk, experts_per_rank = 4, 4, 2
    num_experts = dist.get_world_size() * experts_per_rank
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=num_tokens,
        hidden=H,
        num_topk=num_topk,
        deterministic=True,
        allow_hybrid_mode=True,
        allow_multiple_reduction=bool(allow_multiple_reduction),
        explicitly_destroy=True,
    )
    passed_cases = []
    try:
        num_scaleout_ranks, num_scaleup_ranks = buffer.get_logical_domain_size()
        assert num_scaleout_ranks >= 2 and num_scaleup_ranks >= 2
        cases = {
            "same_gpu": (0, 1),
            "same_scaleout_different_gpu": (0, experts_per_rank),
            "different_scaleout": (0, num_scaleup_ranks * experts_per_rank),
        }
        for name, experts in cases.items():
            topk_idx = torch.full((num_tokens, num_topk), -1, dtype=deep_ep.topk_idx_t)
            topk_idx[:, 1] = experts[0]
            topk_idx[:, 3] = experts[1]
            topk_weights = torch.zeros(num_tokens, num_topk)
            topk_weights[:, 1], topk_weights[:, 3] = 0.25, 0.75
            x = torch.zeros(num_tokens, H, dtype=torch.bfloat16)
            recv_x, recv_topk_idx, _, handle, event = buffer.dispatch(
                x,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                num_experts=num_experts,
                expert_alignment=1,
                do_expand=False,
                async_with_compute_stream=True,
            )
            event.current_stream_wait()
            expected_row = torch.tensor([0, 11, 0, 22], dtype=torch.float)
            local_routes = (recv_topk_idx >= 0) & (recv_topk_idx < experts_per_rank)
            score_grad = torch.where(local_routes, expected_row, 0.0).contiguous()
            grad_x, returned_score_grad, event = buffer.combine(
                torch.zeros_like(recv_x),
                handle=handle,
                topk_weights=score_grad,
                async_with_compute_stream=True,
            )
            event.current_stream_wait()
            expected = expected_row.expand(num_tokens, -1)
            passed = torch.equal(returned_score_grad, expected) and torch.count_nonzero(grad_x).item() == 0
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, passed)
            assert all(everyone), f"{name}: incorrect score gradients on rank(s) {everyone}"
            passed_cases.append(name)
    finally:
        buffer.destroy()
    return passed_cases


@pytest.mark.parametrize("allow_multiple_reduction", [0, 1])
def test_combine_topk_weights_regression(allow_multiple_reduction):
    got = ubep.LocalLaunch(world_size=R, ranks_per_node=2, timeout_s=120).run(
        topk_weights_regression, allow_multiple_reduction
    )
    assert got == [["same_gpu", "same_scaleout_different_gpu", "different_scaleout"]] * R


# ---- a program written from DeepEP's README -------------------------------------------------------


def readme_program() -> bool:
    install_as_deep_ep()
    from deep_ep import ElasticBuffer  # as the README writes it

    group = dist.group.WORLD
    num_max_tokens_per_rank, hidden, num_topk, num_experts = 8, H, 2, 8
    required_bytes = ElasticBuffer.get_buffer_size_hint(
        group, num_max_tokens_per_rank, hidden, num_topk=num_topk, use_fp8_dispatch=False
    )
    buffer = ElasticBuffer(
        group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk
    )
    assert buffer.num_bytes >= required_bytes
    num_sms = buffer.get_theoretical_num_sms(num_experts, num_topk)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(6, hidden, generator=gen).bfloat16()
    topk_weights, topk_idx = torch.rand(6, num_experts, generator=gen).topk(num_topk, dim=-1)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank, num_sms=num_sms, async_with_compute_stream=True,
    )  # fmt: skip
    event.current_stream_wait()
    assert sum(handle.num_recv_tokens_per_expert_list) == int((recv_topk_idx >= 0).sum())
    # experts: the identity, so combine brings back x once per rank the token went to
    combined_x, _, event = buffer.combine(
        recv_x, handle=handle, num_sms=num_sms, async_with_compute_stream=True
    )
    event.current_stream_wait()
    owners = topk_idx // (num_experts // dist.get_world_size())
    copies = torch.stack([(owners == r).any(dim=1) for r in range(dist.get_world_size())], 1).sum(1)
    expected = (x.float() * copies.unsqueeze(1).float()).bfloat16()
    grad_x, _, _, _, event = buffer.dispatch(combined_x, handle=handle, async_with_compute_stream=True)
    event.current_stream_wait()  # combine backward is a cached dispatch: the same rows, new values
    src = handle.recv_src_metadata[:, 0]
    mine = (src // num_max_tokens_per_rank) == dist.get_rank()
    same_rows = torch.equal(grad_x[mine], combined_x[src[mine] % num_max_tokens_per_rank])
    return torch.equal(combined_x, expected) and grad_x.shape == recv_x.shape and same_rows


def test_readme_program_runs_after_install_as_deep_ep():
    saved = {k: sys.modules.get(k) for k in ("deep_ep", "deep_ep.utils")}
    try:
        assert ubep.LocalLaunch(world_size=R, timeout_s=120).run(readme_program) == [True] * R
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


# ---- lifetime, domain, refusals, UE8M0 ------------------------------------------------------------


def lifetime() -> tuple:
    first = buffer_for(hybrid=True)
    domain = (first.get_logical_domain_size(), first.get_physical_domain_size())
    first.barrier()
    first.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        first.dispatch(
            torch.zeros(1, H).bfloat16(), topk_idx=torch.zeros(1, 4, dtype=torch.int64), num_experts=8
        )
    second = buffer_for(hybrid=False)  # a new buffer on the same group after destroy()
    x = torch.full((1, H), float(dist.get_rank() + 1)).bfloat16()
    idx = torch.tensor([[0, 2, 4, 6]])
    recv_x, _, _, handle, _ = second.dispatch(x, topk_idx=idx, num_experts=8)
    combined, _, _ = second.combine(recv_x, handle)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank=2"):
        second.dispatch(
            torch.zeros(3, H).bfloat16(), topk_idx=torch.zeros(3, 4, dtype=torch.int64), num_experts=8
        )
    with pytest.raises(ValueError, match="do_zero_padding=True needs do_expand=True"):
        second.dispatch(x, topk_idx=idx, num_experts=8, do_zero_padding=True)
    no_destroy = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=2, hidden=H)
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        no_destroy.destroy()
    second.destroy()
    return domain, second.get_logical_domain_size(), float(combined[0, 0])


def test_lifetime_domains_and_refusals():
    got = ubep.LocalLaunch(world_size=R, ranks_per_node=2, timeout_s=120).run(lifetime)
    for rank, (domain, direct, value) in enumerate(got):
        assert domain == ((2, 2), (2, 2)) and direct == (1, R)
        assert value == 4 * (rank + 1)  # all four ranks sent it back
    assert ubep.LocalLaunch(world_size=R, timeout_s=120).run(flat_domain) == [((1, R), (1, R))] * R


def flat_domain():
    b = buffer_for()
    out = b.get_logical_domain_size(), b.get_physical_domain_size()
    b.destroy()
    return out


def ue8m0_roundtrip() -> bool:
    hidden = 512
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=3, hidden=hidden, explicitly_destroy=True
    )
    me = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(3, hidden, generator=gen).to(torch.float8_e4m3fn) for _ in range(R)]
    sfs = [
        torch.randint(-(2**31), 2**31 - 1, (3, hidden // 512), generator=gen, dtype=torch.int32)
        for _ in range(R)
    ]
    idx = torch.tensor([[me * 2, -1], [-1, -1], [((me + 1) % R) * 2 + 1, me * 2 + 1]])
    (values, sf), _, _, handle, _ = buffer.dispatch(
        (xs[me], sfs[me]), topk_idx=idx, num_experts=2 * R, use_tma_aligned_col_major_sf=True
    )
    src = handle.recv_src_metadata[:, 0]
    ok = sf.dtype == torch.int32 and sf.stride(0) == 1
    for row, g in enumerate(src.tolist()):
        s, t = divmod(g, 3)
        ok &= torch.equal(values[row].view(torch.uint8), xs[s][t].view(torch.uint8))
        ok &= torch.equal(sf[row], sfs[s][t])
    buffer.destroy()
    return bool(ok)


def test_fp8_with_packed_ue8m0_scales_arrives_bit_for_bit():
    assert ubep.LocalLaunch(world_size=R, timeout_s=120).run(ue8m0_roundtrip) == [True] * R

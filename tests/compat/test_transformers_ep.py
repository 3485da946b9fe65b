"""ubep as transformers' expert-parallel implementation: tiny Qwen3-MoE, Mixtral and DeepSeek-V3
models with random weights, saved locally, loaded under EP with a different batch on every rank,
compared with the same model in one process (float32 logits within 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ubep

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # float32 logits: only the order of the partial sums differs
FP8_TOLERANCE = 0.05  # FP8 tokens on the wire carry e4m3's 2^-4 relative error into the logits


def tiny_configs() -> dict:
    common = dict(
        vocab_size=96,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
    )
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
        ),
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=8),
        "deepseek_v3": transformers.DeepseekV3Config(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            v_head_dim=32,
            qk_nope_head_dim=16,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
        ),
    }


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name, config in tiny_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        paths[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(paths[name])
    return paths


def ep_logits_error(paths: dict[str, str], modes: dict[str, tuple[str, ...]], tokens: int) -> dict:
    """Per (model, mode): the largest |logit difference| between the EP model and the one-process model,
    on this rank's own batch: a prefill, then one decode step from the cache (low-latency mode's T is the
    decode batch, so the prefill takes normal mode and the step low-latency mode)."""
    import ubep.integrations.transformers as ubep_tf

    R, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(100 + me)
    errors = {}
    for name, path in paths.items():
        config = transformers.AutoConfig.from_pretrained(path)
        config.ubep_low_latency_tokens_per_rank = 2  # the decode batch
        ids = torch.randint(0, config.vocab_size, (2, tokens + me), generator=gen)  # a batch of its own
        step = torch.randint(0, config.vocab_size, (2, 1), generator=gen)
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            want = single(ids, use_cache=True)
            want_step = single(step, cache=want.cache, use_cache=True).logits
        for mode in modes[name]:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path,
                config=config,
                dtype=torch.float32,
                distributed_config=ubep_tf.distributed_config(config, R, mode),
            )
            experts = model.model.layers[-1].mlp.experts
            assert experts.num_experts * R == ubep_tf._num_experts(config)  # each rank holds its share
            with torch.no_grad():
                got = model(ids, use_cache=True)
                got_step = model(step, cache=got.cache, use_cache=True).logits
            check_one_buffer(model, mode)
            errors[name, mode] = max(
                float((got.logits - want.logits).abs().max()), float((got_step - want_step).abs().max())
            )
    return errors


def check_one_buffer(model, mode: str) -> None:
    """Every MoE layer ran on one Buffer, with low-latency slots only for ubep_low_latency; closing it
    from one layer closes it for all."""
    layers = [m.ubep_ep for m in model.modules() if hasattr(m, "ubep_ep")]
    buffers = {id(ep.shared.buffer) for ep in layers}
    assert len(buffers) == 1 and layers[0].shared.buffer is not None, (mode, len(layers), len(buffers))
    assert layers[0].shared.buffer.low_latency == (mode == "ubep_low_latency"), mode
    layers[-1].close()
    assert all(ep.shared.buffer is None for ep in layers)


def check(errors_per_rank: list[dict]) -> None:
    for errors in errors_per_rank:
        for (name, mode), error in errors.items():
            limit = FP8_TOLERANCE if mode == "ubep_fp8" else TOLERANCE
            assert error <= limit, f"{name} under {mode}: logits differ by {error}"


def training_gradients(path: str) -> None:
    """Backward through ubep's exchanges: this rank's experts get the gradient of every rank's loss,
    and the router the gradient of this rank's own, as in the one-process model."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    import ubep.integrations.transformers as ubep_tf

    R, me = dist.get_world_size(), dist.get_rank()
    batches = [
        torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(200 + r)) for r in range(R)
    ]
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    moe = single.model.layers[-1].mlp
    single(batches[me]).logits.square().mean().backward()
    want_router = moe.gate.weight.grad.clone()
    single.zero_grad()
    sum(single(ids).logits.square().mean() for ids in batches).backward()
    L = moe.experts.num_experts // R
    want_experts = moe.experts.gate_up_proj.grad[me * L : (me + 1) * L]

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (R, 1), mesh_dim_names=("ep", "tp"))
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], ubep_tf.expert_parallel_plan(model), "ubep")
    model(batches[me]).logits.square().mean().backward()
    ep_moe = model.model.layers[-1].mlp
    got_experts = ep_moe.experts.gate_up_proj.grad
    got_experts = got_experts.to_local() if hasattr(got_experts, "to_local") else got_experts
    torch.testing.assert_close(got_experts, want_experts, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ep_moe.gate.weight.grad, want_router, rtol=1e-4, atol=1e-7)


def two_rank_program(paths: dict[str, str]) -> tuple[dict, str]:
    modes = {"qwen3_moe": ("ubep", "ubep_low_latency", "ubep_fp8"), "mixtral": ("ubep",)}
    modes["deepseek_v3"] = ("ubep", "ubep_low_latency")
    training_gradients(paths["qwen3_moe"])
    return ep_logits_error(paths, modes, 4), oversized_batch(paths["qwen3_moe"])


def test_three_models_on_two_ranks_training_gradients_and_an_oversized_batch(saved_models):
    results = ubep.LocalLaunch(world_size=2, timeout_s=240).run(two_rank_program, saved_models)
    check([errors for errors, _ in results])
    assert all("5 tokens, more than the 4" in said for _, said in results)


def test_qwen3_moe_on_four_ranks(saved_models):
    paths = {"qwen3_moe": saved_models["qwen3_moe"]}
    check(
        ubep.LocalLaunch(world_size=4, timeout_s=240).run(ep_logits_error, paths, {"qwen3_moe": ("ubep",)}, 3)
    )


def oversized_batch(path: str) -> str:
    import ubep.integrations.transformers as ubep_tf

    config = transformers.AutoConfig.from_pretrained(path)
    config.ubep_max_tokens_per_rank = 4
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, distributed_config=ubep_tf.distributed_config(config, 2)
    )
    with pytest.raises(ValueError, match="ubep_max_tokens_per_rank") as caught, torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.int64))
    return str(caught.value)


def test_experts_that_do_not_divide_name_the_setting():
    from ubep.integrations.transformers import distributed_config

    with pytest.raises(ValueError, match=r"8 routed experts.*ep_size=3.*divides 8"):
        distributed_config(tiny_configs()["mixtral"], ep_size=3)


class Mesh:
    """Stands in for the EP DeviceMesh, where the shared Buffers live."""


def test_layers_share_one_buffer_sized_for_the_largest_and_closed_once():
    """One rank, no processes: two layers join, the first forward builds one Buffer for the larger
    of them (and its stats have a load row per layer), a larger hidden size rebuilds it, closing
    closes it once; another model's config, or another mode, gets its own."""
    import pickle

    from ubep.integrations.transformers import SharedBuffer

    mesh, config, other = Mesh(), object(), object()
    shared = SharedBuffer.on(mesh, config, None, False)
    shared.join(hidden=64, num_experts=4, max_tokens=8, max_topk=2)
    shared.join(hidden=32, num_experts=4, max_tokens=16, max_topk=4)
    assert SharedBuffer.on(mesh, config, None, False) is shared
    assert SharedBuffer.on(mesh, other, None, False) is not shared
    assert SharedBuffer.on(mesh, config, None, True) is not shared
    first = shared.get(None, 32, protocol=None, low_latency=False, stats=True)
    assert shared.get(None, 64, protocol=None, low_latency=False, stats=True) is first
    s = first.sizing
    assert (s.hidden, s.capacity, s.max_topk, first.low_latency) == (64, 16, 4, False)
    assert first.stats().expert_load_LE.shape == (2, 4)
    bigger = shared.get(None, 128, protocol=None, low_latency=False, stats=False)
    assert bigger is not first and bigger.sizing.hidden == 128
    with pytest.raises(RuntimeError, match="closed"):
        first.dispatch(
            torch.ones(1, 64), topk_idx=torch.zeros(1, 1, dtype=torch.int64), topk_weights=torch.ones(1, 1)
        )
    shared.close()
    shared.close()
    assert shared.buffer is None
    copied = pickle.loads(pickle.dumps(vars(mesh)))  # a mesh pickled with its DTensor carries no Buffer
    assert all(s.buffer is None and s.layers == 0 for s in copied["ubep_buffers"].values())
    with pytest.raises(ValueError, match="4 and 8 routed experts"):
        shared.join(hidden=64, num_experts=8, max_tokens=8, max_topk=2)

"""What DeepEP 2.1's clients reach outside the calls themselves: the module layout (`deep_ep.buffers.*`,
`deep_ep.utils.*`), the top-level domain sizes, `EventOverlap`'s hooks and handle release,
`ElasticBuffer`'s stream and static size hints, and `Buffer`'s constructor order.

The expected figures are DeepEP's formulas worked by hand, not read back from the code.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ubep
from ubep.compat import deep_ep, install_as_deep_ep
from ubep.compat.deep_ep import ElasticBuffer, EventHandle, EventOverlap
from ubep.overlap import EventOverlap as Pending

MiB = 2**20


@pytest.fixture
def installed(no_deep_ep):
    """`import deep_ep` on ubep for one test (`no_deep_ep` restores every `deep_ep` name afterwards)."""
    install_as_deep_ep()


def test_install_as_deep_ep_is_importable_from_the_shim_itself():
    from ubep.compat.deep_ep import install_as_deep_ep as from_shim

    assert from_shim is ubep.compat.install_as_deep_ep


def test_deep_ep_2_1_submodules_give_the_same_classes(installed):
    import deep_ep
    from deep_ep.buffer import Buffer as v1_module_buffer
    from deep_ep.buffers.elastic import ElasticBuffer as elastic
    from deep_ep.buffers.elastic import EPHandle
    from deep_ep.buffers.legacy import Buffer, Config
    from deep_ep.utils import EventOverlap as v1_event
    from deep_ep.utils.event import EventHandle as handle
    from deep_ep.utils.event import EventOverlap as event

    assert elastic is deep_ep.ElasticBuffer and EPHandle is deep_ep.EPHandle
    assert Buffer is deep_ep.Buffer is v1_module_buffer and Config is deep_ep.Config
    assert event is v1_event is deep_ep.EventOverlap and handle is deep_ep.EventHandle
    assert deep_ep.get_physical_domain_size is deep_ep.utils.envs.get_physical_domain_size


def test_sglang_xlayer_import_succeeds_and_its_scheduler_falls_back(installed):
    try:  # SGLang's dispatcher: one `try` for the Buffer and the scheduler; ImportError turns DeepEP off
        from deep_ep import Buffer, Config  # noqa: F401
        from deep_ep.buffers.xlayers import XLayerScheduler

        use_deepep = True
    except ImportError:
        use_deepep = False
    assert use_deepep
    with pytest.raises(NotImplementedError, match="XLayerScheduler"):  # it catches Exception and falls back
        XLayerScheduler(object())


def test_domain_sizes_of_one_process_without_a_group():
    assert deep_ep.get_physical_domain_size(None) == (1, 1)
    assert deep_ep.get_logical_domain_size(None) == (1, 1)
    assert deep_ep.get_logical_domain_size(None, allow_hybrid_mode=False) == (1, 1)


def domains() -> tuple:
    return deep_ep.get_physical_domain_size(None), deep_ep.get_logical_domain_size(None, False)


def test_domain_sizes_of_two_emulated_nodes():
    got = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=120).run(domains)
    assert got == [((2, 2), (1, 4))] * 4


def pending_event(log: list) -> EventOverlap:
    """An event over a receive half that appends "received" to `log` when it runs."""
    return EventOverlap(EventHandle(Pending(lambda: log.append("received"))))


def test_event_overlap_runs_the_hook_after_the_wait_and_returns_its_result():
    log = []
    event = pending_event(log)
    event.register_hook_after_wait(lambda: log.append("hook") or "sorted")
    with pytest.raises(RuntimeError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    assert event.current_stream_wait() == "sorted" and log == ["received", "hook"]
    assert event.wait() is None and log == ["received", "hook"]  # each ran once
    assert event.event is not None  # kept: release_handle was not asked for


def test_event_overlap_releases_its_handle_when_asked():
    log = []
    event = pending_event(log)
    event.current_stream_wait(release_handle=True)
    assert event.event is None and log == ["received"]
    event = pending_event(log)
    with event(release_handle=True) as same:
        assert same is event and log == ["received"]  # not waited for inside the block
    assert event.event is None and log == ["received", "received"]
    event = pending_event(log)
    with event:  # the flag does not stick: a plain `with` keeps the handle
        pass
    assert event.event is not None


def test_elastic_buffer_stream_and_static_size_hints():
    buffer = ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2)
    stream = buffer.get_comm_stream()
    assert stream.device.type == "cpu" and stream.query()
    # Engram: entries of 7168 bf16 (14336 bytes, a multiple of 32); 128 tokens -> 1.75 MiB -> 2 MiB;
    # 10000 entries -> 143360000 bytes -> 69 blocks of 2 MiB
    assert ElasticBuffer.get_engram_storage_size_hint(10000, 7168, 128) == (2 * MiB, 69 * 2 * MiB)
    # PP: 1000 bytes -> 1024, x 3 in flight x 2 (send, recv) x 2 (prev, next) = 12288 -> 2 MiB
    assert ElasticBuffer.get_pp_buffer_size_hint(1000, 3) == 2 * MiB
    assert ElasticBuffer.get_pp_buffer_size_hint(2 * MiB, 1) == 4 * 2 * MiB
    # AGRS on one rank: (3, 5) float32 = 60 -> 64 bytes, (7,) float32 = 28 -> 32 bytes
    assert ElasticBuffer.get_agrs_num_max_session_bytes(None, [(3, 5), (7,)], torch.float32) == 96
    assert ElasticBuffer.get_agrs_num_max_session_bytes(None, torch.Size([3, 5]), torch.float32) == 64
    assert ElasticBuffer.get_agrs_buffer_size_hint(None, 96) == 2 * MiB
    with pytest.raises(NotImplementedError, match="AGRS"):
        buffer.agrs_new_session()


def test_buffer_takes_deep_ep_2_1_positions_and_refuses_the_ambiguous_ones():
    # DeepEP 2.1: (group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
    # allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink, comm);
    # V1 had use_fabric before explicitly_destroy
    params = inspect.signature(deep_ep.Buffer).parameters
    positional = [p for p, v in params.items() if v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl",
    ]  # fmt: skip
    deep_ep.Buffer(None, 0, 1 << 20, True, 24, True, False, use_fabric=True, explicitly_destroy=True)
    with pytest.raises(TypeError):  # V1's use_fabric, or 2.1's explicitly_destroy: not guessed
        deep_ep.Buffer(None, 0, 1 << 20, True, 24, True, False, True)

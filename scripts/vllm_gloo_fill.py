"""The comparison for scripts/vllm_check.py: vLLM's CPU communicator with the two collectives it
lacks (`all_gatherv`, `reduce_scatterv`) filled in with torch.distributed on gloo, so that vLLM's
own all-gather / reduce-scatter manager runs data parallel + expert parallel without ubep's
exchange (with ubep's expert-map fix, without which the CPU experts crash).

vllm_check.py registers `register` as a `vllm.general_plugins` entry point for that run only
(a dist-info folder on PYTHONPATH); it is not part of ubep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

COMMUNICATOR = f"{__name__}.GlooFilledCpuCommunicator"


def register() -> None:
    """The filled-in communicator, and ubep's expert-map fix (the CPU experts crash under EP without it)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms.cpu import CpuPlatform

    from ubep.integrations.vllm.manager import with_expert_map

    CpuPlatform.get_device_communicator_cls = classmethod(lambda cls: COMMUNICATOR)
    cpu_moe.CPUUnquantizedExperts.apply = with_expert_map(cpu_moe.CPUUnquantizedExperts.apply)


def _communicator_base():
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    return CpuCommunicator


class GlooFilledCpuCommunicator(_communicator_base()):
    """all_gatherv: every rank's rows padded to the largest, all-gathered, unpadded;
    reduce_scatterv: an all-reduce of all rows, then this rank's slice."""

    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        if dim != 0:
            raise NotImplementedError("only dim 0")
        if isinstance(input_, torch.Tensor):
            return self._gatherv(input_, sizes)
        return [self._gatherv(t, sizes) for t in input_]

    def _gatherv(self, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        sizes = sizes or [x.shape[0]] * self.world_size
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.device_group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
        if dim not in (0, -input_.dim()):
            raise NotImplementedError("only dim 0")
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        sizes = sizes or [input_.shape[0] // self.world_size] * self.world_size
        start = sum(sizes[: self.rank_in_group])
        return total[start : start + sizes[self.rank_in_group]]

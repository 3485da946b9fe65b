"""ubep as an expert-parallel implementation for Hugging Face transformers (>= 5.21).

Importing this module registers three implementations with transformers'
`EPImplementationInterface`; a model picks one with
`DistributedConfig(ep_size=R, fsdp_size=R, ep_implementation=...)`, or with
`distributed_config(model_config, ep_size=R, mode=...)` here, which checks the
model first and names the setting to change when it does not fit:

    "ubep"              normal mode: each token sent once per rank, the rank's experts
                        run on its rows with their local weights, combine sums them home.
    "ubep_low_latency"  low-latency mode for batches of up to
                        `config.ubep_low_latency_tokens_per_rank` tokens (decode): one row per
                        (token, expert), expert-major, fixed shapes, weighted combine; larger
                        batches (prefill) take normal mode, as DeepEP's users do.
    "ubep_fp8"          normal mode with the tokens sent as FP8 (per-128-channel scales),
                        dequantized before the experts: half the bytes, FP8's error.
    "ubep_bsp"          normal mode with the barrier-phased baseline protocol on the same
                        shared heap (for comparison: `ubep decode`).

Every rank of the EP group holds its own batch (`fsdp_size == ep_size`, `tp_size == 1`).
Each MoE layer gets its own ubep.Buffer, built on its first forward with room for
`config.ubep_max_tokens_per_rank` tokens per rank (DEFAULT_MAX_TOKENS if unset).
Inference only: the exchanges are not differentiated.
"""

from __future__ import annotations

import torch
from transformers.distributed import DistributedConfig
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from ubep import fp8
from ubep.buffer import Buffer

DEFAULT_MAX_TOKENS = 256  # tokens per rank and forward: a decode batch, or a short prefill
MAX_TOKENS_SETTING = "ubep_max_tokens_per_rank"
LOW_LATENCY_TOKENS_SETTING = "ubep_low_latency_tokens_per_rank"
IMPLEMENTATIONS = ("ubep", "ubep_low_latency", "ubep_fp8", "ubep_bsp")

__all__ = ["IMPLEMENTATIONS", "UbepBspEP", "UbepEP", "UbepFp8EP", "UbepLowLatencyEP", "distributed_config"]


def distributed_config(model_config, ep_size: int, mode: str = "ubep") -> DistributedConfig:
    """A DistributedConfig running `model_config`'s experts over `ep_size` ranks with ubep (`mode`)."""
    if mode not in IMPLEMENTATIONS:
        raise ValueError(f"mode must be one of {IMPLEMENTATIONS}, got {mode!r}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
    experts = _num_experts(model_config)
    if experts % ep_size:
        raise ValueError(
            f"the model has {experts} routed experts, which do not divide among ep_size={ep_size} ranks: "
            f"choose an ep_size that divides {experts}"
        )
    return DistributedConfig(ep_size=ep_size, fsdp_size=ep_size, ep_implementation=mode)


def _num_experts(model_config) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(model_config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(model_config).__name__} names no routed-expert count; is it a MoE model?")


class UbepEP(EPImplementation):
    """Normal mode: dispatch, this rank's experts on the rows it got, combine (plain sums)."""

    use_fp8 = False
    protocol = "ubep"

    def __init__(self, experts, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        if tp_mesh.size() > 1:
            raise ValueError(
                f"ep_implementation={type(self).__name__} needs tp_size=1 (each rank its own batch), "
                f"got tp_size={tp_mesh.size()}"
            )
        self.group, self.ep_size = ep_mesh.get_group(), ep_mesh.size()
        self.num_experts = self.num_local_experts * self.ep_size
        config = getattr(experts, "config", None)
        configured = getattr(config, MAX_TOKENS_SETTING, None)
        self.max_tokens = int(configured) if configured is not None else DEFAULT_MAX_TOKENS
        low_latency = getattr(config, LOW_LATENCY_TOKENS_SETTING, None)
        self.low_latency_tokens = min(self.max_tokens, int(low_latency)) if low_latency else self.max_tokens
        self._buffer: Buffer | None = None  # built collectively on the first forward

    def _buffer_for(self, hidden: int) -> Buffer:
        if self._buffer is None:
            self._buffer = Buffer(
                self.group,
                hidden=hidden,
                num_experts=self.num_experts,
                max_tokens_per_rank=self.max_tokens,
                protocol=self.protocol,
            )
        return self._buffer

    def close(self) -> None:
        """Release this layer's ubep Buffer (it is rebuilt on the next forward)."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.close()

    def _check_batch(self, num_tokens: int, error: ValueError) -> None:
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"this rank's batch has {num_tokens} tokens, more than the {self.max_tokens} its ubep buffer "
                f"holds: set `config.{MAX_TOKENS_SETTING}` to at least {num_tokens}"
            ) from error

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            raise NotImplementedError(
                f"ep_implementation={type(self).__name__!r} runs inference only: call the model under "
                "torch.no_grad(), or train with ep_implementation='all_to_all'"
            )
        buffer = self._buffer_for(hidden_states.shape[-1])
        x = fp8.quantize(hidden_states) if self.use_fp8 else hidden_states
        try:
            got = buffer.dispatch(x, topk_idx=top_k_index, topk_weights=top_k_weights.float())
        except ValueError as error:
            self._check_batch(hidden_states.shape[0], error)
            raise
        rows = fp8.dequantize(*got.recv_x, hidden_states.dtype) if self.use_fp8 else got.recv_x
        local = torch.where(got.recv_topk_idx >= 0, got.recv_topk_idx, self.num_local_experts)
        y = self._run_experts(rows, local, got.recv_topk_weights.to(hidden_states.dtype))
        return buffer.combine(y, got.handle).combined_x

    def _run_experts(self, rows_MH, local_MK, weights_MK) -> torch.Tensor:
        """The local experts' weighted sum per row; local id num_local_experts marks a skipped slot."""
        if rows_MH.shape[0] == 0:
            return rows_MH.new_zeros(rows_MH.shape)
        return self.experts_forward(rows_MH, local_MK, weights_MK)


class UbepFp8EP(UbepEP):
    """Normal mode with FP8 tokens on the wire (dequantized before the experts)."""

    use_fp8 = True


class UbepBspEP(UbepEP):
    """Normal mode with the barrier-phased baseline protocol (the comparison ubep is built to beat)."""

    protocol = "bsp"


class UbepLowLatencyEP(UbepEP):
    """Low-latency mode: expert-major rows, the experts run on the valid ones, weighted combine."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        grad = torch.is_grad_enabled() and hidden_states.requires_grad
        if grad or hidden_states.shape[0] > self.low_latency_tokens:  # (grad: raises) prefill: normal mode
            return super().__call__(hidden_states, top_k_index, top_k_weights)
        buffer = self._buffer_for(hidden_states.shape[-1])
        got = buffer.low_latency_dispatch(
            hidden_states, top_k_index, self.low_latency_tokens, self.num_experts
        )
        recv_LMH = got.recv_x
        L, M, H = recv_LMH.shape
        valid_LM = torch.arange(M) < got.recv_count.unsqueeze(1)
        expert_LM = torch.arange(L).unsqueeze(1).expand(L, M)
        rows = recv_LMH[valid_LM]
        y_LMH = torch.zeros_like(recv_LMH)
        ones = torch.ones(rows.shape[0], 1, dtype=hidden_states.dtype)
        y_LMH[valid_LM] = self._run_experts(rows, expert_LM[valid_LM].unsqueeze(1), ones)
        return buffer.low_latency_combine(y_LMH, top_k_index, top_k_weights.float(), got.handle).combined_x


EPImplementationInterface.register("ubep", UbepEP)
EPImplementationInterface.register("ubep_low_latency", UbepLowLatencyEP)
EPImplementationInterface.register("ubep_fp8", UbepFp8EP)
EPImplementationInterface.register("ubep_bsp", UbepBspEP)

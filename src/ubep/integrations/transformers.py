"""ubep as an expert-parallel implementation for Hugging Face transformers (>= 5.21).

Importing this module registers the implementations below (`IMPLEMENTATIONS`)
with transformers' `EPImplementationInterface`; a model picks one with
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
The model's MoE layers share one ubep.Buffer (`SharedBuffer`), as DeepEP's users share one per
group: built at the first forward, with room for `config.ubep_max_tokens_per_rank` tokens per
rank (DEFAULT_MAX_TOKENS if unset) of the largest layer's hidden size and top-k, in normal mode
only but for "ubep_low_latency" (one Buffer per layer took 48 times the memory for
Qwen3-30B-A3B's 48 layers: docs/reliability.md, "Footprint").
Timeout, engine, transport and (for "ubep") the protocol come from UBEP_TIMEOUT_S,
UBEP_ENGINE, UBEP_TRANSPORT and UBEP_PROTOCOL (`ubep.settings`); with UBEP_STATS=1 the
Buffer records what its calls do (or with `config.ubep_stats = True`), one expert-load row per
MoE layer, and `model_stats(model)` collects it.
Normal mode ("ubep", "ubep_bsp") also trains: the dispatch's backward is the
combine of the gradients (of the rows and of the routing weights), the combine's
backward a cached dispatch, as Megatron wraps DeepEP. The FP8 and low-latency
variants run inference only.
"""

from __future__ import annotations

import torch
from transformers.distributed import DistributedConfig
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from ubep import fp8, settings
from ubep.buffer import Buffer
from ubep.registry import BSP
from ubep.stats import Stats, StatsOptions

DEFAULT_MAX_TOKENS = 256  # tokens per rank and forward: a decode batch, or a short prefill
DEFAULT_MAX_TOPK = 16  # where the model's config names no top-k (`num_experts_per_tok`): ubep.Buffer's
MAX_TOKENS_SETTING = "ubep_max_tokens_per_rank"
LOW_LATENCY_TOKENS_SETTING = "ubep_low_latency_tokens_per_rank"
STATS_SETTING = "ubep_stats"  # config.ubep_stats = True: the shared Buffer records stats
IMPLEMENTATIONS = ("ubep", "ubep_low_latency", "ubep_fp8", "ubep_bsp")
MESH_ATTRIBUTE = "ubep_buffers"  # on the EP DeviceMesh: its `SharedBuffer`s (`SharedBuffer.on`)

__all__ = [
    "IMPLEMENTATIONS",
    "SharedBuffer",
    "UbepBspEP",
    "UbepEP",
    "UbepFp8EP",
    "UbepLowLatencyEP",
    "distributed_config",
    "expert_parallel_plan",
    "model_stats",
]


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


class SharedBuffer:
    """The one ubep Buffer a model's MoE layers share on one EP mesh (for one protocol and mode).

    Each layer joins when transformers builds its implementation, with its hidden size, expert
    count, tokens and top-k; the first forward of any layer builds the Buffer, collectively (every
    rank runs its layers in the same order), sized for the largest layer that joined; a forward with
    a larger hidden size than that builds it again, larger. `close` closes it once, whichever layer
    asks; the next forward builds it again. It lives on the mesh (the EP group's scope: no state of
    the module's own), one per model config object there; a mesh pickled or copied (a DTensor's)
    carries none.
    """

    def __init__(self, config=None) -> None:
        self.config = config  # the model's: held, so that its id keys no other model's layers
        self.buffer: Buffer | None = None
        self.layers = 0  # the layers that joined: one expert-load row each, in forward order
        self.hidden = self.max_tokens = self.max_topk = 0
        self.num_experts: int | None = None

    @classmethod
    def on(cls, mesh, config, protocol: str | None, low_latency: bool) -> SharedBuffer:
        """The mesh's SharedBuffer for the layers of the model with `config`, made on first use."""
        shared = vars(mesh).setdefault(MESH_ATTRIBUTE, {})
        key = (id(config), protocol, low_latency)
        if key not in shared:
            shared[key] = cls(config)
        return shared[key]

    def __reduce__(self):
        return (type(self), ())  # Buffers belong to this process: a copy starts empty, and no config

    def join(self, *, hidden: int, num_experts: int, max_tokens: int, max_topk: int) -> None:
        """Count one more layer, and size the Buffer for it too (0: not known until its forward)."""
        if self.num_experts not in (None, num_experts):
            raise ValueError(
                f"MoE layers with {self.num_experts} and {num_experts} routed experts cannot share one ubep "
                "Buffer (the expert count places the experts on the ranks): give them one expert count"
            )
        self.num_experts = num_experts
        self.hidden, self.max_topk = max(self.hidden, hidden), max(self.max_topk, max_topk)
        self.max_tokens = max(self.max_tokens, max_tokens)
        self.layers += 1

    def get(
        self, group, hidden: int, *, protocol: str | None, low_latency: bool, stats: bool | None
    ) -> Buffer:
        """The shared Buffer, built (collectively) where none is or where `hidden` outgrows it."""
        if self.buffer is not None and self.buffer.sizing.hidden < hidden:
            self.close()
        if self.buffer is None:
            recording = settings.resolve({"stats": stats})["stats"].value  # UBEP_STATS where stats is None
            self.buffer = Buffer(
                group,
                hidden=max(self.hidden, hidden),
                num_experts=self.num_experts,
                max_tokens_per_rank=self.max_tokens,
                max_topk=self.max_topk,
                protocol=protocol,
                low_latency=low_latency,
                stats=StatsOptions(layers=self.layers) if recording else False,
            )
        return self.buffer

    def close(self) -> None:
        """Close the Buffer (idempotent); the next forward builds it again."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.close()


class UbepEP(EPImplementation):
    """Normal mode: dispatch, this rank's experts on the rows it got, combine (plain sums)."""

    use_fp8 = False
    protocol: str | None = None  # None: UBEP_PROTOCOL where set, else "ubep"
    low_latency = False  # the shared Buffer's low-latency slots: only for the implementation using them

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
        self.stats = getattr(config, STATS_SETTING, None)  # None: UBEP_STATS, else off
        self.shared = SharedBuffer.on(ep_mesh, config, self.protocol, self.low_latency)
        hidden = getattr(experts, "hidden_dim", None) or getattr(config, "hidden_size", None)
        topk = getattr(config, "num_experts_per_tok", None)
        self.shared.join(
            hidden=hidden if isinstance(hidden, int) else 0,
            num_experts=self.num_experts,
            max_tokens=self.max_tokens,
            max_topk=topk if isinstance(topk, int) else DEFAULT_MAX_TOPK,
        )
        experts.ubep_ep = self  # where `model_stats` finds the shared Buffer

    def _buffer_for(self, hidden: int) -> Buffer:
        return self.shared.get(
            self.group, hidden, protocol=self.protocol, low_latency=self.low_latency, stats=self.stats
        )

    def close(self) -> None:
        """Release the ubep Buffer every MoE layer shares (the next forward builds it again)."""
        self.shared.close()

    def _check_batch(self, num_tokens: int, error: ValueError) -> None:
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"this rank's batch has {num_tokens} tokens, more than the {self.max_tokens} its ubep buffer "
                f"holds: set `config.{MAX_TOKENS_SETTING}` to at least {num_tokens}"
            ) from error

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if self.use_fp8 and torch.is_grad_enabled() and hidden_states.requires_grad:
            _inference_only(self)
        buffer = self._buffer_for(hidden_states.shape[-1])
        x = fp8.quantize(hidden_states) if self.use_fp8 else hidden_states
        try:
            recv_x, recv_w, recv_idx, handle = _Dispatch.apply(x, top_k_weights.float(), top_k_index, buffer)
        except ValueError as error:
            self._check_batch(hidden_states.shape[0], error)
            raise
        rows = fp8.dequantize(*recv_x, hidden_states.dtype) if self.use_fp8 else recv_x
        local = torch.where(recv_idx >= 0, recv_idx, self.num_local_experts)
        y = self._run_experts(rows, local, recv_w.to(hidden_states.dtype))
        return _Combine.apply(y, buffer, handle)

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

    protocol = BSP.name


class UbepLowLatencyEP(UbepEP):
    """Low-latency mode: expert-major rows, the experts run on the valid ones, weighted combine."""

    low_latency = True

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            _inference_only(self)
        if hidden_states.shape[0] > self.low_latency_tokens:  # a prefill: normal mode
            return super().__call__(hidden_states, top_k_index, top_k_weights)
        buffer = self._buffer_for(hidden_states.shape[-1])
        got = buffer.low_latency_dispatch(
            hidden_states, top_k_index, self.low_latency_tokens, self.num_experts
        )
        recv_LMH = got.recv_x
        L, M, H = recv_LMH.shape
        device = recv_LMH.device
        valid_LM = torch.arange(M, dtype=torch.int64, device=device) < got.recv_count.unsqueeze(1)
        expert_LM = torch.arange(L, dtype=torch.int64, device=device).unsqueeze(1).expand(L, M)
        rows = recv_LMH[valid_LM]
        y_LMH = torch.zeros_like(recv_LMH)
        ones = torch.ones(rows.shape[0], 1, dtype=hidden_states.dtype, device=device)
        y_LMH[valid_LM] = self._run_experts(rows, expert_LM[valid_LM].unsqueeze(1), ones)
        return buffer.low_latency_combine(y_LMH, top_k_index, top_k_weights.float(), got.handle).combined_x


def _inference_only(implementation: EPImplementation) -> None:
    raise NotImplementedError(
        f"{type(implementation).__name__} runs inference only: call the model under torch.no_grad(), "
        "or train with ep_implementation='ubep'"
    )


class _Dispatch(torch.autograd.Function):
    """Normal-mode dispatch; backward: the combine of the row and routing-weight gradients."""

    @staticmethod
    def forward(ctx, x, weights_NK, topk_idx_NK, buffer):
        got = buffer.dispatch(x, topk_idx=topk_idx_NK, topk_weights=weights_NK)
        ctx.buffer, ctx.handle, ctx.local_MK = buffer, got.handle, got.recv_topk_idx >= 0
        ctx.mark_non_differentiable(got.recv_topk_idx)
        return got.recv_x, got.recv_topk_weights, got.recv_topk_idx, got.handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w, _grad_idx, _grad_handle):
        grad_w = None if grad_recv_w is None else torch.where(ctx.local_MK, grad_recv_w, 0.0)
        grad_x, grad_weights, _ = ctx.buffer.combine(grad_recv_x.contiguous(), ctx.handle, grad_w)
        return grad_x, grad_weights, None, None


class _Combine(torch.autograd.Function):
    """Normal-mode combine; backward: a cached dispatch of the gradient."""

    @staticmethod
    def forward(ctx, y_MH, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        return buffer.combine(y_MH, handle).combined_x

    @staticmethod
    def backward(ctx, grad_NH):
        return ctx.buffer.dispatch(grad_NH.contiguous(), handle=ctx.handle).recv_x, None, None


def expert_parallel_plan(model) -> dict[str, str]:
    """transformers' expert-parallel plan spelled out for `model`'s MoE layers, for
    `apply_expert_parallelism` on a model loaded whole (attention stays replicated, no FSDP)."""
    plan = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            prefix = f"model.layers.{i}.mlp.experts"
            plan |= {f"{prefix}.gate_up_proj": "grouped_gemm", f"{prefix}.down_proj": "grouped_gemm"}
            plan[prefix] = "ep_dispatch_experts"
    return plan


def model_stats(model, merge: bool = False) -> Stats | None:
    """`Buffer.stats(merge)` of the Buffer `model`'s MoE layers share, once a forward has built it
    with stats on (UBEP_STATS=1; else None): `expert_load_LE` has one row per MoE layer, in forward
    order. With `merge`, a collective over the group: call it on every rank at the same point."""
    for module in model.modules():
        ep = getattr(module, "ubep_ep", None)
        if isinstance(ep, UbepEP) and ep.shared.buffer is not None:
            return ep.shared.buffer.stats(merge)
    return None


EPImplementationInterface.register("ubep", UbepEP)
EPImplementationInterface.register("ubep_low_latency", UbepLowLatencyEP)
EPImplementationInterface.register("ubep_fp8", UbepFp8EP)
EPImplementationInterface.register("ubep_bsp", UbepBspEP)

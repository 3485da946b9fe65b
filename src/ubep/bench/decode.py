"""`ubep decode`: model-level decode time of a small DeepSeek-V3-shaped MoE model under expert parallelism.

Every rank loads the same random-weight model (transformers' DeepSeek-V3, sizes
scaled to this host), keeps attention and the dense layers whole (data-parallel
attention, as EP serving runs it), shards the routed experts over the ranks with
transformers' expert-parallel plan, and decodes its own batch greedily. Each
system is one `EPImplementation` (ubep normal mode, ubep low-latency mode, the
barrier-phased baseline on the same shared heap, transformers' built-in
all-to-all over gloo); the systems take turns, `repeats` times, on a fresh copy
of the model.

Per decode step (one output token per sequence) every rank records its wall
time and the time inside the EP implementation less its experts (the exchange:
dispatch, combine and their bookkeeping). A step's time is the slowest rank's;
time per output token is the median over steps and repeats, tokens/s counts every
rank's sequences, and the communication share is the median of exchange / step.
The greedy tokens must be the same under every system (checked). With a trace path
(`--trace t.json`), every ubep layer records stats and the first repeat of each ubep
system is written as a Perfetto trace, one file per system (t-ubep.json, ...).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ubep.extras import install_hint, require
from ubep.launcher import LocalLaunch
from ubep.registry import BSP, UBEP

# system name -> transformers EP implementation name
SYSTEMS = {UBEP.name: "ubep", "ubep-ll": "ubep_low_latency", BSP.name: "ubep_bsp", "all_to_all": "all_to_all"}


@dataclass(kw_only=True, slots=True)
class DecodeConfig:
    """The model (DeepSeek-V3's shape, scaled down) and the decode run."""

    ranks: int = 2
    batch: int = 8  # sequences per rank, each decoding one token a step
    prompt: int = 8  # prompt tokens per sequence (prefill, untimed)
    steps: int = 16  # timed decode steps per repeat
    warmup: int = 2  # untimed decode steps first
    repeats: int = 3
    hidden: int = 256
    layers: int = 3  # the first is dense, as DeepSeek-V3's first_k_dense_replace
    experts: int = 16
    topk: int = 4
    moe_intermediate: int = 128
    vocab: int = 1024
    systems: tuple[str, ...] = tuple(SYSTEMS)
    seed: int = 0
    timeout_s: float = 600.0
    trace: str = ""  # set: a Perfetto trace per ubep system, its name suffixed with the system's

    def validate(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(f"systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
        if self.experts % self.ranks:
            raise ValueError(f"experts ({self.experts}) must be a multiple of ranks ({self.ranks})")
        for name in ("ranks", "batch", "prompt", "steps", "repeats", "hidden", "layers", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layers < 2:
            raise ValueError("layers must be >= 2 (one dense layer, then MoE layers)")


def model_config(cfg: DecodeConfig):
    """DeepSeek-V3's architecture (MLA attention, a shared expert, grouped top-k routing), scaled."""
    import transformers

    heads = max(1, cfg.hidden // 64)
    groups = max(1, min(8, cfg.experts // 4))  # DeepSeek-V3: 8 groups of 32; a group scores its top 2
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * cfg.hidden,
        moe_intermediate_size=cfg.moe_intermediate,
        n_routed_experts=cfg.experts,
        n_shared_experts=1,
        num_experts_per_tok=cfg.topk,
        n_group=groups,
        topk_group=max(1, groups // 2),
        first_k_dense_replace=1,
        kv_lora_rank=cfg.hidden // 4,
        q_lora_rank=3 * cfg.hidden // 8,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=cfg.prompt + cfg.warmup + cfg.steps + 8,
    )


class Stopwatch:
    """Seconds spent in EP implementations and in their experts, accumulated in one rank process."""

    def __init__(self):
        self.moe_s = 0.0
        self.experts_s = 0.0
        self.instances: list = []

    def exchange_s(self) -> float:
        return self.moe_s - self.experts_s


def timed(implementation: type, watch: Stopwatch) -> type:
    """A subclass of `implementation` that reports its time and its experts' time to `watch`."""

    class Timed(implementation):
        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            run_experts = self.experts_forward

            def experts_forward(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return run_experts(*args, **kwargs)
                finally:
                    watch.experts_s += time.perf_counter() - start

            self.experts_forward = experts_forward
            watch.instances.append(self)

        def __call__(self, *args):
            start = time.perf_counter()
            try:
                return super().__call__(*args)
            finally:
                watch.moe_s += time.perf_counter() - start

    return Timed


def trace_path(cfg: DecodeConfig, system: str) -> str:
    """Where `system`'s trace goes: cfg.trace with the system's name before the extension."""
    stem, dot, ext = cfg.trace.rpartition(".")
    return f"{stem}-{system}.{ext}" if dot else f"{cfg.trace}-{system}"


def _save_trace(model, system: str, cfg: DecodeConfig) -> None:
    """The merged stats of the Buffer the MoE layers share (a collective), written by rank 0 as a trace."""
    from ubep.integrations.transformers import model_stats
    from ubep.observe import write_trace

    stats = model_stats(model, merge=True)
    if stats is not None and dist.get_rank() == 0:
        write_trace(stats, trace_path(cfg, system))


def _decode_once(path: str, system: str, cfg: DecodeConfig, mesh, first: bool = False) -> dict:
    """One system, one repeat on this rank: per-step wall and exchange seconds, and the greedy tokens."""
    import transformers
    from transformers.distributed.expert_parallel import EPImplementationInterface, apply_expert_parallelism

    from ubep.integrations.transformers import expert_parallel_plan

    watch = Stopwatch()
    name = f"decode_{SYSTEMS[system]}"
    EPImplementationInterface.register(name, timed(EPImplementationInterface()[SYSTEMS[system]], watch))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], expert_parallel_plan(model), name)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + dist.get_rank())
    ids = torch.randint(
        0, cfg.vocab, (cfg.batch, cfg.prompt), generator=gen, dtype=torch.int64, device=gen.device
    )
    steps_s, exchange_s, tokens = [], [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)  # prefill: builds the buffers, untimed
        for step in range(cfg.warmup + cfg.steps):
            next_ids = out.logits[:, -1:].argmax(dim=-1)
            tokens.append(next_ids.flatten().tolist())
            dist.barrier()
            before, start = watch.exchange_s(), time.perf_counter()
            out = model(next_ids, cache=out.cache, use_cache=True)
            if step >= cfg.warmup:
                steps_s.append(time.perf_counter() - start)
                exchange_s.append(watch.exchange_s() - before)
    if cfg.trace and first and system != "all_to_all":
        _save_trace(model, system, cfg)
    for instance in watch.instances:
        if hasattr(instance, "close"):
            instance.close()
    return {"step_s": steps_s, "exchange_s": exchange_s, "tokens": tokens}


def _rank_decode(path: str, cfg: DecodeConfig) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import ubep.integrations.transformers  # noqa: F401  (registers ubep's implementations)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (cfg.ranks, 1), mesh_dim_names=("ep", "tp"))
    runs: dict[str, list[dict]] = {s: [] for s in cfg.systems}
    start = time.monotonic()
    for repeat in range(cfg.repeats):
        for system in cfg.systems:  # take turns, so drifting load falls on every system alike
            runs[system].append(_decode_once(path, system, cfg, mesh, first=repeat == 0))
            if dist.get_rank() == 0:  # a line per system and run, so a log is never silent for long
                step_ms = 1e3 * statistics.median(runs[system][-1]["step_s"])
                print(f"ubep decode: {system}, run {repeat + 1} of {cfg.repeats}: {step_ms:.2f} ms/token on "
                      f"rank 0 ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return runs


def summarize(per_rank: list[dict], cfg: DecodeConfig) -> list[dict]:
    """One row per system from every rank's runs (see the module docstring)."""
    rows = []
    reference_tokens = None
    for system in cfg.systems:
        steps, shares = [], []
        for repeat in range(cfg.repeats):
            runs = [rank_runs[system][repeat] for rank_runs in per_rank]
            for i in range(cfg.steps):
                step = max(r["step_s"][i] for r in runs)
                steps.append(step)
                shares.append(statistics.mean(r["exchange_s"][i] / r["step_s"][i] for r in runs))
        tokens = [rank_runs[system][0]["tokens"] for rank_runs in per_rank]
        reference_tokens = reference_tokens or tokens
        tpot = statistics.median(steps)
        rows.append(
            {
                "system": system,
                "implementation": SYSTEMS[system],
                "ms_per_token": 1e3 * tpot,
                "p90_ms": 1e3 * statistics.quantiles(steps, n=10)[-1] if len(steps) > 1 else 1e3 * tpot,
                "tokens_per_s": cfg.ranks * cfg.batch / tpot,
                "comm_share": statistics.median(shares),
                "same_tokens": tokens == reference_tokens,
            }
        )
    return rows


def run(cfg: DecodeConfig) -> list[dict]:
    """Build and save the model, decode under every system on `cfg.ranks` local ranks, summarize."""
    import transformers

    cfg.validate()
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="ubep-decode-") as path:
        config = model_config(cfg)
        config.ubep_max_tokens_per_rank = cfg.batch * cfg.prompt  # the prefill is the largest batch
        config.ubep_low_latency_tokens_per_rank = cfg.batch  # a decode step: low-latency mode's T
        if cfg.trace:
            config.ubep_stats = True  # the layers' shared Buffer records (ubep.integrations.transformers)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        per_rank = LocalLaunch(world_size=cfg.ranks, timeout_s=cfg.timeout_s).run(_rank_decode, path, cfg)
    return summarize(per_rank, cfg)


def print_rows(rows: list[dict], cfg: DecodeConfig) -> None:
    print(
        f"decode, DeepSeek-V3 shape scaled: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts "
        f"top-{cfg.topk}, {cfg.ranks} ranks x {cfg.batch} sequences, float32"
    )
    print(f"{'system':<12} {'ms/token':>9} {'p90 ms':>8} {'tokens/s':>9} {'comm share':>11}  same tokens")
    for r in rows:
        print(
            f"{r['system']:<12} {r['ms_per_token']:9.2f} {r['p90_ms']:8.2f} {r['tokens_per_s']:9.1f} "
            f"{100 * r['comm_share']:10.0f}%  {'yes' if r['same_tokens'] else 'NO'}"
        )


def write_json(path: str, rows: list[dict], cfg: DecodeConfig) -> None:
    with open(path, "w") as f:
        json.dump({"config": asdict(cfg), "rows": rows}, f, indent=2)


def plot(path: str, rows: list[dict], cfg: DecodeConfig) -> None:
    """Time per output token per system, split into the EP exchange and the rest of the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in rows]
    comm = [r["ms_per_token"] * r["comm_share"] for r in rows]
    rest = [r["ms_per_token"] - c for r, c in zip(rows, comm, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.5))
    ax.barh(names, comm, label="EP exchange (dispatch + combine)")
    ax.barh(names, rest, left=comm, label="rest of the step (attention, experts, head)")
    ax.invert_yaxis()
    ax.set_xlabel("ms per output token (median)")
    ax.set_title(f"decode, {cfg.ranks} ranks x {cfg.batch} sequences, DeepSeek-V3 shape scaled", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parser(subparsers) -> None:
    d = DecodeConfig()
    p = subparsers.add_parser(
        "decode",
        help="time per output token of a small DeepSeek-V3-shaped model under EP",
        description="Decode a small DeepSeek-V3-shaped MoE model (random weights) with expert parallelism "
        "over local ranks: ubep, ubep low-latency, the BSP baseline on the same heap, and transformers' "
        "built-in all-to-all, side by side. Needs transformers (the 'frameworks' extra).",
    )
    for name in (
        "ranks",
        "batch",
        "prompt",
        "steps",
        "warmup",
        "repeats",
        "hidden",
        "layers",
        "experts",
        "topk",
    ):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name), help=f"(default {getattr(d, name)})")
    p.add_argument(
        "--systems",
        default=",".join(d.systems),
        help=f"comma list of {', '.join(SYSTEMS)} (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the weights and inputs (default %(default)s)"
    )
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot time per token, exchange against the rest")
    p.add_argument(
        "--trace", metavar="PATH.json", default="", help="a Perfetto trace per ubep system (PATH-SYSTEM.json)"
    )
    faults = p.add_argument_group(
        "elastic EP: a host dies mid-decode (ubep.bench.elastic_decode, its own small MoE stack)"
    )
    faults.add_argument("--hosts", type=int, default=0, help="emulated hosts (with --kill-host; default 3)")
    faults.add_argument("--kill-host", type=int, help="the host whose ranks SIGKILL themselves at --at-step")
    faults.add_argument(
        "--at-step", type=int, default=10, help="the decode step it dies in (default %(default)s)"
    )
    faults.add_argument(
        "--stop", action="store_true", help="SIGSTOP its ranks instead (masked at the deadline)"
    )
    faults.add_argument("--rejoin-at-step", type=int, help="bring the host back (not supported yet)")
    p.set_defaults(func=run_decode)


def run_elastic(args) -> int:
    """`ubep decode --kill-host h`: the elastic test bed's timeline (`ubep.bench.elastic_decode`)."""
    from ubep.bench import elastic_decode

    if args.rejoin_at_step is not None:
        raise SystemExit("ubep decode --rejoin-at-step: not supported yet (a masked rank cannot rejoin)")
    if args.plot:
        require("ubep decode --plot", "matplotlib", "observe")
    cfg = elastic_decode.ElasticConfig(
        hosts=args.hosts or 3,
        kill_host=args.kill_host,
        at_step=args.at_step,
        stop=args.stop,
        steps=args.steps,
        runs=args.repeats,
        batch=args.batch,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        seed=args.seed,
    )
    try:
        cfg.validate()
    except ValueError as error:
        raise SystemExit(f"ubep decode: {error}") from None
    runs, recoveries = elastic_decode.run(cfg)
    elastic_decode.print_timeline(cfg, runs, recoveries)
    if args.plot:
        elastic_decode.plot(args.plot, cfg, runs[-1])
    return 0


def run_decode(args) -> int:
    if args.kill_host is not None or args.rejoin_at_step is not None:
        return run_elastic(args)
    names = ("ranks", "batch", "prompt", "steps", "warmup", "repeats", "hidden", "layers", "experts", "topk")
    cfg = DecodeConfig(
        **{n: getattr(args, n) for n in names},
        systems=tuple(s for s in args.systems.split(",") if s),
        seed=args.seed,
        trace=args.trace,
    )
    if args.plot:
        require("ubep decode --plot", "matplotlib", "bench")
    try:
        cfg.validate()
        import transformers  # noqa: F401
    except ValueError as error:
        raise SystemExit(f"ubep decode: {error}") from None
    except ImportError:
        raise SystemExit(f"ubep decode needs transformers ({install_hint('frameworks')})") from None
    rows = run(cfg)
    print_rows(rows, cfg)
    if args.json:
        write_json(args.json, rows, cfg)
    if args.plot:
        plot(args.plot, rows, cfg)
    return 0

"""`ubep simulate` and `ubep plan`: run the protocols' plans on a superpod model, print/save the results.

Both print plain-text tables (`ubep.sim.table`) and need no extra; `--plot` needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

from ubep import routing, schedule, topology
from ubep.costmodel import CostParams
from ubep.extras import require
from ubep.registry import BSP, UBEP
from ubep.sim import ablation, placed, sync
from ubep.sim.protocols import Workload
from ubep.sim.run import MODELS, PROTOCOLS, SimConfig, SimResult, simulate, workload
from ubep.sim.table import WIDTH, render


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _names(choices: tuple[str, ...], name: Callable[[str], str] = str):
    """A comma list of `choices`, each as `name` gives it (the policies: their names of now)."""

    def parse(text: str) -> list[str]:
        names = [v for v in text.split(",") if v]
        if bad := [n for n in names if n not in choices]:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return [name(n) for n in names]

    return parse


def _listed(values: list) -> str:
    """A list default as the user types it: [8, 16] -> "8,16"."""
    return ",".join(map(str, values))


def add_parser(subparsers) -> None:
    """Add the `simulate` subcommand (func=run) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate dispatch/combine on a superpod model",
        description="Run the protocols' plans (ubep, bsp) on a model of a fabric: a superpod preset "
        "(CloudMatrix384, NVL72, NVL576, HGX with RDMA) or a JSON topology, calibrated against "
        "published numbers, and print dispatch and combine latency per EP size and batch. No rank "
        "processes and no extra needed (--plot needs matplotlib). --ablation sets the simulator "
        "beside the paper's ablations; --placement compares expert placements.",
    )
    p.add_argument(
        "--topology",
        default="cm384",
        help=f"{', '.join(topology.PRESETS)} or a JSON file (default %(default)s)",
    )
    ranks, tokens = [64], [8, 16, 32, 64, 128]
    p.add_argument(
        "--ranks", type=_ints, default=ranks, help=f"EP sizes, a comma list (default {_listed(ranks)})"
    )
    p.add_argument(
        "--tokens",
        type=_ints,
        default=tokens,
        help=f"tokens per rank, a comma list (default {_listed(tokens)})",
    )
    protocols_ = [UBEP.name, BSP.name]
    p.add_argument(
        "--protocol",
        type=_names(PROTOCOLS),
        default=protocols_,
        help=f"comma list of {', '.join(PROTOCOLS)} (default {_listed(protocols_)})",
    )
    p.add_argument(
        "--policy",
        type=_names(schedule.POLICIES, schedule.policy_name),
        default=[schedule.DISTANCE],
        help=f"ubep's scheduler policies, a comma list of {', '.join(schedule.NAMES)} "
        f"(default {schedule.DISTANCE})",
    )
    p.add_argument(
        "--sync",
        type=_names(sync.SYNCS),
        default=["tff"],
        help=f"ubep's synchronization variants, a comma list of {', '.join(sync.SYNCS)} (default tff)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="deepseek-v3",
        help="the model whose hidden size, experts and top-k are sent (default %(default)s)",
    )
    p.add_argument("--hidden", type=int, help="hidden size (default: the model's)")
    p.add_argument("--experts", type=int, help="routed experts (default: the model's)")
    p.add_argument("--topk", type=int, help="experts per token (default: the model's)")
    p.add_argument(
        "--dispatch-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="what dispatch sends per value (default %(default)s; combine sends bf16)",
    )
    p.add_argument(
        "--routing",
        choices=[r for r in routing.ROUTINGS if r != "hot"],
        default="uniform",
        help="routing distribution (default %(default)s)",
    )
    p.add_argument("--skew", type=float, default=1.0, help="zipf's exponent (default %(default)s)")
    p.add_argument(
        "--hot-experts", type=int, default=0, help="N hot experts; overrides --routing (default 0: none)"
    )
    p.add_argument(
        "--hot-share",
        type=float,
        help="share of picks the hot experts get (default 0.6; with --ablation, the fitted one)",
    )
    p.add_argument("--workers", type=int, help="sender workers per device (default: the topology's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing (default %(default)s)")
    p.add_argument(
        "--ablation",
        choices=("scheduling", "sync", "headline"),
        help="instead: the paper's ablation (or headline reductions) beside ours; --plot saves the bars",
    )
    p.add_argument(
        "--placement",
        type=_names(placed.PLACEMENTS),
        help="instead: these expert placements (none, eplb, ubep) side by side, on the first --protocol",
    )
    p.add_argument("--redundant", type=int, help="redundant expert slots with --placement (default E/8)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON to this path")
    p.add_argument("--plot", metavar="PATH.png", help="write a dispatch-latency plot (PNG) to this path")
    p.set_defaults(func=run)


def _configs(args) -> list[SimConfig]:
    hidden, experts, topk = MODELS[args.model]
    topo = topology.load(args.topology)
    base = SimConfig(
        topology=topo,
        hidden=args.hidden or hidden,
        experts=args.experts or experts,
        topk=args.topk or topk,
        dispatch_dtype=args.dispatch_dtype,
        routing=args.routing,
        skew=args.skew,
        hot_experts=args.hot_experts,
        hot_share=0.6 if args.hot_share is None else args.hot_share,
        workers=args.workers,
        seed=args.seed,
    )
    return [replace(base, ranks=r, tokens=t) for r in args.ranks for t in args.tokens]


def _checked(args) -> list[tuple[SimConfig, Workload]]:
    """Every (config, workload) to simulate; SystemExit with one line naming the bad argument."""
    experts = args.experts or MODELS[args.model][1]
    for ranks in args.ranks:
        if ranks < 1 or experts % ranks:
            raise SystemExit(
                f"ubep simulate: --ranks {ranks} must divide the {experts} experts of {args.model} "
                f"(or set --experts)"
            )
    if args.ablation:
        return []  # the ablations fix their own fabric
    try:
        return [(cfg, workload(cfg)) for cfg in _configs(args)]
    except ValueError as bad:  # an unknown topology, a file that is no topology, too many ranks
        raise SystemExit(f"ubep simulate: {bad}") from None


def _runs(
    cfg: SimConfig, wl: Workload, protocols_: list[str], policies: list[str], syncs: list[str]
) -> list[SimResult]:
    out = []
    for proto in protocols_:
        if proto != UBEP.name:
            out.append(simulate(cfg, proto, wl))
            continue
        for policy in policies:
            out.extend(simulate(replace(cfg, policy=policy, sync=s), proto, wl) for s in syncs)
    return out


def _table(ranks: int, results: list[SimResult]) -> str:
    """One EP size's results; "dispatch vs bsp" is ubep's dispatch time against bsp's (combine aside)."""
    columns = ["tokens", "protocol", "dispatch us", "combine us", "slowest worker us", "dispatch vs bsp"]
    rows = []
    for r in results:
        bsp = next(
            (b for b in results if b.protocol == BSP.name and b.tokens_per_rank == r.tokens_per_rank), None
        )
        gain = (
            f"{(bsp.dispatch_us - r.dispatch_us) / bsp.dispatch_us:+.1%}".replace("+", "-", 1)
            if bsp and r.protocol == UBEP.name
            else ""
        )
        name = r.protocol if r.protocol != UBEP.name or r.policy == schedule.DISTANCE else f"ubep/{r.policy}"
        name += f"/{r.sync}" if r.protocol == UBEP.name and r.sync != "tff" else ""
        rows.append([str(r.tokens_per_rank), name, f"{r.dispatch_us:.1f}", f"{r.combine_us:.1f}",
                     f"{r.dispatch_worker_us:.1f}", gain])  # fmt: skip
    title = f"EP{ranks} on {results[0].topology} ({results[0].workers} workers/device)"
    return render(title, columns, rows, left=("protocol",))


def _plot(results: list[SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({(r.ranks, r.protocol, r.policy, r.sync) for r in results})
    for ranks, proto, policy, sy in keys:
        rs = [r for r in results if (r.ranks, r.protocol, r.policy, r.sync) == (ranks, proto, policy, sy)]
        label = f"{proto}{'' if policy in (proto, schedule.DISTANCE) else '/' + policy}"
        label += f"{'/' + sy if proto == UBEP.name and sy != 'tff' else ''} EP{ranks}"
        ax.plot([r.tokens_per_rank for r in rs], [r.dispatch_us for r in rs], marker="o", label=label)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("dispatch latency (us, simulated)")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{results[0].topology}: simulated dispatch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ablation_table(title: str, bars: list[ablation.Bar]) -> str:
    """Each bar's simulated and published figures, with their units (us, or % change)."""
    rows = [[b.group, b.label, b.shown(b.simulated), b.shown(b.published)] for b in bars]
    columns = ["case", "variant", "simulated", "paper (docs/paper_figures.md)"]
    return render(title, columns, rows, left=("case", "variant"))


def run_ablation(args) -> int:
    """`--ablation`: the paper's numbers beside the simulator's, as a table and (--plot) bars."""
    params = CostParams()
    if args.ablation == "scheduling":
        hot = ablation.FIT_HOT_SHARE if args.hot_share is None else args.hot_share
        bars = ablation.scheduling(params, hot_share=hot)
        title, band = f"Scheduling ablation, cm-ablation, 8 hot experts at {hot:.0%} (slowest worker)", None
    elif args.ablation == "sync":
        bars = ablation.sync(params, batches=args.tokens, ranks=args.ranks[0])
        title = f"Sync ablation, CM384 EP{args.ranks[0]}: dispatch change vs stop-and-wait (%)"
        band = ablation.PAPER_SYNC_RANGE
    else:
        bars = ablation.headline(params, batches=args.tokens, eps=args.ranks)
        title, band = "ubep's dispatch against bsp's, CM384, one expert per device: change (%)", None
    print(_ablation_table(title, bars))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ablation": args.ablation, "bars": [asdict(b) for b in bars]}, f, indent=1)
    if args.plot:
        ablation.plot(bars, args.plot, title, band)
    return 0


def run(args) -> int:
    """Simulate every (ranks, tokens, protocol, policy) combination; print, then save."""
    if args.plot:
        require("ubep simulate --plot", "matplotlib", "bench")
    runs = _checked(args)
    if args.ablation:
        return run_ablation(args)
    if args.placement:
        return run_placements(args, runs)
    configs = [cfg for cfg, _ in runs]
    results = [r for cfg, wl in runs for r in _runs(cfg, wl, args.protocol, args.policy, args.sync)]
    for ranks in args.ranks:
        print(_table(ranks, [r for r in results if r.ranks == ranks]))
    if args.json:
        cfg = configs[0]
        config = {
            "topology": cfg.topology.name, "model": args.model, "hidden": cfg.hidden, "experts": cfg.experts,
            "topk": cfg.topk, "dispatch_dtype": cfg.dispatch_dtype, "routing": cfg.routing,
            "hot_experts": cfg.hot_experts, "hot_share": cfg.hot_share, "workers": cfg.num_workers,
            "seed": cfg.seed, "params": {f: getattr(cfg.params, f) for f in cfg.params.__slots__},
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": [r.as_dict() for r in results]}, f, indent=1)
    if args.plot:
        _plot(results, args.plot)
    return 0


def run_placements(args, runs: list[tuple[SimConfig, Workload]]) -> int:
    """`--placement`: each configuration's placements side by side (table; --json the rows)."""
    rows = []
    for cfg, wl in runs:
        got = placed.simulate_placements(cfg, wl, args.placement, args.protocol[0], args.redundant)
        print(placed.table(cfg, got, placed.redundant_slots(cfg.experts, cfg.ranks, args.redundant)))
        for name, stats, result in got:
            rows.append(
                {"placement": name, **stats._asdict(), "imbalance": stats.imbalance, **result.as_dict()}
            )
    note = (
        "load: (token, expert) pairs per rank; MB across nodes: dispatch + combine per rank, one row "
        "per (token, remote node); flat: per (token, remote rank); placed on the batch's own loads"
    )
    print(textwrap.fill(note, WIDTH))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"placement": rows}, f, indent=1)
    return 0


def add_plan_parser(subparsers) -> None:
    """Add the `plan` subcommand (func=run_plan): advice for a user's own fabric."""
    p = subparsers.add_parser(
        "plan",
        help="advise workers, policy, protocol and sync for a fabric",
        description="Advise how to run ubep on a fabric (a preset, or your own as a JSON topology: "
        "docs/topology.md) for a model: the protocol, the synchronization, the scheduler's policy and "
        "the workers per rank, each chosen by simulating the alternatives at the largest batch. "
        "Prints the advice, what each choice tried gave, and the predicted dispatch and combine "
        "latency per batch with the bottleneck.",
    )
    p.add_argument(
        "--topology",
        default="cm384",
        help=f"{', '.join(topology.PRESETS)} or a JSON file (default %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="deepseek-v3",
        help="the model whose hidden size, experts and top-k are sent (default %(default)s)",
    )
    p.add_argument("--ranks", type=int, help="EP size (default: the most ranks that divide the experts)")
    tokens = [8, 16, 32, 64, 128]
    p.add_argument(
        "--tokens",
        type=_ints,
        default=tokens,
        help=f"tokens per rank, a comma list (default {_listed(tokens)})",
    )
    p.add_argument(
        "--dispatch-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="what dispatch sends per value (default %(default)s; combine sends bf16)",
    )
    p.set_defaults(func=run_plan)


@contextmanager
def _progress(command: str) -> Iterator[Callable[[str], None]]:
    """Say on stderr what is simulated now: one line rewritten in place on a terminal, else a line a step."""
    start, terminal, width = time.monotonic(), sys.stderr.isatty(), 0

    def step(what: str) -> None:
        nonlocal width
        line = f"{command}: simulating {what} ({time.monotonic() - start:.0f} s)"
        if terminal:
            sys.stderr.write("\r" + line.ljust(width))
            width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        yield step
    finally:
        if terminal and width:
            sys.stderr.write("\r" + " " * width + "\r")  # the advice replaces the progress line
            sys.stderr.flush()


WRAP = 100  # the advice's lines break between entries, never inside one


def _between_entries(reason: str) -> str:
    """'kind: a, b, c' indented, broken after an entry's comma where it passes WRAP, never inside one."""
    kind, _, rest = reason.partition(": ")
    entries = rest.split(", ")
    lines, line = [], f"    {kind}:"
    for i, entry in enumerate(entries):
        piece = entry + ("," if i < len(entries) - 1 else "")
        if i and len(line) + 1 + len(piece) > WRAP:
            lines.append(line)
            line = " " * (len(kind) + 5)
        line += " " + piece
    return "\n".join([*lines, line])


def run_plan(args) -> int:
    """Print the advice, what each choice took, and predicted dispatch/combine per batch with bottlenecks."""
    from ubep.sim.plan import plan

    try:
        topo = topology.load(args.topology)
        with _progress("ubep plan") as step:
            advice, preds = plan(topo, model=args.model, ranks=args.ranks, batches=tuple(args.tokens),
                                 dispatch_dtype=args.dispatch_dtype, progress=step)  # fmt: skip
    except ValueError as bad:
        raise SystemExit(f"ubep plan: {bad}") from None
    print(f"{topo.name}, {args.model}: protocol {advice.protocol}, sync {advice.sync}, "
          f"policy {advice.policy}, {advice.workers} workers per rank")  # fmt: skip
    print(f"  dispatch + combine at {advice.tokens} tokens per rank (simulated), for each choice tried:")
    for line in advice.reasons:
        print(_between_entries(line))
    rows = [[str(p.tokens), f"{p.dispatch_us:.1f}", f"{p.combine_us:.1f}", p.bottleneck] for p in preds]
    columns = ["tokens", "dispatch us", "combine us", "dispatch bottleneck"]
    print(render("predicted (simulated)", columns, rows, left=("dispatch bottleneck",)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m ubep.sim.commands ...`) until the main CLI wires `add_parser`."""
    parser = argparse.ArgumentParser(prog="ubep")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

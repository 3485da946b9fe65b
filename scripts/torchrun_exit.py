"""Does a torchrun job with a ubep Buffer exit cleanly? Runs torchrun on this file many times.

    PYTHONPATH=src python scripts/torchrun_exit.py --runs 20 --nproc 4 --transport hier

Each job lets ubep join torchrun's group (no init_process_group of its own), checks a
dispatch and a combine against `ubep.reference`, closes the Buffer and ends; with
`--destroy` it calls `dist.destroy_process_group()` first, as a program that initialised
the group would. A run passes when torchrun exits 0 with every rank's result exact and
every rank's group destroyed by the time its exit handlers end; a rank that dies at exit
("terminate called without an active exception") fails it.
For "hier", each half of the ranks plays one node (GROUP_RANK set from the rank).
Prints one line per run and a summary; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import time


def job(transport: str, destroy: bool) -> None:
    """One rank of a torchrun job (torchrun sets RANK, LOCAL_WORLD_SIZE, ...)."""
    import torch
    import torch.distributed as dist

    # Registered before ubep's own exit handler, so it runs after it (atexit is last in, first out).
    rank = os.environ["RANK"]
    atexit.register(lambda: print(f"rank {rank} group left at exit: {not dist.is_initialized()}"))

    import ubep
    from ubep import reference

    if transport == "hier":  # two emulated nodes on this host
        per_node = max(1, int(os.environ["LOCAL_WORLD_SIZE"]) // 2)
        os.environ["GROUP_RANK"] = str(int(os.environ["RANK"]) // per_node)
    R, E, H, N, K = int(os.environ["WORLD_SIZE"]), 8, 32, 12, 2
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(N, H, generator=gen).bfloat16() for _ in range(R)]
    idxs = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]) for _ in range(R)]
    ws = [torch.rand(N, K, generator=gen) for _ in range(R)]
    ref = reference.dispatch(xs, idxs, ws, E)
    options = {"hidden": H, "num_experts": E, "max_tokens_per_rank": N, "transport": transport}
    with ubep.Buffer(**options, engine="torch", timeout_s=60) as buf:  # the engine plays no part here
        me = buf.rank
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        out = buf.combine(got.recv_x, got.handle).combined_x
        want = reference.combine([r.recv_x_MH for r in ref], ref, [N] * R)[me]
        ok = torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(out, want)
        used = buf.transport
    if destroy:
        dist.destroy_process_group()
    print(f"rank {me} transport={used} exact={ok}", flush=True)
    if not ok:
        sys.exit(1)


def run_once(nproc: int, transport: str, destroy: bool, timeout_s: float) -> tuple[bool, str]:
    """(passed, why) of one torchrun job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [__file__, "--job", "--transport", transport] + (["--destroy"] if destroy else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"no exit within {timeout_s:g} s"
    exact = done.stdout.count(f"transport={transport} exact=True")
    left = done.stdout.count("group left at exit: True")
    if done.returncode == 0 and exact == nproc and left == nproc:
        return True, "ok"
    terminate = "terminate called" in done.stderr
    why = f"exit code {done.returncode}, {exact}/{nproc} ranks exact, {left}/{nproc} left the group at exit"
    return False, why + (", a rank hit terminate" if terminate else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("dist", "hier"), default="dist")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--destroy", action="store_true", help="the job calls destroy_process_group itself")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one rank, under torchrun
    args = parser.parse_args()
    if args.job:
        job(args.transport, args.destroy)
        return 0
    passed = 0
    for i in range(args.runs):
        start = time.monotonic()
        ok, why = run_once(args.nproc, args.transport, args.destroy, args.timeout)
        passed += ok
        print(f"run {i + 1}: {why} ({time.monotonic() - start:.1f} s)", flush=True)
    label = f"{args.transport}, {args.nproc} processes" + (", destroy_process_group" if args.destroy else "")
    print(f"{label}: {passed}/{args.runs} clean")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a namespace-hosts job (`ubep.bench.hosts`), started by torchrun on its host: it measures
like a rank of ubep's launcher (`torch_systems.measure_rank`), or profiles like one
(`profile.profile_rank`, for `ubep bench --profile --hosts N`), and leaves its result in a file for
the bench.

    python -m ubep.bench.host_rank JOB CONFIG_JSON TOKENS WHAT OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ubep.bench.profile import profile_rank
from ubep.bench.torch_systems import measure_rank
from ubep.bench.workload import BenchConfig


def main(job: str, config_json: str, tokens: int, what: str, out_dir: str) -> None:
    """One rank under torchrun: run `job` ("measure": the rows `what` names, taking turns through
    `out_dir`; "profile": "CALLS,ROW"), then leave its result in `out_dir` as result.RANK.json."""
    torch.set_num_threads(1)
    cfg = BenchConfig.from_json(config_json)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.timeout_s * 4))
    try:
        if job == "measure":
            result = measure_rank(cfg, tokens, tuple(what.split(",")), out_dir)
        elif job == "profile":
            calls, name = what.split(",")
            result = profile_rank(cfg, tokens, int(calls), name)
        else:
            raise ValueError(f"ubep.bench.host_rank: job must be measure or profile, got {job!r}")
        partial = os.path.join(out_dir, f"result.{dist.get_rank()}.json.tmp")
        with open(partial, "w") as f:
            json.dump(result, f)
        os.replace(partial, partial.removesuffix(".tmp"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])

"""The `mpi` row: dispatch and combine built on MPI Alltoallv, run under mpirun.

This is what a user would write with mpi4py and Open MPI (which moves bytes
through shared memory within a host): a count Alltoall, a permutation of
tokens by destination, an Alltoallv of rows and one of routing metadata;
combine sends rows back with Alltoallv and sums them. Run as a module, it is
one MPI rank; `run_mpi` starts the whole job from the bench.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

from ubep.bench.timing import LEAD_S, timed
from ubep.bench.workload import BenchConfig, build, expected_combine
from ubep.layout import ExpertPlacement, destination_major, dispatch_layout, localize_for_destinations


def available() -> tuple[bool, str]:
    """Whether the mpi row can run here, and if not, why."""
    if shutil.which("mpirun") is None:
        return False, "mpirun not found (scripts/setup.sh installs Open MPI)"
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py not installed (pip install 'ubep[mpi]')"
    return True, "Open MPI with mpi4py"


def mpirun_command(cfg: BenchConfig, tokens: int) -> list[str]:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [
        "mpirun",
        *root,
        "--oversubscribe",
        "-n",
        str(cfg.ranks),
        "--bind-to",
        "none",
        "--mca",
        "btl",
        "self,vader",
        sys.executable,
        "-m",
        "ubep.bench.mpi_system",
        json.dumps(cfg.as_dict()),
        str(tokens),
    ]


def run_mpi(cfg: BenchConfig, tokens: int) -> dict:
    """Run the MPI job for one token count; returns {op: (starts, finishes per rank)}."""
    proc = subprocess.run(
        mpirun_command(cfg, tokens), capture_output=True, text=True, timeout=cfg.timeout_s * 3
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"mpi row failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


class MpiExchange:
    """Megatron-style dispatch/combine on an MPI communicator."""

    def __init__(self, comm, placement: ExpertPlacement):
        self.comm = comm
        self.placement = placement

    def alltoallv(self, send: torch.Tensor, send_rows: np.ndarray, recv_rows: np.ndarray) -> torch.Tensor:
        """Rows of `send` (any dtype, destination-major) to every rank; returns the received rows."""
        from mpi4py import MPI

        row_bytes = int(np.prod(send.shape[1:])) * send.element_size()
        recv = torch.empty((int(recv_rows.sum()), *send.shape[1:]), dtype=send.dtype)
        sc, rc = send_rows * row_bytes, recv_rows * row_bytes
        sd, rd = np.concatenate([[0], np.cumsum(sc)[:-1]]), np.concatenate([[0], np.cumsum(rc)[:-1]])
        self.comm.Alltoallv([_bytes(send), (sc, sd), MPI.BYTE], [_bytes(recv), (rc, rd), MPI.BYTE])
        return recv

    def dispatch(self, x, idx, w):
        layout = dispatch_layout(idx, self.placement)
        send_rows = layout.num_tokens_per_rank_R.numpy().astype(np.int64)
        recv_rows = np.empty_like(send_rows)
        self.comm.Alltoall(send_rows, recv_rows)
        dest, tokens = destination_major(layout.is_token_in_rank_NR)
        recv_x = self.alltoallv(x[tokens], send_rows, recv_rows)
        local, lw = localize_for_destinations(idx[tokens], w[tokens], dest, self.placement)
        meta = torch.cat([tokens.unsqueeze(1), local, lw.view(torch.int32).to(torch.int64)], dim=1)
        meta = self.alltoallv(meta, send_rows, recv_rows)
        K = idx.shape[1]
        route = (layout.is_token_in_rank_NR, send_rows, recv_rows)
        return recv_x, meta[:, 1 : 1 + K], route

    def combine(self, y, route):
        is_token_in_rank, send_rows, recv_rows = route
        back = self.alltoallv(y, recv_rows, send_rows)
        _, tokens = destination_major(is_token_in_rank)
        out = torch.zeros(is_token_in_rank.shape[0], y.shape[1], dtype=torch.float32)
        out.index_add_(0, tokens, back.float())
        return out.to(y.dtype)


def _time(comm, op, iters: int, warmup: int):
    def start() -> float:
        comm.Barrier()
        return comm.bcast(time.monotonic() + LEAD_S, root=0)

    for _ in range(warmup):
        timed(op, start())
    starts, finishes = [], []
    for _ in range(iters):
        starts.append(start())
        finishes.append(timed(op, starts[-1]))
    return starts, comm.gather(finishes, root=0)


def main(config_json: str, tokens: int) -> None:
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    cfg = BenchConfig(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(config_json).items()}
    )
    me = comm.Get_rank()
    work = build(cfg, tokens)
    mpi = MpiExchange(comm, ExpertPlacement.contiguous(cfg.experts, cfg.ranks))
    x, idx, w = work.xs[me], work.topk_idx[me], work.topk_weights[me]
    recv_x, recv_idx, route = mpi.dispatch(x, idx, w)
    ok = torch.equal(recv_x, work.expected[me].recv_x_MH) and torch.equal(
        recv_idx, work.expected[me].recv_topk_idx_MK
    )
    ok = ok and torch.equal(mpi.combine(recv_x, route), expected_combine(work, me))
    if not all(comm.allgather(ok)):
        raise SystemExit(f"mpi: results differ from the reference on rank(s) {comm.allgather(ok)}")
    dispatch = _time(comm, lambda: mpi.dispatch(x, idx, w), cfg.iters, cfg.warmup)
    combine = _time(comm, lambda: mpi.combine(recv_x, route), cfg.iters, cfg.warmup)
    if me == 0:
        print(json.dumps({"dispatch": dispatch, "combine": combine}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

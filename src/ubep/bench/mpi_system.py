"""The `mpi` row: dispatch and combine built on MPI Alltoallv, run under mpirun.

This is what a user would write with mpi4py and Open MPI (which moves bytes
through shared memory within a host): a count Alltoall, a permutation of
tokens by destination, an Alltoallv of rows and one of routing metadata;
combine sends rows back with Alltoallv and sums them. Run as a module, it is
one MPI rank, timing a dispatch and a combine at each turn the bench gives it
(see `turns`); `MpiJob` starts the whole job beside the bench.
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

from ubep.bench.timing import LEAD_S
from ubep.bench.turns import Calls, Turns, take_turns
from ubep.bench.workload import BenchConfig, build, expected_combine
from ubep.extras import install_hint
from ubep.layout import ExpertPlacement, destination_major, dispatch_layout, localize_for_destinations

STOP_S = 10.0  # how long the job gets to end after QUIT, and again after SIGTERM


def available() -> tuple[bool, str]:
    """Whether the mpi row can run here, and if not, why."""
    if shutil.which("mpirun") is None:
        return False, "mpirun not found (scripts/setup.sh installs Open MPI)"
    if importlib.util.find_spec("mpi4py") is None:
        return False, f"mpi4py not installed ({install_hint('mpi')})"
    return True, "Open MPI with mpi4py"


def mpirun_command(cfg: BenchConfig, tokens: int, turns_dir: str) -> list[str]:
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
        turns_dir,
    ]


class MpiJob:
    """The MPI job for one token count, running beside the bench, its output kept in `turns_dir`."""

    def __init__(self, cfg: BenchConfig, tokens: int, turns_dir: str):
        self._out = open(os.path.join(turns_dir, "stdout"), "w+")
        self._err = open(os.path.join(turns_dir, "stderr"), "w+")
        self._proc = subprocess.Popen(
            mpirun_command(cfg, tokens, turns_dir), stdout=self._out, stderr=self._err, text=True
        )
        self._timeout_s = cfg.timeout_s * 3

    def check(self) -> None:
        """Raise the job's error if it has ended (called while it should still be taking turns)."""
        if self._proc.poll() is not None:
            raise self._failure()

    def finish(self) -> dict:
        """After QUIT: {op: (starts, finishes per rank)}, one entry per turn."""
        code = self._proc.wait(timeout=self._timeout_s)
        self._out.seek(0)
        lines = [ln for ln in self._out.read().splitlines() if ln.startswith("{")]
        if code != 0 or not lines:
            raise self._failure()
        self.stop()
        return json.loads(lines[-1])

    def stop(self) -> None:
        """Let the job end (it has been told to QUIT), else end it: SIGTERM first, which mpirun
        passes to its ranks before it removes its shared-memory segments; SIGKILL leaves them."""
        try:
            self._proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._out.close()
        self._err.close()

    def _failure(self) -> RuntimeError:
        self._err.seek(0)
        return RuntimeError(f"mpi row failed (exit {self._proc.returncode}):\n{self._err.read()[-2000:]}")


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
        recv = torch.empty((int(recv_rows.sum()), *send.shape[1:]), dtype=send.dtype, device=send.device)
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
        out = torch.zeros(is_token_in_rank.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, tokens, back.float())
        return out.to(y.dtype)


def _common_start(comm) -> float:
    comm.Barrier()
    return comm.bcast(time.monotonic() + LEAD_S, root=0)


def main(config_json: str, tokens: int, turns_dir: str) -> None:
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    cfg = BenchConfig.from_json(config_json)
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
    calls = {"mpi": Calls(lambda: mpi.dispatch(x, idx, w), lambda: mpi.combine(recv_x, route))}
    turns = Turns(turns_dir, me, cfg.timeout_s * 4)
    if me == 0:
        turns.opened("mpi")
    samples = take_turns(turns, calls, lambda: _common_start(comm))["mpi"]
    turns.close()
    got = {op: (starts, comm.gather(finishes, root=0)) for op, (starts, finishes) in samples.items()}
    if me == 0:
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

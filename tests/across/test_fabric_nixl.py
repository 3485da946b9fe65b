"""The nixl fabric engine (issue 31): UBEP across hosts (transport "dist") over NIXL one-sided
writes with notifications, UCX over TCP as between hosts, held to the gloo engine's checks: the
reference bit for bit in both modes, calls that differ or are rejected named on every rank, a
killed or stopped peer named. Skipped, with the reason, where NIXL is not installed."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario, scenarios_for
from test_dist_mismatch import DIFFER, ODD, REJECTED, run_case
from test_exchange import check_scenario
from test_low_latency import ll_matrix
from test_multinode import run_hier

import ubep
from ubep.calls import CallId
from ubep.errors import CommTimeoutError
from ubep.extras import install_hint
from ubep.waiting import PeerAbortedError

if not any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12", "nixl_cu13")):
    pytest.skip(f"NIXL is not installed ({install_hint('nixl')})", allow_module_level=True)

VICTIM = 2  # the rank that is killed or stopped


def on_nixl() -> None:
    """This rank's Buffers take the nixl fabric, and UCX uses TCP alone (as between hosts)."""
    os.environ.update(UBEP_FABRIC="nixl", UCX_TLS="tcp")


def exact_in_both_modes() -> list[str]:
    """Every normal-mode scenario (dispatch, combine, cached dispatch) and the low-latency matrix
    (hooks, two calls in flight, a rejected call) against the reference; each Buffer's fabric."""
    on_nixl()
    me, R = dist.get_rank(), dist.get_world_size()
    fabrics = []
    for sc in scenarios_for(R):
        with ubep.Buffer(
            hidden=sc.hidden,
            num_experts=sc.num_experts,
            max_tokens_per_rank=sc.capacity,
            transport="dist",
            protocol="ubep",
            timeout_s=20,
        ) as buf:
            fabrics.append(buf.explain().splitlines()[0])
            check_scenario(buf, sc, me)
    ll_matrix("dist")
    return fabrics


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3])
def test_both_modes_match_the_reference(world_size):
    said = ubep.LocalLaunch(world_size=world_size, timeout_s=360).run(exact_in_both_modes)
    for rank, lines in enumerate(said):
        assert len(lines) == len(scenarios_for(world_size)), rank
        assert all("over the nixl fabric" in line for line in lines), lines


def hier_on_nixl(calls: int) -> int:
    on_nixl()
    return run_hier(calls)


@pytest.mark.timeout(400)
def test_hier_crosses_nodes_over_nixl():
    """Transport hier with protocol ubep: its rail lanes (messages to and from rail peers only) on nixl."""
    launch = ubep.LocalLaunch(world_size=4, ranks_per_node=2, timeout_s=360)
    assert launch.run(hier_on_nixl, 6) == [len(scenarios_for(4))] * 4


def mismatched(case: str):
    on_nixl()
    return run_case(case, "dist")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["kinds", "ll handles", "hidden", "ll rejected"])
def test_calls_that_differ_or_are_rejected_are_named_and_the_group_goes_on(case):
    """As test_dist_mismatch holds the gloo engine: the differing field or the rejecting rank is
    named on every rank, and the calls after it are exact."""
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=100).outcomes(mismatched, case)
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.cause}, exit code {o.exit_code}: {o.error}"
    for rank, (error, message, _, exact_after) in enumerate(o.result for o in outcomes):
        if case in DIFFER:
            assert error == "PeerDataError", (rank, error, message)
            assert "(call header): the ranks' calls differ in " + DIFFER[case] in message, message
        elif rank == ODD:
            assert error in ("ValueError", "TypeError"), (rank, error, message)
        else:
            assert error == "PeerAbortedError", (rank, error, message)
            assert f"rank {ODD} aborted the call (it rejected its input for {REJECTED[case]}" in message
        assert exact_after, f"rank {rank}: the calls after the mismatch differ from the reference"


KILLED = Scenario(name="killed", num_ranks=3, num_experts=6, hidden=32, topk=2, capacity=8, seed=9)


def one_call(buf: ubep.Buffer, me: int) -> None:
    xs, idxs, ws = KILLED.inputs()
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    buf.combine(got.recv_x, got.handle)


def killed_peer(own_host: bool) -> tuple[str, list[int], str]:
    """Rank VICTIM is killed after a call; the others' next call names it, as dead (seen before the
    deadline), or as the culprit of a survivor that saw it first. `own_host`: every rank reports a
    host of its own, so only NIXL's lost connection can tell a survivor."""
    on_nixl()
    me = dist.get_rank()
    if own_host:
        socket.gethostname = lambda: f"host-{me}"
    with ubep.Buffer(
        hidden=KILLED.hidden,
        num_experts=KILLED.num_experts,
        max_tokens_per_rank=KILLED.capacity,
        transport="dist",
        timeout_s=30,
    ) as buf:
        one_call(buf, me)
        if me == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            one_call(buf, me)
        except CommTimeoutError as error:
            return type(error).__name__, error.dead_peers, str(error)
        except PeerAbortedError as error:
            return type(error).__name__, [error.culprit], str(error)
    return "none", [], ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("own_host", [False, True], ids=["its-process", "nixl-disconnect"])
def test_a_killed_peer_is_named_before_the_deadline(own_host):
    outcomes = ubep.LocalLaunch(world_size=3, timeout_s=100).outcomes(killed_peer, own_host)
    assert not outcomes[VICTIM].ok and outcomes[VICTIM].exit_code == -signal.SIGKILL
    for o in outcomes[:VICTIM]:
        assert o.ok, f"rank {o.rank}: {o.error}"
        error, named, message = o.result
        assert error in ("CommTimeoutError", "PeerAbortedError") and named == [VICTIM], o.result
        assert f"rank(s) {VICTIM} died" in message or f"because rank {VICTIM} failed" in message, message


def closed_peer() -> tuple[str, str]:
    """Rank 1 closes its Buffer after a call and stays alive; rank 0's next call names it."""
    on_nixl()
    me = dist.get_rank()
    sizing = dict(hidden=KILLED.hidden, num_experts=4, max_tokens_per_rank=KILLED.capacity)
    buf = ubep.Buffer(**sizing, transport="dist", timeout_s=20)
    x = torch.ones(2, KILLED.hidden, dtype=torch.bfloat16, device="cpu")
    idx = torch.tensor([[0], [3]], dtype=torch.int64, device="cpu")  # one token to each rank
    w = torch.ones(2, 1, dtype=torch.float32, device="cpu")
    buf.dispatch(x, topk_idx=idx, topk_weights=w)
    said = ("closed", "")
    if me == 1:
        buf.close()
    else:
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w)
            said = ("none", "")
        except CommTimeoutError as error:
            said = (type(error).__name__, str(error))
        buf.close()
    dist.barrier()  # rank 1 lives until rank 0 has its answer
    return said


@pytest.mark.timeout(120)
def test_a_peer_that_closed_its_buffer_is_not_called_exited():
    """Issue 45, item 17: a peer that only closed its Buffer was reported as "died (process exited)"."""
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=100).outcomes(closed_peer)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    error, message = outcomes[0].result
    assert error == "CommTimeoutError", outcomes[0].result
    assert "rank(s) 1 died or closed its Buffer (its connection closed" in message, message
    assert "process exited" not in message, message


def stopped_peer() -> tuple[str, list[int], list[int]]:
    """Rank 1 stops (SIGSTOP) after a call; rank 0's next call names it at the deadline, closes its
    Buffer with a write to it still in flight, and kills it."""
    on_nixl()
    me = dist.get_rank()
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    buf = ubep.Buffer(
        hidden=KILLED.hidden,
        num_experts=4,
        max_tokens_per_rank=KILLED.capacity,
        transport="dist",
        timeout_s=3,
    )
    x = torch.ones(2, KILLED.hidden, dtype=torch.bfloat16, device="cpu")
    idx = torch.tensor([[0], [3]], dtype=torch.int64, device="cpu")  # one token to each rank
    w = torch.ones(2, 1, dtype=torch.float32, device="cpu")
    buf.dispatch(x, topk_idx=idx, topk_weights=w)
    if me == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        buf.dispatch(x, topk_idx=idx, topk_weights=w)
        said = ("none", [], [])
    except CommTimeoutError as error:
        said = (type(error).__name__, error.peers, error.dead_peers)
    buf.close()
    os.kill(pids[1], signal.SIGKILL)
    return said


@pytest.mark.timeout(120)
def test_a_stopped_peer_is_named_at_the_deadline_and_close_does_not_wait_for_it():
    outcomes = ubep.LocalLaunch(world_size=2, timeout_s=100).outcomes(stopped_peer)
    assert outcomes[0].ok, outcomes[0].error
    assert outcomes[0].result == ("CommTimeoutError", [1], []), outcomes[0].result


def credit_order() -> list[int]:
    """Rank 0 writes two messages into the same slot of rank 1 (calls 1 and 3, one half) before
    rank 1 reads the first: the second must wait for rank 1's release, not overwrite the first."""
    from ubep.across.fabric.base import Lane
    from ubep.across.fabric.nixl import NixlFabric

    on_nixl()
    me = dist.get_rank()
    fabric = NixlFabric(None, me, 2, [Lane("rows", 2, 64)], 20.0)
    first, third = CallId(1, 1, "dispatch"), CallId(3, 2, "dispatch")
    seen = []
    if me == 0:
        for call in (first, third):
            out = fabric.outbox("rows", 1, call, 2, 64)
            out.header.fill_(call.seq)
            out.payload.fill_(call.seq)
            fabric.send(out)
        dist.barrier()  # both are sent before rank 1 reads
        seen = [int(msg.payload[0]) for msg in fabric.arrivals("rows", third, [1], "third")]
    else:
        dist.barrier()
        for call in (first, third):
            fabric.begin(call)
            for msg in fabric.arrivals("rows", call, [0], f"call {call.seq}"):
                seen += [int(msg.header[0]), int(msg.payload.min()), int(msg.payload.max())]
                fabric.release("rows", 0, call)
            if call is first:
                out = fabric.outbox("rows", 0, third, 1, 1)
                out.payload.fill_(7)
                out.header.fill_(3)
                fabric.send(out)
    fabric.close()
    return seen


@pytest.mark.timeout(120)
def test_a_writer_waits_for_the_release_of_the_slot_it_writes():
    assert ubep.LocalLaunch(world_size=2, timeout_s=100).run(credit_order) == [[7], [1, 1, 1, 3, 3, 3]]


# -- a clean exit, quietly (issue 42, item 4) --------------------------------------------------------


def test_ucx_leaves_out_its_efa_module_only_on_hosts_without_efa(tmp_path):
    from ubep.across.fabric.nixl import without_efa_module

    sysfs = tmp_path / "infiniband"
    (sysfs / "mlx5_0" / "device").mkdir(parents=True)
    (tmp_path / "mlx5_core").mkdir()
    (sysfs / "mlx5_0" / "device" / "driver").symlink_to(tmp_path / "mlx5_core")
    environ: dict[str, str] = {}
    assert without_efa_module(environ, str(sysfs)) and environ == {"UCX_MODULES": "^efa"}
    chosen = {"UCX_MODULES": "ib"}  # the user's choice stands
    assert not without_efa_module(chosen, str(sysfs)) and chosen == {"UCX_MODULES": "ib"}
    (sysfs / "rdmap0" / "device").mkdir(parents=True)
    (tmp_path / "efa").mkdir()
    (sysfs / "rdmap0" / "device" / "driver").symlink_to(tmp_path / "efa")
    on_efa: dict[str, str] = {}
    assert not without_efa_module(on_efa, str(sysfs)) and on_efa == {}  # EFA carries the traffic there


def test_nixl_logs_at_ubeps_level_unless_the_user_set_its_own():
    import logging

    from ubep.across.fabric.nixl import quiet_nixl

    nixl, ours = logging.getLogger("nixl"), logging.getLogger("ubep")
    kept = nixl.level, ours.level
    try:
        ours.setLevel(logging.ERROR)
        nixl.setLevel(logging.INFO)
        quiet_nixl({})
        assert nixl.level == logging.ERROR
        nixl.setLevel(logging.INFO)
        quiet_nixl({"NIXL_LOG_LEVEL": "INFO"})
        assert nixl.level == logging.INFO
    finally:
        nixl.setLevel(kept[0])
        ours.setLevel(kept[1])


CLEAN_RUN = """
import torch, ubep
def calls():
    with ubep.Buffer(hidden=64, num_experts=4, max_tokens_per_rank=8, transport="dist", timeout_s=20) as buf:
        x, w = torch.ones(8, 64), torch.ones(8, 1)
        idx = torch.arange(8).remainder(4).view(8, 1)
        for _ in range(3):
            got = buf.dispatch(x, topk_idx=idx, topk_weights=w)
            buf.combine(got.recv_x, got.handle)
    return "ok"
if __name__ == "__main__":
    print(ubep.LocalLaunch(world_size=2, timeout_s=100).run(calls))
"""


@pytest.mark.timeout(150)
def test_a_clean_run_over_nixl_prints_nothing_of_nixl(tmp_path):
    """No INFO lines of NIXL's at ubep's default level, and no NIXL_ERR_REMOTE_DISCONNECT from a peer
    returning its last credits to an agent already dropped: ranks say goodbye before they close."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "UBEP_LOG_LEVEL")}
    env.update(UBEP_FABRIC="nixl", UCX_TLS="tcp")
    script = tmp_path / "clean_run.py"  # a file: the launcher pickles its function by module
    script.write_text(CLEAN_RUN)
    for _ in range(2):  # the late credit shows in some runs only
        run = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=140
        )
        assert run.returncode == 0 and "['ok', 'ok']" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
        said = run.stdout + run.stderr
        assert "NIXL" not in said, said[-3000:]

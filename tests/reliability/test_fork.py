"""A process forked after construction must not call the Buffer: its memory is shared with the
parent's peers, and a call would publish into their exchange (issue 23, item 3)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from scenarios import Scenario

import ubep
from ubep import reference


def fork_then_call(protocol: str) -> tuple[str, bool]:
    """Rank 0 forks a child that tries a dispatch and a close; then both ranks dispatch for real."""
    me = dist.get_rank()
    sc = Scenario(name="fork", num_ranks=2, num_experts=4, hidden=64, tokens=(8, 8), seed=3)
    xs, idxs, ws = sc.inputs()
    ref = reference.dispatch(xs, idxs, ws, sc.num_experts)
    said = ""
    with ubep.Buffer(
        hidden=64, num_experts=4, max_tokens_per_rank=8, protocol=protocol, transport="shm"
    ) as buf:
        if me == 0:
            read, write = os.pipe()
            child = os.fork()
            if child == 0:  # the child: refused, then a harmless close
                os.close(read)
                try:
                    buf.dispatch(xs[me] * 9, topk_idx=idxs[me], topk_weights=ws[me])
                    message = "accepted"
                except RuntimeError as error:
                    message = str(error)
                buf.close()
                os.write(write, message.encode())
                os._exit(0)
            os.close(write)
            os.waitpid(child, 0)
            with os.fdopen(read) as pipe:
                said = pipe.read()
        dist.barrier()
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        return said, torch.equal(got.recv_x, ref[me].recv_x_MH)


def test_forked_child_is_refused_and_the_parent_stays_exact() -> None:
    for protocol in ("ubep", "bsp"):
        (said, exact0), (_, exact1) = ubep.LocalLaunch(world_size=2, timeout_s=60).run(
            fork_then_call, protocol
        )
        assert "fork" in said and "build a Buffer in the child" in said, said
        assert exact0 and exact1

"""Run under torchrun: ubep joins torchrun's group by itself (no init_process_group here)."""

import sys

import torch
from scenarios import Scenario

import ubep
from ubep import reference

if __name__ == "__main__":
    with ubep.Buffer(hidden=32, num_experts=8, max_tokens_per_rank=16) as buf:
        me, R = buf.rank, buf.num_ranks
        sc = Scenario(name="torchrun", num_ranks=R, num_experts=8, hidden=32, capacity=16, seed=5)
        xs, idxs, ws, ref = sc.expected()
        got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
        combined = buf.combine(got.recv_x, got.handle).combined_x
        want = reference.combine([r.recv_x_MH for r in ref], ref, [x.shape[0] for x in xs])[me]
        ok = torch.equal(got.recv_x, ref[me].recv_x_MH) and torch.equal(combined, want)
        print(f"rank {me}/{R} {buf.explain()} ok={ok}", flush=True)
    sys.exit(0 if ok else 1)

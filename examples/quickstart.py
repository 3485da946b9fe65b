"""One MoE layer's communication on 4 local ranks: dispatch, (stand-in) experts, combine.

Run: .venv/bin/python examples/quickstart.py
"""

import torch
import torch.distributed as dist

import ubep


def moe_step(hidden: int = 1024, experts: int = 32, tokens: int = 64) -> tuple[int, float]:
    """Runs on every rank; returns the rank's token count and its check against a local reference."""
    torch.manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    topk_weights, topk_idx = torch.randn(tokens, experts).softmax(dim=-1).topk(8)
    with ubep.Buffer(hidden=hidden, num_experts=experts, max_tokens_per_rank=tokens) as buf:
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights
        )
        y = recv_x * 2  # the local experts would run here, `counts` rows per local expert
        combined, _, _ = buf.combine(y, handle)
    # Each token comes back once from every rank it was sent to: 2 * x times that number.
    sent_to = handle.is_token_in_rank_NR.sum(dim=1, keepdim=True)
    expected = (2 * x.float() * sent_to).to(torch.bfloat16)
    error = (combined.float() - expected.float()).abs().max().item()
    return combined.shape[0], error


if __name__ == "__main__":
    for rank, (n, error) in enumerate(ubep.LocalLaunch(world_size=4).run(moe_step)):
        print(f"rank {rank}: combined {n} tokens, max error vs local reference {error:g}")

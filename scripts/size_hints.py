"""Shared memory per rank, mapped and touchable, before and after issue 42 (docs/reliability.md,
"Footprint"): `ubep.sizing.size_hint` for the bench's decode shape, the transformers integration
on Qwen3-30B-A3B and DeepEP's test shapes through the compat layer. Arithmetic only, no ranks:

    PYTHONPATH=src python scripts/size_hints.py

Before: a Buffer's default was low_latency=True, the transformers integration built one Buffer per
MoE layer with max_topk 16, and the construction check counted every mapped byte. After: the
default is normal mode, the layers share one Buffer sized by the model's top-k, and the check
counts what calls can touch (`SizeHint.touchable_bytes`).
"""

from __future__ import annotations

from ubep.compat.deep_ep.buffer import HINT_TOKENS, LL_MAX_TOPK
from ubep.sizing import size_hint

GiB = 2**30
QWEN_LAYERS = 48  # Qwen3-30B-A3B's MoE layers
QWEN_TOKENS = 1024  # config.ubep_max_tokens_per_rank for a 1,024-token prefill per rank


def rows() -> list[tuple[str, str, int, int, int]]:
    """(shape, which Buffer, before: bytes the check counted, after: bytes mapped, after: bytes the
    check counts), per rank."""
    out = []
    bench = dict(hidden=7168, num_experts=256, max_tokens_per_rank=128, num_ranks=8, max_topk=8)
    old, new, ll = (
        size_hint(**bench, low_latency=True),
        size_hint(**bench),
        size_hint(**bench, low_latency=True),
    )
    shape = "bench: 8 ranks, H 7168, E 256, K 8, T 128"
    out.append((shape, "normal rows", old.segment_bytes, new.segment_bytes, new.touchable_bytes))
    out.append((shape, "`--mode ll` rows", old.segment_bytes, ll.segment_bytes, ll.touchable_bytes))
    qwen = dict(hidden=2048, num_experts=128, max_tokens_per_rank=QWEN_TOKENS, num_ranks=4)
    per_layer = size_hint(**qwen, max_topk=16, low_latency=True).segment_bytes
    shape = f"Qwen3-30B-A3B: 4 ranks, H 2048, E 128, K 8, T {QWEN_TOKENS}, {QWEN_LAYERS} MoE layers"
    for mode, low_latency in (("ubep", False), ("ubep_low_latency", True)):
        one = size_hint(**qwen, max_topk=8, low_latency=low_latency)
        what = f"`{mode}`: {QWEN_LAYERS} Buffers -> 1"
        out.append((shape, what, QWEN_LAYERS * per_layer, one.segment_bytes, one.touchable_bytes))
    normal = size_hint(
        hidden=7168, num_experts=256, max_tokens_per_rank=HINT_TOKENS, num_ranks=8, max_topk=16
    )
    shape = f"DeepEP test_intranode: 8 ranks, H 7168, E 256, {HINT_TOKENS} tokens"
    out.append((shape, "`get_nvl_buffer_size_hint`", *(normal.segment_bytes,) * 3))
    low = size_hint(hidden=7168, num_experts=288, max_tokens_per_rank=128, num_ranks=8, max_topk=LL_MAX_TOPK,
                    low_latency=True)  # fmt: skip
    shape = "DeepEP test_low_latency: 8 ranks, H 7168, E 288, T 128"
    out.append(
        (shape, "`get_low_latency_rdma_size_hint`", low.segment_bytes, low.segment_bytes, low.touchable_bytes)
    )
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.0f} MiB"


def main() -> None:
    print("| shape | Buffer | before: checked (= mapped) | after: mapped | after: checked (touchable) |")
    print("|---|---|---|---|---|")
    for shape, what, *sizes in rows():
        print(f"| {shape} | {what} | " + " | ".join(_size(n) for n in sizes) + " |")


if __name__ == "__main__":
    main()

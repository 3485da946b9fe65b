"""Host memory for a Buffer's large results, handed out again once no tensor holds it.

A low-latency dispatch returns recv_x [L, R * T, H]: 29 MB at DeepSeek-V3's shape with 8 ranks
and T = 8, of which a decode call writes about one MB. Fresh from the allocator on every call,
such a block is mapped anew (the allocator unmaps large blocks when they are freed), and every
page a call writes first faults in, zeroed by the kernel: about 140 faults and 0.2-0.4 ms of CPU
per call at 8 tokens, 3,500 faults and 6 ms at 128 (docs/benchmarks.md, "Low-latency mode at decode
sizes"). Results belong to the caller (docs/low_latency.md, "Who owns the results"), so a block is
reused only when nothing refers to it any more: no tensor, view, storage or numpy array over it.

Each block is a numpy array that the tensors handed out hold (`torch.from_numpy`: their storage
keeps a reference to it); a block that only the recycler references is free. Up to `keep` blocks
of each size are kept; past that, a call that finds them all in use gets a block that is not kept.
Only the pages a call wrote stay resident in a kept block.

    recycler = Recycler()
    a = recycler.empty((2, 3), torch.bfloat16)   # a fresh block, kept
    del a                                         # nothing holds it now
    b = recycler.empty((2, 3), torch.bfloat16)   # the same block again, contents as a left them
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

FREE_REFS = 3  # a kept block's references when nothing else holds it: the list, the loop, getrefcount's


class Recycler:
    """Blocks of host memory for results, each handed out again once no tensor holds it (see the
    module doc); scoped to one Buffer, never shared."""

    def __init__(self, keep: int = 2):
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._blocks: dict[int, list[np.ndarray]] = {}  # kept blocks by size in bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of `shape` and `dtype` over a free kept block, else a new one."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(shape, dtype=dtype, device="cpu")
        kept = self._blocks.setdefault(nbytes, [])
        for block in kept:  # a plain loop: the only extra reference is `block` itself
            if sys.getrefcount(block) == FREE_REFS:
                return _over(block, shape, dtype)
        block = np.empty(nbytes, dtype=np.uint8)
        if len(kept) < self.keep:
            kept.append(block)
        return _over(block, shape, dtype)

    def kept_bytes(self) -> int:
        """Bytes of the blocks kept (reserved, resident only where written)."""
        return sum(block.nbytes for kept in self._blocks.values() for block in kept)


def _over(block: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over `block` (holding a reference to it): bytes shaped in numpy,
    then one dtype view (a torch view costs microseconds, numpy's reshape a fraction of one)."""
    return torch.from_numpy(block.reshape(*shape[:-1], shape[-1] * dtype.itemsize)).view(dtype)

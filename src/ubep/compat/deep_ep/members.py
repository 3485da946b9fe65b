"""Which ranks a DeepEP layer's calls include, and the layer's own gathers among them.

A DeepEP layer (V1's `Buffer` with enable_shrink, V2's `ElasticBuffer`) holds one ubep.Buffer
per shape it met. Masking a rank masks it in every one of them (`ubep.Buffer.mask_ranks`, a
collective among the ranks that stay), and the layer's own collectives (the call header,
DeepEP's notify step) then gather among the staying ranks only, a masked rank's row all zeros:

    mask(ranks)      -> mask_ranks on every inner Buffer            -> `masked`
    every call       -> gather(mine): header, counts, among `live()` -> the inner calls -> follow()
    on_peer_failure="mask": a gather that finds a peer dead masks it (every staying rank finds
        it) and gathers again without it; an inner call that masked a dead peer inside itself
        (ubep.Buffer's own on_peer_failure="mask") has it masked in the other inner Buffers
        (`follow`), so the next call of another shape does not wait for it
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ubep.buffer import Buffer as UbepBuffer
from ubep.errors import CommTimeoutError
from ubep.group import GroupInfo, all_gather_among, group_among
from ubep.membership import MASK

NO_REJOIN = (
    "a masked rank cannot rejoin: ubep.Buffer has no rejoin yet (issue 43, rejoin, is built "
    "separately); build a new buffer with every rank"
)


class Members:
    """One DeepEP layer's membership: the ranks masked in all of `buffers` (its inner ubep
    Buffers by shape, the layer's own dict), and its gathers among the others."""

    def __init__(
        self, info: GroupInfo, timeout_s: float, buffers: dict[tuple, UbepBuffer], on_peer_failure: str
    ):
        self._info, self._timeout_s, self._buffers = info, timeout_s, buffers
        self.on_peer_failure = on_peer_failure
        self.masked: frozenset[int] = frozenset()
        self.retired = False  # this rank masked itself: it takes part in no further call
        self._among: tuple[tuple[int, ...], dist.ProcessGroup | None] | None = None  # `group_among` live

    @property
    def rank(self) -> int:
        return self._info.rank

    def live(self) -> tuple[int, ...]:
        """The ranks every call includes, ascending (this rank alone once it left)."""
        if self.retired:
            return (self._info.rank,)
        return tuple(r for r in range(self._info.world_size) if r not in self.masked)

    def masked_R(self, device: torch.device) -> torch.Tensor:
        """bool [R]: True at the masked ranks."""
        masked_R = torch.zeros(self._info.world_size, dtype=torch.bool, device=device)
        masked_R[sorted(self.masked)] = True
        return masked_R

    def mask(self, ranks: Iterable[int]) -> None:
        """Leave `ranks` out of every later call: collective among the ranks that stay (each passes
        the same ranks); a rank among `ranks` leaves (its inner Buffers retire)."""
        gone = frozenset(int(r) for r in ranks)
        outside = sorted(r for r in gone if not 0 <= r < self._info.world_size)
        if outside:
            raise ValueError(f"ranks must lie in [0, {self._info.world_size}), got {outside}")
        for inner in self._buffers.values():
            if self._info.rank in gone or not gone <= set(inner.masked_ranks):
                inner.mask_ranks(sorted(gone | self.masked))
        self.retired |= self._info.rank in gone
        self.masked |= gone

    def follow(self) -> None:
        """After an inner call: the ranks an inner Buffer masked inside it (its on_peer_failure="mask";
        every staying rank's Buffer agreed on them) are masked in the other inner Buffers too."""
        seen = set().union(*(inner.masked_ranks for inner in self._buffers.values()))
        if seen - self.masked:
            self.mask(seen)

    def gather(self, mine: torch.Tensor, phase: str) -> torch.Tensor:
        """[R, *mine.shape]: every live rank's `mine`, zeros for the masked ranks. With
        on_peer_failure="mask", a peer found dead here is masked and the gather runs again."""
        while True:
            live = self.live()
            try:
                among = self._group_among(live) if len(live) < self._info.world_size else None
                # watch the peers' processes: every survivor sees a death at once, not one at gloo's
                # deadline while the others already agree on masking it (and give up on it)
                return all_gather_among(self._info, live, among, mine, self._timeout_s, phase, True)
            except CommTimeoutError as error:
                dead = set(error.dead_peers or ()) - self.masked
                if self.on_peer_failure != MASK or not dead or not self._buffers:
                    raise
                self.mask(dead)

    def _group_among(self, live: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The torch.distributed group of the live ranks, built by them at their first gather after
        a mask (the group's connections to a dead rank are broken)."""
        if self._among is None or self._among[0] != live:
            self.close()
            self._among = (live, group_among(self._info, live, self._timeout_s))
        return self._among[1]

    def close(self) -> None:
        """Release the live ranks' group (idempotent)."""
        among, self._among = self._among, None
        if among is not None and among[1] is not None:
            dist.destroy_process_group(among[1])

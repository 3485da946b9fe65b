"""What every protocol's Triton call halves share on the host: the address table on the device, the
live mask, and launching a half until it is done (docs/device.md).

    protocol (ll_device, ubep_device, bsp_device) -> [launch, relaunch, check] -> engine: triton

A half is one kernel launch that ends with a status word: 0 (done) or the first error's code, and a
word naming a peer a wait ran out on (1 + its rank). Two ways to run it:
- `capturable=False` (tests, the interpreter): after each launch the host reads the status; a wait
  that ran out sleeps on the doorbell under the deadline (with the dead-peer and abort checks) and the
  half is launched again, resuming where it stopped;
- `capturable=True` (CUDA graphs): one launch, waits bounded by `max_spins`; nothing is read until
  `check()`, which turns the status words of the halves since the last check into the exceptions.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ubep.calls import CallId
from ubep.errors import CommTimeoutError

DONE = 0  # a status word's [0] when the half finished (`ubep.protocols.ll.codes`, `ubep_codes`)
WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}  # the widest word that divides every row
TL_WORDS = {torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}
# Polls before a half hands its wait to the host's doorbell sleep (capturable=False): few under the
# interpreter (a poll there takes tens of microseconds and holds its lock), about a second on a GPU.
SYNC_SPINS, SYNC_SPINS_GPU = 64, 2**20
CAPTURE_SPINS = 2**31 - 1  # a GPU poll takes about a microsecond: a wait gives up after seconds


def pow2(n: int, lo: int = 1, hi: int = 1 << 30) -> int:
    """The power of two at or above n, within [lo, hi] (a block size)."""
    return min(max(lo, 1 << max(int(n) - 1, 0).bit_length()), hi)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DeviceHalves:
    """The launching side of one protocol's Triton halves on a heap with an address table. A subclass
    names its status word for an awaited peer (`WAITING`) and turns an error status into the
    exception its CPU protocol raises (`_error`)."""

    WAITING: int  # the status word naming a peer a wait ran out on (1 + its rank)
    layout_by_send = False  # normal mode's send kernel says True (`NormalTriton`)

    def __init__(self, heap, blocks, engine, capturable: bool, max_spins: int | None):
        self.t, self.blocks, self.engine = heap, blocks, engine
        self.me, self.R = heap.rank, heap.num_ranks
        table, _ = heap.address_table(blocks.table())
        self.device = getattr(heap, "device", torch.device("cpu"))
        self.table = torch.from_numpy(table).to(self.device)
        self.capturable = capturable
        sync_spins = SYNC_SPINS if self.device.type == "cpu" else SYNC_SPINS_GPU
        self.max_spins = max_spins or (CAPTURE_SPINS if capturable else sync_spins)
        self._unchecked: list[tuple[CallId, str, torch.Tensor, object]] = []  # capturable: to `check()`
        self._live_R: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _error(self, call: CallId, phase: str, code: int, words, mine) -> Exception:
        """The exception for an error status (words: the status as numpy), in the CPU protocol's words;
        `mine` is what the subclass passed to `_half` about this rank's call."""
        raise NotImplementedError

    def _live(self) -> torch.Tensor:
        """uint8 [R] on the device: 1 for each live rank (rebuilt only when the live set changes)."""
        live = tuple(self.t.live)
        if self._live_R is None or self._live_R[0] != live:
            mask = torch.zeros(self.R, dtype=torch.uint8, device="cpu")
            mask[list(live)] = 1
            self._live_R = live, mask.to(self.device)
        return self._live_R[1]

    def _zeros(self, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _half(
        self, call: CallId, phase: str, kernel, grid, args: tuple, consts: dict, mine, rings: bool = False
    ) -> None:
        """Launch one half; unless capturable, read its status and relaunch while it waits, then raise
        its error. args end with (status, max_spins); `rings`: the half publishes before it waits (a
        barrier), so peers asleep are rung after its first launch."""
        status = args[-2]
        if self.capturable:
            self.engine.launch(kernel, grid, *args, **consts)
            self._unchecked.append((call, phase, status, mine))
            return
        sleeper = None
        while True:
            self.engine.launch(kernel, grid, *args, **consts)
            if rings and sleeper is None:
                self._wake()
            code, awaited = (int(v) for v in status[[0, self.WAITING]].tolist())
            if code != DONE:
                raise self._error(call, phase, code, status.cpu().numpy(), mine)
            if awaited == 0:
                return
            status[self.WAITING] = 0
            sleeper = sleeper or self.t.sleeper(phase, call)
            sleeper.pause([awaited - 1])  # raises past the deadline, or when the peer died or aborted

    def _once(self, call: CallId, phase: str, kernel, grid, args: tuple, consts: dict, mine) -> None:
        """A half or phase that waits for nothing: launch once; unless capturable, raise its error
        (args end with its status)."""
        status = args[-1]
        self.engine.launch(kernel, grid, *args, **consts)
        if self.capturable:
            self._unchecked.append((call, phase, status, mine))
            return
        code = int(status[0])
        if code:
            raise self._error(call, phase, code, status.cpu().numpy(), mine)

    def check(self) -> None:
        """Capturable halves: raise the first error (or timeout) recorded since the last check."""
        unchecked, self._unchecked = self._unchecked, []
        for call, phase, status, mine in unchecked:
            words = status.cpu().numpy()
            if words[0] != DONE:
                raise self._error(call, phase, int(words[0]), words, mine)
            if words[self.WAITING]:
                detail = f"a device wait ran out of {self.max_spins} polls"
                raise CommTimeoutError(phase, [int(words[self.WAITING]) - 1], 0.0, [], detail)

    def _wake(self) -> None:
        """Peers between launches sleep on their doorbells (capturable=False): ring them."""
        if not self.capturable:
            self.t.ring()

"""`Buffer`: the public entry point, with DeepEP's normal-mode semantics.

It validates at the boundary, derives the layout, hands the exchange to the
protocol chosen at construction, and packs results into NamedTuples. It keeps
only what lives as long as the Buffer (the exchange and its buffers, the call
counter); everything about one call travels in the returned handle.

Legend: see `ubep.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Iterable
from importlib.metadata import version

import torch
import torch.distributed as dist

from ubep import registry, settings, validate
from ubep.calls import CallCounter, CallId
from ubep.deadlines import collective_deadline, construction_s
from ubep.errors import ConfigMismatchError, UbepError
from ubep.factory import Options, build, ready_engine
from ubep.faults import FaultPlan, FaultPoints
from ubep.group import (
    GroupInfo,
    all_gather_object,
    check_agreement,
    choose_transport,
    join_group,
    keep_agreed,
    torch_group,
)
from ubep.layout import ExpertPlacement, dispatch_layout, tokens_per_node
from ubep.membership import AGAIN, FINISH, MASK, ON_PEER_FAILURE, Membership
from ubep.observe.recording import RecordedExchange, RecordedLowLatency, Recorder
from ubep.overlap import EventOverlap, receive_later
from ubep.placement import Placement
from ubep.placement.slots import PlacedSlots
from ubep.plans import Planner
from ubep.protocols.base import Exchange, LowLatencyExchange, Sizing
from ubep.protocols.ll.plans import FLAGS, received
from ubep.protocols.warmup import needed
from ubep.results import (
    CombineResult,
    DispatchHandle,
    DispatchResult,
    LayoutResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)
from ubep.schedule import DISTANCE, POLICIES
from ubep.sizing import size_hint
from ubep.stats import Stats, StatsOptions
from ubep.timers import CallTimers
from ubep.transport.shm import Rejoining
from ubep.validate import CPU

VERSION = version("ubep")  # from the package metadata (pyproject.toml): ranks must run the same


def _one_at_a_time(method):
    """A call of the Buffer is refused while another thread is inside one: the peers number calls
    in one order, and the rows of overlapping calls would mix. Calls from one thread never overlap."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not self._one_call.acquire(blocking=False):
            raise RuntimeError(
                f"{method.__name__}: another thread is inside a call of this Buffer; calls on one Buffer "
                "must not overlap (their rows would mix): use one Buffer per thread, or serialise the calls"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            self._one_call.release()

    return call


def _finished_by_the_rest(method):
    """With on_peer_failure="mask", a call that a peer's death or silence failed is finished by the
    staying ranks: they agree inside it on whom to leave out (`Membership.mask_failed`), then each
    runs it again without them, or finishes a low-latency combine in place where some of them
    completed it (`_unfinished`). Each round masks at least one more rank, so it ends."""
    takes = inspect.signature(method)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        while True:
            self._unfinished = None
            try:
                return method(self, *args, **kwargs)
            except UbepError as error:
                if self.on_peer_failure != MASK:
                    raise
                fresh = takes.bind(self, *args, **kwargs).arguments.get("handle") is None
                m, unfinished = self._membership, self._unfinished is not None
                step = m.mask_failed(
                    error, self._exchange, self._ll, self._calls, self._calls.seq, fresh, unfinished
                )
                self._follow_membership()  # the run again (or the next call): live copies
                if step == FINISH:
                    return self._unfinished()
                if step != AGAIN:
                    raise

    return call


@_one_at_a_time
def _receive_half(buffer: Buffer, call: CallId, receive) -> None:
    """A low-latency receive half run later (its hook, or event.wait()); refused when ranks were
    masked since its send: the call is over for the ranks that stay (`mask_ranks` freed its half,
    which their next calls reuse), and its senders may include a masked rank."""
    if call.seq <= buffer._membership.after:
        raise RuntimeError(
            f"low-latency {call.kind.removeprefix('ll_')} #{call.epoch}: its receive half (hook or "
            f"event.wait()) was issued before rank(s) {list(buffer.masked_ranks)} were masked; the call "
            "is over (its buffers serve the calls after the mask): issue it again"
        )
    if call.timers is not None:
        call.timers.resume()  # the caller's time since the call returned is no block's
    receive()


class Buffer:
    """Dispatch/combine for one EP group; construct it on every rank with the same sizing.

    Args:
        group: the torch.distributed group (None: the default group, or a group
            of one when torch.distributed is not initialised and not under torchrun).
        hidden: H, the hidden size of every token.
        num_experts: E, experts in the group; E % R == 0.
        max_tokens_per_rank: T, the most tokens any rank passes to one call.
        transport: "auto" (default; shared memory within a host; across hosts "hier":
            shared memory within each, torch.distributed between them, each token
            crossing to a node once), "shm", "hier" or "dist" (flat collectives).
            `explain()` says what was chosen and why.
        protocol: "ubep" (default; asynchronous, data as flag) or "bsp" (the barrier baseline).
        timeout_s: deadline of every wait on a peer (default 30); construction's collectives
            wait max(timeout_s, 10), in every layer (`ubep.deadlines.construction_s`).
        max_topk: the largest K a call may use (sizes the routing buffers).
        expert_placement: optional list of E owner ranks (default: contiguous blocks).
        low_latency: False (default, as DeepEP's low_latency_mode): normal mode only; True
            also maps the low-latency slots, which `low_latency_dispatch`/`_combine` need.
        faults: a `ubep.faults.FaultPlan` to inject a fault (tests only; default none).
        workers: threads per rank that move dispatch rows while the calling thread waits for
            the next source, following the token scheduler's slices (`ubep.schedule`); 1 is
            right when ranks outnumber cores.
        schedule: the scheduler's policy for several workers ("distance", by fabric distance, the
            default; "balanced", "bsp", ...: `ubep.schedule`; "ubep" is distance's older name).
        engine: the kernels that move and reduce rows: "auto" (default; the fastest that loads
            here), "torch", "numba" or "triton"; `explain()` says which runs and why.
        stats: record what every call does for `stats()` (default False; True, or a
            `ubep.StatsOptions`); see docs/observability.md.
        ll_flag: how low-latency rows carry their arrival on the Triton halves (engine "triton"):
            "after-data" (default; rows, then a released stamp) or "in-word" (8-byte words of 4
            payload bytes and the epoch, each its own flag; twice the slot memory). docs/device.md.
        capturable: calls on the Triton halves read nothing back on the host, so a CUDA graph can
            capture them (low-latency calls; normal-mode calls with `num_worst_tokens`); their
            errors (a bad topk_idx value too) raise at `check()`. docs/device.md.
        fabric: how bytes reach ranks on other hosts, where protocol "ubep" crosses hosts: "zmq"
            (ZeroMQ over TCP, waits that block on all peers at once; the `zmq` extra), "gloo"
            (torch.distributed point-to-point over TCP, no extra; its waits poll) or "nixl" (NIXL
            one-sided writes over UCX: TCP, InfiniBand, EFA; the `nixl` extra). "auto" takes zmq
            where every rank has pyzmq, else gloo. docs/multinode.md.
        call_timers: time the blocks of every call (validation, halves, waiting,
            results) and count its sleeps, rings and yields, for `call_timers` (default False;
            `ubep.timers`). Off, nothing is timed.
        on_peer_failure: what a call does when a peer is dead, stopped or silent past the deadline:
            "raise" (default; CommTimeoutError or PeerAbortedError naming it, then `mask_ranks`) or
            "mask" (on a shared heap, and on "dist" over the fabric: the staying ranks agree inside
            the call on whom to leave out, and every one of them finishes the call without those
            ranks; `left_out` says which top-k entries that dropped; with a placement, the pairs of
            a lost copy go to a live one; a side without a quorum raises PartitionError).
            docs/reliability.md.
        racks: how many racks the hosts stand in (default 1), each holding the same number of
            consecutive hosts (by node index); transport "tiers" crosses between racks once per token
            and rack, then between the hosts of a rack once per token and host. docs/multinode.md.

    transport, protocol, timeout_s, engine, stats, ll_flag, capturable, fabric, call_timers and
    on_peer_failure left as None come from the environment (UBEP_TRANSPORT, UBEP_PROTOCOL,
    UBEP_TIMEOUT_S, UBEP_ENGINE, UBEP_STATS, UBEP_LL_FLAG, UBEP_CAPTURABLE, UBEP_FABRIC,
    UBEP_CALL_TIMERS, UBEP_ON_PEER_FAILURE), else from the defaults
    above; an argument given wins (`ubep.settings`, and `explain()` says which).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        hidden: int,
        num_experts: int,
        max_tokens_per_rank: int,
        transport: str | None = None,
        protocol: str | None = None,
        timeout_s: float | None = None,
        max_topk: int = 16,
        expert_placement: list[int] | torch.Tensor | None = None,
        low_latency: bool = False,
        faults: FaultPlan | None = None,
        workers: int = 1,
        schedule: str = DISTANCE,
        engine: str | None = None,
        stats: bool | StatsOptions | None = None,
        ll_flag: str | None = None,
        capturable: bool | None = None,
        fabric: str | None = None,
        call_timers: bool | None = None,
        on_peer_failure: str | None = None,
        racks: int = 1,
    ):
        log = settings.configure_logging()
        self._settings = settings.resolve(
            {
                "transport": transport,
                "protocol": protocol,
                "timeout_s": timeout_s,
                "engine": engine,
                "stats": stats,
                "ll_flag": ll_flag,
                "capturable": capturable,
                "fabric": fabric,
                "call_timers": call_timers,
                "on_peer_failure": on_peer_failure,
            }
        )
        transport, protocol, timeout_s, engine, stats, ll_flag, capturable, fabric, call_timers, on_dead = (
            s.value for s in self._settings.values()
        )
        validate.positive("hidden", hidden)
        validate.positive("num_experts", num_experts)
        validate.expert_tables(num_experts)
        validate.positive("max_tokens_per_rank", max_tokens_per_rank)
        validate.positive("max_topk", max_topk)
        registry.one_of("protocol", registry.PROTOCOLS, protocol, auto=False)
        validate.positive("workers", workers)
        validate.positive("racks", racks)
        if schedule not in POLICIES:
            raise ValueError(f"schedule must be one of {POLICIES}, got {schedule!r}")
        if ll_flag not in FLAGS:
            raise ValueError(f"ll_flag must be one of {FLAGS}, got {ll_flag!r}")
        if on_dead not in ON_PEER_FAILURE:
            raise ValueError(f"on_peer_failure must be one of {ON_PEER_FAILURE}, got {on_dead!r}")
        self.on_peer_failure = on_dead
        self.ll_flag, self.capturable = ll_flag, bool(capturable)
        self.timeout_s = validate.seconds("timeout_s", timeout_s)
        construct_s = construction_s(self.timeout_s)
        # Slow where this host never compiled the halves: before the ranks meet. Waiting for another
        # process's compile counts against construction's deadline while that compile shows no progress.
        warm_ups = needed(protocol, bool(low_latency), workers)
        self.engine, self._engine_reason = ready_engine(engine, warm_ups, time.monotonic() + construct_s)
        joining = group if isinstance(group, Rejoining) else None  # `Buffer.rejoin`: its stages noted
        if joining is not None:
            joining.stamp("kernels")
        with collective_deadline(torch_group(group), construct_s, "Buffer construction (joining the group)"):
            self._info: GroupInfo = join_group(group)
        self._faults = FaultPoints(faults, self._info.rank)
        R = self._info.world_size
        placement = ExpertPlacement.given(expert_placement, num_experts, R)
        self.sizing = Sizing(
            hidden=hidden, capacity=max_tokens_per_rank, max_topk=max_topk, placement=placement
        )
        self.protocol = protocol
        self.low_latency = bool(low_latency)
        self.workers, self.schedule = workers, schedule
        self.racks = racks
        self.transport, self._transport_reason = choose_transport(transport, self._info)
        on_gpu = registry.TRANSPORTS[self.transport].on_device
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else CPU
        if on_gpu and engine == registry.AUTO:  # GPU memory: the kernels that run on it
            self.engine, self._engine_reason = ready_engine(registry.TRITON.name)
        ep_group, peers = torch_group(self._info.group), self._info.peers
        with collective_deadline(ep_group, construct_s, "Buffer construction", peers, watch=True):
            self._handshake(transport)
            if joining is not None:
                joining.stamp("options")
            options = Options(
                transport=self.transport,
                protocol=self.protocol,
                low_latency=self.low_latency,
                timeout_s=self.timeout_s,
                workers=workers,
                schedule=schedule,
                ll_flag=ll_flag,
                capturable=self.capturable,
                fabric=fabric,
                racks=racks,
            )
            exchanges = build(self._info, self.sizing, options, self.engine, self._faults)
            self._exchange: Exchange | None = exchanges[0]
            self._ll: LowLatencyExchange | None = exchanges[1]
            if joining is not None:
                joining.stamp("exchange")
        self._recorder: Recorder | None = None
        if stats or log.isEnabledFor(logging.DEBUG):  # the debug line per call comes from the recorder
            self._record(StatsOptions() if isinstance(stats, bool) else stats, log)
        # Low-latency calls go to compiled halves that check input values and route themselves, so the
        # host reads none and builds no plan (not when stats are recorded: the recorder reads the plans).
        self._ll_routed = self._recorder is None and self._ll is not None and self._ll.routes_in_halves
        if log.isEnabledFor(logging.INFO):
            log.info("Buffer built: %s", self.explain())
        self._timers = CallTimers() if call_timers else None  # the blocks of every call (`ubep.timers`)
        self._calls = CallCounter(timers=self._timers)
        self._pid = os.getpid()  # the process that built it: a forked child must not call it
        self._one_call = threading.Lock()  # held by the thread inside a call (`_one_at_a_time`)
        self._unfinished = None  # the low-latency combine whose receive half is under way (`_finish_combine`)
        self._done = EventOverlap()  # the event of every call that completed before returning
        self._membership = Membership(self.rank, placement, self.device)  # ranks left out (`mask_ranks`)
        # logical experts on the slots (`set_placement`), each mapped to its nearest live copy
        self._slots = PlacedSlots(placement, self.rank, self._info.node_of_rank)
        self._plans = Planner(
            self.sizing,
            self.device,
            route=self.engine.route,
            engine=self.engine,
            layout_by_send=self._exchange.layout_by_send,
            capturable=self.capturable,
            membership=self._membership,
            slots=self._slots,
        )
        if joining is not None:  # taken in at the staying ranks' next dispatch
            try:
                self._membership.join(self._exchange, self._ll, self._calls, construct_s, joining.stamp)
                self._follow_membership()
            except BaseException:
                self.close()
                raise

    @classmethod
    def rejoin(cls, rank: int, world_size: int, *, store: dist.Store | None = None, **options) -> Buffer:
        """Restart rank `rank` of a running `world_size`-rank group on this host (transport "shm")
        whose ranks masked it: a process started in place of a dead one (a plain restart with the
        same RANK, or torchrun's agent restarting it) calls this with the options every rank built
        its Buffer with (`options`: hidden, num_experts, ... as `Buffer`), instead of constructing.

        It needs no process group: it finds the staying ranks through the job's rendezvous `store`
        (default: a client of MASTER_ADDR:MASTER_PORT, where torchrun's agent or the launcher keeps
        it), maps their segments through the files a live rank holds open, takes this rank's segment
        over emptied, and waits (up to the construction deadline) until the staying ranks take it in
        at the start of a dispatch they agree on. Its first call must be that dispatch (normal or
        low-latency); the staying ranks' handles from before are refused. docs/reliability.md.
        """
        return cls(Rejoining.of(rank, world_size, store), **options)

    # -- construction -----------------------------------------------------------------------------

    def _handshake(self, requested_transport: str) -> None:
        """Every rank checks that every rank built the same Buffer; a mismatch raises everywhere."""
        mine = {
            "version": VERSION,
            "hidden": self.sizing.hidden,
            "num_experts": self.sizing.placement.num_experts,
            "max_tokens_per_rank": self.sizing.capacity,
            "max_topk": self.sizing.max_topk,
            "protocol": self.protocol,
            "transport": requested_transport,
            "fabric": self._settings["fabric"].value,  # a rank on another engine would wait for ever
            "racks": self.racks,  # the tiers' rails
            "expert_placement": self.sizing.placement.rank_of_expert_E.tolist(),
            "low_latency": self.low_latency,
            "ll_flag": self.ll_flag,  # the slots' layout
            # where a low-latency dispatch's rows wait: put into the receivers' slots (the Triton
            # halves), or staged in the sender's own (the CPU forms, `ubep.protocols.ll.exchange`)
            "ll_rows": "put" if registry.ENGINES[self.engine.name].device_kernels else "staged",
        }
        check_agreement(self._info, mine, "Buffer")
        if self.transport == registry.SHM.name:
            keep_agreed(self._info, mine, "Buffer")  # what a rank that rejoins checks its own against

    size_hint = staticmethod(size_hint)  # the shared memory a Buffer would map, before building it

    def explain(self) -> str:
        """Which transport, protocol and engine run here, and why; where each setting came from.
        One line per topic, each setting on a line of its own."""
        origin = self.engine.kernels_origin()  # the numba engine's: cached or compiled
        kernels = f"; kernels {origin}" if origin is not None else ""
        lines = [
            f"rank {self._info.rank}/{self._info.world_size}: protocol {self._exchange_name()}",
            f"  transport {self.transport} ({self._transport_reason})",
            f"  engine {self.engine.name} ({self._engine_reason}){kernels}",
            f"  call halves {self._exchange.halves}",
            *(
                [f"  low-latency halves {self._ll.halves}"]
                if self._ll is not None and self._ll.halves
                else []
            ),
            "  settings (each value and where it came from):",
            *(f"    {name} {setting}" for name, setting in self._settings.items()),
        ]
        return "\n".join(lines)

    # -- observability ----------------------------------------------------------------------------

    def _record(self, options: StatsOptions, log) -> None:
        """Put a recorder between this Buffer and its exchanges (`ubep.observe.recording`)."""
        rec = Recorder(self.rank, self.num_ranks, self.num_experts, options, log)
        self._recorder = rec
        self._exchange = RecordedExchange(self._exchange, rec)
        if self._ll is not None:
            self._ll = RecordedLowLatency(self._ll, rec)

    def stats(self, merge: bool = False) -> Stats:
        """What this Buffer's calls did so far: traffic, expert load, times, the recent calls
        (`ubep.stats.Stats`). With `merge`, every rank's, on every rank: a collective, so every
        rank must call it at the same point between calls; it keeps the Buffer's deadline and names
        a stopped or dead peer as calls do. Needs `stats=True` (or UBEP_STATS=1)."""
        if self._recorder is None:
            raise RuntimeError("this Buffer records no stats: build it with stats=True, or set UBEP_STATS=1")
        mine = self._recorder.snapshot()
        if not merge or self.num_ranks == 1:
            return mine
        group, peers = torch_group(self._info.group), self._info.peers
        with collective_deadline(group, self.timeout_s, "stats (merge)", peers):  # as calls wait, and blame
            return Stats.combine_ranks(all_gather_object(self._info, mine))

    @property
    def call_timers(self) -> CallTimers | None:
        """Where this Buffer's calls spent their time, block by block (`ubep.timers`);
        None unless built with call_timers=True (or UBEP_CALL_TIMERS=1)."""
        return self._timers

    def _exchange_name(self) -> str:
        across = self._exchange.across_hosts  # what crosses hosts, and how
        return self._exchange.name if across is None else f"{self.protocol} ({across})"

    @property
    def rank(self) -> int:
        return self._info.rank

    @property
    def num_ranks(self) -> int:
        return self._info.world_size

    @property
    def num_experts(self) -> int:
        return self.sizing.placement.num_experts

    @property
    def placement(self) -> Placement | None:
        """The logical experts on this Buffer's slots (`set_placement`), or None: ids are the slots'."""
        return self._slots.placement

    @_one_at_a_time
    def set_placement(self, placement: Placement | None) -> None:
        """Hold `placement`'s logical experts on this Buffer's num_experts slots from the next call on;
        collective: every rank passes the same placement, else ConfigMismatchError on every rank.

        With a placement, topk_idx holds logical ids in [0, placement.num_logical): each rank maps
        them to the nearest copy (the same rank, then the same node, then the rest, shared evenly
        among equally near copies; `ubep.placement.CopyMap`) before dispatching, so recv_topk_idx
        names local slots (`placement.local_logical(rank)` says which expert each holds) and
        combine sums what the logical routing would. None returns to physical ids. Moving the
        expert weights is the caller's (docs/placement.md); a cached dispatch with the handle of a
        dispatch from before a change is refused (ValueError, on every rank alike). Once ranks are
        masked, the staying ranks agree through the exchange, as a mask does (the masked ones take no
        part), and the placement must give every logical expert a copy on a staying rank (ValueError);
        the masked ranks' slots are never chosen.
        """
        exchange = self._live()
        self._slots.check(placement)
        if self._membership.masked:
            self._agree_among_staying(exchange, placement)
        else:
            mine = {"placement": None if placement is None else placement.digest()}
            group, peers = torch_group(self._info.group), self._info.peers  # peers: a dead one is named
            with collective_deadline(group, self.timeout_s, "set_placement", peers):
                check_agreement(self._info, mine, "set_placement")
        self._slots.hold(placement, self._calls.seq)

    def _agree_among_staying(self, exchange: Exchange, placement: Placement | None) -> None:
        """set_placement's agreement after a mask: every staying rank's placement fingerprint through
        the exchange, within the deadline; ConfigMismatchError on every staying rank where they differ,
        ValueError on every one where the placement needs a masked rank."""
        word = PlacedSlots.fingerprint(placement)
        theirs = exchange.agree(word, "set_placement")
        differ = sorted(r for r, w in theirs.items() if w != word)
        if differ:
            raise ConfigMismatchError(
                f"set_placement: rank {self.rank}'s placement ({self._slots.describe(placement)}) differs "
                f"from that of rank(s) {differ}; every staying rank must pass the same placement"
            )
        self._slots.check_live(placement)

    # -- normal mode ------------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> LayoutResult:
        """Counts per rank and expert and the token-to-rank membership of one rank's routing, computed
        on the Buffer's device. With `capturable`, topk_idx's values are not checked here, so nothing
        is read back on the host (dispatch's kernel checks them; ids outside [-1, num_experts) count
        as no expert here); otherwise a bad value raises ValueError."""
        self._slots.check_num_experts(num_experts)
        idx = self._slots.physical(topk_idx)
        E, K = self.num_experts, self.sizing.max_topk
        idx = validate.topk_idx(idx, _rows(idx), E, K, values=not self.capturable, device=self.device)
        layout = dispatch_layout(self._membership.drop(idx, count=False)[0], self._plans.device_placement)
        return LayoutResult(
            layout.num_tokens_per_rank_R,
            None
            if self._info.num_nodes == 1
            else tokens_per_node(layout.is_token_in_rank_NR, self._info.node_of_rank),
            layout.num_tokens_per_expert_E,
            layout.is_token_in_rank_NR,
            EventOverlap(),
        )

    @_one_at_a_time
    @_finished_by_the_rest
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchResult:
        """Send each token once to every rank that owns one of its experts.

        With `handle` (cached dispatch), repeat that dispatch's routing for new x;
        recv_topk_idx and recv_topk_weights are then None. x may be an FP8 pair
        `(values e4m3 [N, H], scales float32 [N, H // 128])`; recv_x is then a pair too.
        `num_worst_tokens` > 0 (as DeepEP): every output has that many rows, the rows
        received first, then padding (recv_x 0, recv_topk_idx -1, weights 0), and
        num_recv_tokens_per_expert_list is empty; on the Triton halves the receive size is
        then known without a host read. A cached dispatch pads as its handle's did.
        """
        exchange, faults = self._live(), self._faults
        if self._membership.masked:  # restarted ranks come back only while ranks are masked
            self._admit(exchange, self._ll, boundary=handle is None)
        call = self._calls.next("dispatch")
        times = call.timers
        try:
            plan, dropped = self._plans.dispatch(
                x, handle, num_tokens_per_rank, is_token_in_rank, topk_idx, topk_weights, num_worst_tokens
            )
            if type(expert_alignment) is not int or expert_alignment < 1:
                validate.positive("expert_alignment", expert_alignment)
            worst = handle.padded_to if handle is not None else num_worst_tokens
            if faults.armed:
                faults.at("dispatch.start", call)
            if times is not None:
                times.lap("validate")
            got = exchange.dispatch(call, plan, handle)
            if times is not None:
                times.lap("between")  # the exchange's Python after its last half
            if worst:
                got = got.padded(worst)
        except BaseException:
            exchange.abort(call)  # the peers fail at once instead of at their deadline
            raise
        if faults.armed:
            faults.at("dispatch.end", call)
        recv_x = got.recv_x_MH if got.recv_scales_MS is None else (got.recv_x_MH, got.recv_scales_MS)
        if handle is None:
            handle = self._plans.handle(plan, got, dropped, call.seq, worst, expert_alignment)
        result = DispatchResult(
            recv_x,
            got.recv_topk_idx_MK,
            got.recv_topk_weights_MK,
            list(handle.num_recv_tokens_per_expert_list),
            handle,
            self._done,
        )
        if times is not None:
            times.end()
        return result

    @_one_at_a_time
    @_finished_by_the_rest
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        config=None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> CombineResult:
        """Send expert outputs home; each token gets the plain float32 sum of its rows."""
        exchange, faults = self._live(), self._faults
        if self._membership.masked:  # restarted ranks come back only while ranks are masked
            self._admit(exchange, self._ll, boundary=False)
        call = self._calls.next("combine")
        times = call.timers
        try:
            x, topk_weights, handle = self._plans.combine(x, handle, topk_weights)
            if faults.armed:
                faults.at("combine.start", call)
            if times is not None:
                times.lap("validate")
            combined, weights = exchange.combine(call, x, handle, topk_weights)
            if times is not None:
                times.lap("between")  # the exchange's Python after its last half
        except BaseException:
            exchange.abort(call)  # the peers fail at once instead of at their deadline
            raise
        result = CombineResult(combined, weights, self._done)
        if times is not None:
            times.end()
        return result

    # -- low-latency mode -------------------------------------------------------------------------

    @_one_at_a_time
    @_finished_by_the_rest
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        use_fp8: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> LowLatencyDispatchResult:
        """Send one row per (token, selected expert) pair; receive them expert-major, fixed shape.

        recv_x is [L, R * T, H] (T = num_max_dispatch_tokens_per_rank; with use_fp8, a pair
        (values e4m3, scales float32 [L, R * T, H // 128])); rows [0, recv_count[j]) of local
        expert j are valid, by source rank, then source token. With `return_recv_hook`
        only the send half runs now and `hook()` runs the receive half, filling recv_x,
        recv_count and the handle in place; with `async_finish`, `event.wait()` does.
        At most two calls may await their receive half. N > T raises ValueError before
        anything is sent.
        """
        ll = self._live_ll()
        if self._membership.masked:  # restarted ranks come back only while ranks are masked
            self._admit(self._live(), ll, boundary=True)
        call = self._calls.next("ll_dispatch")
        times = call.timers
        try:
            plan, out = self._plans.ll_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, self._ll_routed, call.seq
            )
        except BaseException:
            ll.abort(call, "dispatch")  # its slots and headers are its own: release them, tell the peers
            raise
        if times is not None:
            times.lap("validate")
        receive = received(out, ll.dispatch_send(call, plan, out))  # a failing send half tells its peers
        event, hook = receive_later(
            self._later(call, receive, async_finish or return_recv_hook), async_finish, return_recv_hook
        )
        result = LowLatencyDispatchResult(out.recv_x, out.recv_count_L, out.handle, event, hook)
        if times is not None:
            times.end()
        return result

    @_one_at_a_time
    @_finished_by_the_rest
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ) -> LowLatencyCombineResult:
        """Send expert outputs home; combined_x[t] = sum_k topk_weights[t, k] * y(t, k) (float32 sums).

        x is [L, R * T, H] (bf16 or fp32), row for row what the dispatch delivered;
        topk_idx and topk_weights are the home rank's routing, as dispatched. The
        result has x's dtype; `out` [N, H] receives it in place when given.
        """
        ll = self._live_ll()
        if self._membership.masked:  # restarted ranks come back only while ranks are masked
            self._admit(self._live(), ll, boundary=False)
        call = self._calls.next("ll_combine")
        times = call.timers
        try:
            got = self._plans.ll_combine(x, topk_idx, topk_weights, handle, out, self._ll_routed)
        except BaseException:
            ll.abort(call, "combine")  # its slots and headers are its own: release them, tell the peers
            raise
        if times is not None:
            times.lap("validate")
        if got.plan is None:  # the send half checks the handle and topk_idx's values, and routes
            receive = ll.combine_rows(
                call, got.x, got.topk_weights_NK, got.handle, got.out_NH, got.topk_idx_NK
            )
        else:
            receive = ll.combine_send(call, got.plan, got.out_NH)
        if not (async_finish or return_recv_hook):  # a peer's failure in it: finished in place, maybe
            self._unfinished = functools.partial(
                self._finish_combine, call, x, topk_idx, topk_weights, handle, out
            )
        event, hook = receive_later(
            self._later(call, receive, async_finish or return_recv_hook), async_finish, return_recv_hook
        )
        self._unfinished = None  # received: nothing of its inputs is held longer
        result = LowLatencyCombineResult(got.out_NH, event, hook)
        if times is not None:
            times.end()
        return result

    def _finish_combine(
        self, call: CallId, x, topk_idx, topk_weights, handle, out
    ) -> LowLatencyCombineResult:
        """Low-latency combine `call`, whose receive half failed on a peer that the staying ranks have
        masked since, while some of them completed the call (`Membership.mask_failed`'s FINISH): its
        receive half again, over the rows every staying rank put, the masked ranks' entries left
        out as `left_out` says (its inputs taken again, as a call after the mask takes them)."""
        got = self._plans.ll_combine(x, topk_idx, topk_weights, handle, out, self._ll_routed)
        try:
            event, hook = receive_later(lambda: self._ll.finish_combine(call, got), False, False)
        finally:
            self._ll.resume(self._membership.after)  # the half it released serves the calls after the mask
        return LowLatencyCombineResult(got.out_NH, event, hook)

    def check(self) -> None:
        """Raise the first error the device recorded in calls since the last check, normal mode's first
        (with `capturable`, where calls read nothing back on the host; a no-op otherwise): a bad topk_idx
        value (ValueError, as on the host), a peer's bad data or rejection, or a wait that ran out of
        polls (CommTimeoutError). Reads the device's status words: call it outside a captured graph."""
        self._live().check()
        if self._ll is not None:
            self._ll.check()

    def _later(self, call: CallId, receive, deferred: bool):
        """The receive half, refused like a call while another thread is inside one when it runs later,
        or when ranks were masked since `call` sent."""
        return functools.partial(_receive_half, self, call, receive) if deferred else receive

    def _live_ll(self) -> LowLatencyExchange:
        if self._ll is None or self._exchange is None or self._membership.retired or os.getpid() != self._pid:
            self._live()  # closed, retired or forked: its error
        if self._ll is None:
            raise ValueError(
                "this Buffer was built without low-latency slots (low_latency=False, the default); "
                "build it with low_latency=True for low_latency_dispatch and low_latency_combine"
            )
        return self._ll

    # -- shrinking around dead ranks ---------------------------------------------------------------

    def _admit(self, exchange: Exchange, low_latency: LowLatencyExchange | None, boundary: bool) -> None:
        """A call's start: take restarted ranks back in where the staying ranks agreed to
        (`Membership.admit`), and route to their copies again."""
        if self._membership.admit(exchange, low_latency, self._calls, boundary):
            self._follow_membership()

    def _follow_membership(self) -> None:
        """Map logical experts to copies on the ranks in, from the call after the latest change on."""
        m = self._membership
        self._slots.leave_out(m.masked, m.after, m.stale_after)

    @_one_at_a_time
    def mask_ranks(self, ranks: Iterable[int]) -> None:
        """Leave `ranks` out of every later call (shrink around dead ranks); collective among the rest.

        Call it on every rank that stays, with the same ranks, after a call failed naming them
        (`CommTimeoutError.dead_peers`, or the rank a `PeerAbortedError` blames). The staying
        ranks agree on the call to resume from, so it does not matter at which call each of them
        failed. Later dispatches drop the top-k entries that select a masked rank's experts
        (`handle.num_dropped` counts them on the tokens' rank) and combine sums the rest;
        handles from before the mask are refused, and a low-latency receive half still pending
        from before it must not be run. A rank that masks itself leaves: its Buffer takes no
        further call. Ranks that would keep no quorum of the ranks in (a strict majority, or exactly
        half with the lowest) raise PartitionError instead, and take no further call: a split
        never leaves two groups going on. With a placement, later calls send each logical expert's
        pairs to a copy on a staying rank. Needs a shared-heap transport ("shm", "virtual"),
        protocol ubep over the fabric ("dist"), or "hier" where whole nodes are masked (one rank
        of a node whose other ranks stay: NotImplementedError naming it).
        """
        self._membership.mask(ranks, self._live(), self._ll, self._calls)
        self._follow_membership()

    def left_out(
        self, topk_idx: torch.Tensor, handle: DispatchHandle | LowLatencyHandle | None = None
    ) -> torch.Tensor:
        """bool [N, K]: the entries of a call's `topk_idx` (int64 [N, K], as passed to it) left out
        because their expert's rank is masked: dispatch sent those tokens no row there, and combine
        summed nothing from there. Ask after the call (a call that met a dead peer under
        on_peer_failure="mask" masked it inside), before the next. For a combine, pass its `handle`:
        the entries are then mapped to copies as that handle's dispatch mapped them, so a rank masked
        inside the combine counts for the rows its dispatch had sent there (no live copy can take
        rows already sent)."""
        E, K = self.num_experts, self.sizing.max_topk
        idx = validate.topk_idx(topk_idx, _rows(topk_idx), E, K, device=self.device)
        slots = self._slots.physical(idx) if handle is None else self._slots.physical_at(idx, handle.seq)
        return self._membership.left_out(slots)

    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """Ranks left out of every call (`mask_ranks`), ascending."""
        return tuple(sorted(self._membership.masked))

    # -- lifetime ---------------------------------------------------------------------------------

    def _live(self) -> Exchange:
        if self._exchange is None:
            raise RuntimeError("this Buffer is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this Buffer was built by process {self._pid}; process {os.getpid()} (a fork of it) may not "
                "call it, since its memory is shared with the parent's peers: build a Buffer in the child"
            )
        if self._membership.retired:
            raise RuntimeError(f"rank {self.rank} {self._membership.retired_as}: it takes part in no call")
        return self._exchange

    def close(self) -> None:
        """Release every shared resource; idempotent."""
        self._ll = None
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.close()
        # No reference to the process group may outlive the Buffer: `destroy_process_group` frees a
        # gloo group only when its last reference goes, and one freed in the interpreter's teardown
        # (a Buffer kept alive by a reference cycle until then) can abort the process at exit.
        if getattr(self, "_info", None) is not None:
            self._info = dataclasses.replace(self._info, group=None)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rows(t) -> int:
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() >= 1 else 0

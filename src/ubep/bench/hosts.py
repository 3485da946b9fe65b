"""The bench's ranks on namespace hosts: `ubep bench --hosts N`.

    bench (root namespace)                scripts/netns_hosts.sh -n N
      conductor's pipes (files) <------>    namespace host 0: torchrun -> ranks 0..P-1
                                            namespace host 1: torchrun -> ranks P..2P-1 ...

Each host has its own network stack (veth on a bridge, shaped by the script), so traffic between
hosts crosses a real link; the turns' named pipes and the monotonic clock are shared by every
namespace, so turns and timing work as for emulated nodes. Each rank runs `ubep.bench.host_rank`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from ubep.bench.turns import Samples
from ubep.bench.workload import BenchConfig

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "netns_hosts.sh"  # in a source checkout
STOP_S = 20.0  # how long the hosts get to end after QUIT, and again after SIGTERM
# The delay of a link between namespace hosts where the kernel has netem: a switch hop and the
# kernel's TCP stack, one way (its rate is the bench's --link-rate, `BenchConfig.link_rate`).
LINK_DELAY = "15us"


class Namespaces(NamedTuple):
    """Whether namespace hosts can be made here, why (or why not), and whether the kernel has netem
    (the links then get LINK_DELAY as well as their rate; without it a token bucket keeps the rate)."""

    ok: bool
    why: str
    netem: bool = False


def namespaces_available(script: Path = SCRIPT) -> Namespaces:
    """Whether namespace hosts can be made here, and if not, why (a probe namespace is made and removed)."""
    if not script.exists():
        return Namespaces(False, f"{script} not found (it comes with ubep's source checkout)")
    if os.geteuid() != 0:
        return Namespaces(False, "network namespaces need root")
    for command, what in (("ip", "namespaces and links"), ("tc", "the link's rate and delay")):
        if shutil.which(command) is None:  # tc lives in sbin, which a plain user's PATH may leave out
            return Namespaces(False, f"no `{command}` command on PATH (iproute2; {what})")
    probe = f"ubep-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return Namespaces(False, f"`ip netns add` failed: {_last_line(made.stderr) or made.returncode}")
    try:
        shaped, said = _shape_probe(probe)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    if shaped is None:
        return Namespaces(False, f"`tc` cannot shape a link here ({said})")
    return Namespaces(True, "root, and `ip netns` and `tc` work", netem=shaped == "netem")


def _shape_probe(namespace: str) -> tuple[str | None, str]:
    """Shape the probe namespace's lo as the script shapes each host's link (netem, else tbf): the
    qdisc that worked, else None and what `tc` said (a `tc` on PATH may still fail: a wrapper, no
    qdisc modules)."""
    said = ""
    tries = (["netem", "delay", LINK_DELAY], ["tbf", "rate", "1gbit", "burst", "250000", "latency", "10ms"])
    for qdisc in tries:
        command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return qdisc[0], ""
        said = _last_line(done.stderr) or f"exit {done.returncode}"
    return None, said


class Link(NamedTuple):
    """The link between two namespace hosts, as the script makes it: `rate` in tc's units (1gbit),
    that rate in bytes per second, the token bucket's burst in bytes (None under netem, which paces
    each packet), and the delay one way (None: the kernel has no netem, so none is added); with
    racks, each rack's uplink: its rate, in bytes per second, and its token bucket's burst."""

    rate: str
    bytes_per_s: int
    burst_bytes: int | None
    delay: str | None
    racks: int = 1
    rack_rate: str | None = None
    rack_bytes_per_s: int | None = None
    rack_burst_bytes: int | None = None

    def note(self, hosts: int) -> str:
        """What the links are, for the notes under the bench's table."""
        if self.delay is not None:
            said = f"links between the {hosts} hosts: {self.rate}, {self.delay} one way (tc netem)"
        else:
            said = (
                f"links between the {hosts} hosts: {self.rate} by a token bucket (tc tbf, burst "
                f"{self.burst_bytes} bytes); no delay: kernel has no netem"
            )
        if self.racks > 1:
            said += (
                f"; {self.racks} racks of {hosts // self.racks} hosts, each rack's uplink {self.rack_rate} "
                f"each way (tc tbf, burst {self.rack_burst_bytes} bytes)"
            )
        return said


def link_of(rate: str, netem: bool, script: Path = SCRIPT, racks: int = 1, rack_rate: str = "") -> Link:
    """The link the script makes at `rate` (its sizing, asked with -s: nothing is made), with
    LINK_DELAY where the kernel has netem, and with `racks` > 1 the racks' uplinks at `rack_rate`.
    Raises ValueError with the script's reason for a rate it refuses."""
    uplinks = ["-u", rack_rate] if racks > 1 else []
    said = subprocess.run(
        ["bash", str(script), "-r", rate, *uplinks, "-s"], capture_output=True, text=True, timeout=30
    )
    if said.returncode != 0:
        raise ValueError(_last_line(said.stderr) or f"{script} -s exited {said.returncode}")
    sizing = dict(word.split("=", 1) for word in said.stdout.split())
    rack = (racks, rack_rate, int(sizing["rack_bytes_per_s"]), int(sizing["rack_burst"])) if racks > 1 else ()
    if netem:
        return Link(rate, int(sizing["bytes_per_s"]), None, LINK_DELAY, *rack)
    return Link(rate, int(sizing["bytes_per_s"]), int(sizing["burst"]), None, *rack)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class HostsFailedError(RuntimeError):
    """The namespace hosts' script ended early; `tail` is the end of what it printed."""

    def __init__(self, exit_code: int | None, tail: str):
        self.exit_code, self.tail = exit_code, tail
        super().__init__(f"namespace hosts failed (exit {exit_code}):\n{tail}")

    def line(self) -> str:
        """The failure in one line: the exit status and the last line the hosts printed."""
        return f"namespace hosts failed (exit {self.exit_code}): {_last_line(self.tail) or 'no output'}"


def hosts_command(cfg: BenchConfig, job: list[str]) -> list[str]:
    """The script, one torchrun agent per host, this module as every rank running `job` (`main`'s
    arguments)."""
    racks = ["-R", str(cfg.racks), "-u", cfg.rack_link_rate] if cfg.racks > 1 else []
    return [
        str(SCRIPT), "-n", str(cfg.nodes), "-r", cfg.link_rate, "-d", LINK_DELAY, *racks, "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.ranks // cfg.nodes),
        "-m", "ubep.bench.host_rank", *job,
    ]  # fmt: skip


def measure_job(cfg: BenchConfig, tokens: int, systems: tuple[str, ...], turns_dir: str) -> list[str]:
    """Every rank measures `systems` at `tokens`, taking turns through `turns_dir` (`HostsGroup`)."""
    return ["measure", json.dumps(cfg.as_dict()), str(tokens), ",".join(systems), turns_dir]


def profile_on_hosts(cfg: BenchConfig, tokens: int, calls: int, name: str) -> list[dict]:
    """Every rank's `ubep.bench.profile.profile_rank` of row `name`, run on cfg.nodes namespace hosts,
    in rank order. Raises HostsFailedError with the end of the hosts' output if they fail."""
    with tempfile.TemporaryDirectory(prefix="ubep-profile-") as out_dir:
        job = ["profile", json.dumps(cfg.as_dict()), str(tokens), f"{calls},{name}", out_dir]
        with open(os.path.join(out_dir, "hosts.out"), "w+") as out:
            proc = subprocess.Popen(hosts_command(cfg, job), stdout=out, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=cfg.timeout_s * 4)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                stop_hosts(proc)  # the script removes its namespaces on SIGTERM
                out.seek(0)
                raise HostsFailedError(code, out.read()[-3000:])
        return [_load(os.path.join(out_dir, f"result.{rank}.json")) for rank in range(cfg.ranks)]


def stop_hosts(proc: subprocess.Popen) -> None:
    """Let the hosts' script end, else SIGTERM it (it stops their processes and removes the
    namespaces), then SIGKILL."""
    for end in (lambda: None, proc.terminate, proc.kill):
        end()
        try:
            proc.wait(timeout=STOP_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _load(path: str) -> dict:
    """A rank's result file (`main`)."""
    with open(path) as f:
        return json.load(f)


class HostsGroup:
    """The launch group's systems, their ranks on namespace hosts; output kept in `turns_dir`."""

    def __init__(self, cfg: BenchConfig, tokens: int, systems: tuple[str, ...], turns_dir: str):
        self._dir, self._ranks = turns_dir, cfg.ranks
        self._out = open(os.path.join(turns_dir, "hosts.out"), "w+")
        self._proc = subprocess.Popen(
            hosts_command(cfg, measure_job(cfg, tokens, systems, turns_dir)),
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        self._timeout_s = cfg.timeout_s * 3

    def check(self) -> None:
        """Raise the hosts' error if they have ended (called while they should still be taking turns)."""
        if self._proc.poll() is not None:
            raise self._failure()

    def finish(self) -> list[Samples]:
        """After QUIT: every rank's samples, in rank order."""
        if self._proc.wait(timeout=self._timeout_s) != 0:
            raise self._failure()
        return [_load(os.path.join(self._dir, f"result.{rank}.json")) for rank in range(self._ranks)]

    def stop(self) -> None:
        """Let the hosts end (`stop_hosts`), then close their output."""
        stop_hosts(self._proc)
        self._out.close()

    def _failure(self) -> HostsFailedError:
        self._out.seek(0)
        return HostsFailedError(self._proc.returncode, self._out.read()[-3000:])

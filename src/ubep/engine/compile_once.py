"""Compiling the numba kernels once per host: one process compiles, the others wait, then load.

    ready_engine -> [once_per_host(warm-up)] -> numba's disk cache (`cache=True`)

numba compiles a function on its first call in a process, or loads it from its disk
cache. Rank processes started together would each compile the same functions at the
same time (8 ranks on 2 cores: minutes). So a warm-up (a named set of calls: the
engine's kernels, one protocol's normal-mode halves, the low-latency halves) runs under
an exclusive lock (`fcntl.flock`) on a file in the cache directory, one process at a
time; once it has run, it leaves a marker naming the warm-up and the sources it was
compiled from, and later processes run that warm-up without the lock, loading side by
side. A process that finds the lock held waits (and says so), then loads what the holder
compiled. The wait counts against the waiter's construction deadline for as long as the
holder shows no heartbeat (it touches the lock file every HEARTBEAT_S): a stopped or hung
holder ends the wait at the deadline, a slow compile on a loaded host does not.

Example (4 ranks, empty cache, warm-ups "engine" and "ubep"): rank 2 takes the lock and
compiles both (20 s, one INFO line while it does); ranks 0, 1 and 3 wait (one line each),
then each takes the lock in turn, finds the markers, lets go of it and loads (milliseconds).
The next job finds every marker and loads without the lock, all ranks at once.

A warm-up that only checks what was compiled (the engine's examples: `checks`) runs where
it compiles, not in every process: the code it checked is what the cache holds. Instead, one
process per host reads every cache file back (about 10 ms) under the lock whenever the files
changed since they were last read (a listing of their sizes and times, `ubep-checked-*.json`),
so a damaged file is still found before any call; every other process compares the listing
(a stat per file, about a millisecond) and trusts it. A Buffer on a warm cache so loads only
its halves (issue 42, item 8).

A cache file numba cannot read (a damaged index or data file: a full disk, an interrupted
copy) raises inside numba on the kernel's first call (UnpicklingError, EOFError), or fails
that read-back. Such a file is removed, with a WARNING naming it, and the warm-ups run again
under the lock, so that numba compiles that kernel afresh and writes a good file; so does a
file gone since the listing. A file that cannot be removed, or fails again, raises
CorruptCacheError naming it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType

import numba
from numba.core import caching, config, event
from numba.core.dispatcher import Dispatcher

from ubep.engine import NUMBA_MODULES, collections_paused, numba_kernels
from ubep.errors import CompileWaitTimeoutError, CorruptCacheError

log = logging.getLogger("ubep")  # `ubep.settings.LOGGER`, which imports the engines

LOCK_FILE = "ubep-compile.lock"
ANNOUNCE_S = 1.5  # a compile (or a wait for one) that lasts longer is logged at INFO while it lasts
POLL_S = 0.05  # how often a waiting process tries the lock
HEARTBEAT_S = 1.0  # how often the holder touches the lock file: a waiter's sign that it is compiling


@dataclass(frozen=True, slots=True)
class CacheLocation:
    """Where numba keeps ubep's compiled code (None: no writable directory, so every process
    compiles), and why there when it is not where it was asked for ("" otherwise)."""

    path: str | None
    note: str


def cache_location() -> CacheLocation:
    """Where the kernels are cached, with a note when numba fell back from a read-only directory."""
    path = numba_kernels.cache_dir(numba_kernels.copy_rows)
    if path is None:
        return CacheLocation(None, "no writable cache directory: every process compiles its own kernels")
    locator = numba_kernels.copy_rows._cache._impl.locator
    if config.CACHE_DIR and not isinstance(locator, caching.UserProvidedCacheLocator):
        return CacheLocation(path, f"NUMBA_CACHE_DIR={config.CACHE_DIR} is not writable: using {path}")
    if isinstance(locator, caching.UserWideCacheLocator):
        here = os.path.dirname(numba_kernels.__file__)
        return CacheLocation(path, f"{here} is read-only: using the user cache directory {path}")
    return CacheLocation(path, "")


def once_per_host(
    warm_ups: Mapping[str, Callable[[], None]],
    deadline: float | None = None,
    checks: Mapping[str, Callable[[], None]] = MappingProxyType({}),
) -> None:
    """Run each warm-up (by name), compiling what it needs at most once on this host (see the
    module doc): those not yet run on this host run under the lock (one INFO line if slow), the
    others after it, loading from the cache. `checks` (by name: the engine's examples) only check
    what was compiled: they run with the warm-ups that compile, and are skipped on a cache whose
    files were read back since they last changed (`_check_files`).

    `deadline` (time.monotonic) bounds the wait for another process's compile while that process
    shows no progress: CompileWaitTimeoutError past it (see `_acquire`).
    """
    location = cache_location()
    where = location.path
    if location.note:  # a fallback from a read-only directory, or no cache at all
        (log.info if where else log.warning)("numba cache: %s", location.note)
    if where is None:
        return _run([*checks.values(), *warm_ups.values()])
    fingerprint = _fingerprint()
    every = {**checks, **warm_ups}
    marker = {name: os.path.join(where, f"ubep-warm-{name}-{fingerprint}") for name in every}
    checked = os.path.join(where, f"ubep-checked-{fingerprint}.json")
    todo = [name for name in every if not os.path.exists(marker[name])]
    if todo or _read_listing(checked) != _cache_files():
        with _host_lock(where, deadline):
            listed = _read_listing(checked)
            if listed != _cache_files():  # not checked meanwhile by another process
                _check_files(listed, where, fingerprint)
            todo = [name for name in every if not os.path.exists(marker[name])]  # not compiled meanwhile
            if todo:
                names = ", ".join(todo)
                with _announced(f"compiling ubep's numba kernels ({names}) once for this host, in {where}"):
                    for name in todo:
                        _repaired(every[name])
                        with open(marker[name], "w"):
                            pass
            _write_listing(checked)
    with collections_paused():  # loads, side by side (not the compiles above: they run long)
        for name, warm in warm_ups.items():
            if name in todo:
                continue
            try:
                warm()
            except Exception as error:
                if damaged_file(error) is None:
                    raise
                with _host_lock(where, deadline):  # one process repairs; the others find it repaired
                    _repaired(warm)


def _cache_files() -> dict[str, list[int]]:
    """Every file of ubep's compiled functions in numba's cache (indices and data): [size,
    modification time in ns] by "module/file name" (a copied cache keeps its listing). A stat of
    each: about a millisecond."""
    indices: dict[tuple[str, str], set[str]] = {}  # by (module, directory)
    for module, cache in _caches():
        indices.setdefault((module, cache._cache_path), set()).add(cache._index_name.removesuffix(".nbi"))
    files = {}
    for (module, directory), names in indices.items():
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        for entry in entries:  # an index "f-192.py311.nbi", its data "f-192.py311.1.nbc", ...
            stem, suffix = entry.name[:-4], entry.name[-4:]
            index = {".nbi": stem, ".nbc": stem.rpartition(".")[0]}.get(suffix)
            if index in names:
                st = entry.stat()
                files[f"{module}/{entry.name}"] = [st.st_size, st.st_mtime_ns]
    return files


def _caches() -> Iterator[tuple[str, caching.IndexDataCacheFile]]:
    """(module, cache file) of each of ubep's compiled functions (none where numba has no cache
    directory)."""
    for module in NUMBA_MODULES:
        for attr in vars(importlib.import_module(module)).values():
            if isinstance(attr, Dispatcher) and attr.py_func.__module__ == module:
                cache = getattr(attr._cache, "_cache_file", None)
                if cache is not None:
                    yield module, cache


def _check_files(listed: dict[str, list[int]] | None, where: str, fingerprint: str) -> None:
    """Read back every file of the cache (holding the host lock: about 10 ms): a file numba could
    not read is removed (WARNING naming it; CorruptCacheError where it cannot be), and a file gone
    since `listed` (the files last checked), or named by an index but absent, is named; either way
    every warm-up's marker goes, so that the warm-ups run again and compile what is missing."""
    gone = set(listed or ()) - set(_cache_files())
    directory, unreadable = {}, []
    for module, cache in _caches():
        directory[module] = cache._cache_path
        try:
            names = cache._load_index().values()
        except Exception as error:
            unreadable.append((cache._index_path, error))
            continue
        for name in names:
            try:
                cache._load_data(name)
            except FileNotFoundError:
                gone.add(f"{module}/{name}")
            except Exception as error:
                unreadable.append((os.path.join(cache._cache_path, name), error))
    for module, _, name in sorted(key.partition("/") for key in gone):
        path = os.path.join(directory.get(module, module), name)
        log.warning("numba cache: %s is gone; compiling its kernel again", path)
    for path, error in unreadable:
        _remove_unreadable(path, f"{type(error).__name__}: {error}", error)
    if gone or unreadable:
        for name in os.listdir(where):
            if name.startswith("ubep-warm-") and name.endswith(fingerprint):
                os.remove(os.path.join(where, name))


def _read_listing(path: str) -> dict[str, list[int]] | None:
    """The cache's files as last checked (`_cache_files`), or None where never checked."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_listing(path: str) -> None:
    """Record the cache's files as checked now (written whole, then renamed: a reader sees the old
    listing or the new)."""
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
        json.dump(_cache_files(), f)
    os.replace(f.name, path)


def _run(warm_ups: Iterable[Callable[[], None]]) -> None:
    for warm in warm_ups:
        warm()


def _repaired(warm: Callable[[], None]) -> None:
    """Run `warm` (holding the host lock), removing each cache file numba fails to read, so that numba
    compiles its kernel again and writes a good one; CorruptCacheError names a file that cannot be
    removed, or that fails again once compiled afresh."""
    removed: set[str] = set()
    while True:
        try:
            warm()
            return
        except Exception as error:
            path = damaged_file(error)
            if path is None:
                raise
            why = f"{type(error).__name__}: {error}"
            if path in removed:
                raise CorruptCacheError(
                    f"numba cache: {path} cannot be read ({why}), even after it was removed and compiled "
                    "again; remove the cache directory, or point NUMBA_CACHE_DIR elsewhere",
                    path,
                ) from error
            _remove_unreadable(path, why, error)
            removed.add(path)


def _remove_unreadable(path: str, why: str, error: BaseException) -> None:
    """Remove a cache file numba cannot read (`why`), with a WARNING naming it, so that its kernel
    compiles again; CorruptCacheError where it cannot be removed."""
    log.warning("numba cache: %s cannot be read (%s); removed it, compiling that kernel again", path, why)
    try:
        os.remove(path)
    except FileNotFoundError:
        pass  # another process removed it first
    except OSError as failed:
        raise CorruptCacheError(
            f"numba cache: {path} cannot be read ({why}) nor removed ({failed.strerror}); remove "
            "it, or point NUMBA_CACHE_DIR elsewhere",
            path,
        ) from error


def damaged_file(error: BaseException) -> str | None:
    """The numba cache file (an index, or a data file) whose reading raised `error` or an exception
    it came from, found in the traceback's numba frames; None when no cache read failed."""
    seen: set[int] = set()
    at: BaseException | None = error
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        tb = at.__traceback__
        while tb is not None:
            frame, tb = tb.tb_frame, tb.tb_next
            owner = frame.f_locals.get("self")
            if isinstance(owner, caching.IndexDataCacheFile):
                if frame.f_code.co_name == "_load_index":
                    return owner._index_path
                if frame.f_code.co_name == "_load_data":
                    return frame.f_locals.get("path")
        at = at.__cause__ or at.__context__
    return None


def kernel_stats() -> dict[str, tuple[int, int]]:
    """For each of ubep's compiled functions loaded in this process, "module.name": (signatures
    compiled here, signatures loaded from the disk cache). A function compiled as part of another
    that came from the cache is in neither count."""
    stats = {}
    for module_name in NUMBA_MODULES:
        module = sys.modules.get(module_name)
        for attr in vars(module).values() if module is not None else ():
            if isinstance(attr, Dispatcher) and attr.py_func.__module__ == module_name:
                s = attr.stats
                stats[f"{module_name}.{attr.__name__}"] = (
                    sum(s.cache_misses.values()),
                    sum(s.cache_hits.values()),
                )
    return stats


@dataclass(slots=True)
class Compiles:
    """numba's compiles while counting (`counting_compiles`): `entry`, signatures called from Python
    (what a later process loads from the cache, one each), and `inner`, those compiled inside them
    (they come inside their callers' cached code, and are never loaded on their own)."""

    entry: int = 0
    inner: int = 0


@contextmanager
def counting_compiles() -> Iterator[Compiles]:
    """Count numba's compiles in this process while the block runs, as `Compiles`: so that `ubep
    warm` counts the same kernels when it compiles them as when it loads them."""
    counted, depth = Compiles(), [0]  # depth: compiles under way, the outermost first

    class Counter(event.Listener):
        def on_start(self, _: event.Event) -> None:
            if depth[0]:
                counted.inner += 1
            else:
                counted.entry += 1
            depth[0] += 1

        def on_end(self, _: event.Event) -> None:
            depth[0] -= 1

    with event.install_listener("numba:compile", Counter()):
        yield counted


def describe() -> str:
    """Whether this process's kernels came from the cache (`Buffer.explain`), and why the cache is
    where it is, if not where it was asked for."""
    compiled, loaded = (sum(n) for n in zip(*kernel_stats().values(), (0, 0), strict=True))
    origin = f"{compiled} compiled in this process, " if compiled else ""
    note = cache_location().note
    return f"{origin}{loaded} loaded from the cache" + (f" ({note})" if note else "")


def _fingerprint() -> str:
    """Names numba's version, Python's and the compiled modules' sources (size and time)."""
    parts = [numba.__version__, sys.version]
    for name in NUMBA_MODULES:
        spec = importlib.util.find_spec(name)
        st = os.stat(spec.origin) if spec is not None and spec.origin else None
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}" if st else name)
    return hashlib.sha1("\n".join(parts).encode(), usedforsecurity=False).hexdigest()[:16]


@contextmanager
def _host_lock(where: str, deadline: float | None) -> Iterator[None]:
    """Hold the host's compile lock (a file in `where`), touching the file every HEARTBEAT_S while
    held; wait for it until `deadline` (see `_acquire`)."""
    path = os.path.join(where, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    released = threading.Event()
    try:
        _acquire(fd, path, deadline)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # for the waiters' messages
        threading.Thread(target=_beat, args=(path, released), daemon=True).start()
        yield
    finally:
        released.set()
        os.close(fd)  # releases the lock


def _beat(path: str, released: threading.Event) -> None:
    """The holder's heartbeat: the lock file's time, renewed until `released`."""
    while not released.wait(HEARTBEAT_S):
        os.utime(path)


def _acquire(fd: int, path: str, deadline: float | None) -> None:
    """Take the lock; a waiter gives up (CompileWaitTimeoutError) once the holder has shown no
    heartbeat for as long as it had left until `deadline` when it began to wait."""
    start = time.monotonic()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    why = f"another process (pid {holder}) compiling ubep's numba kernels for this host ({path})"
    budget = None if deadline is None else deadline - start
    beat, seen = os.stat(path).st_mtime_ns, start
    with _announced(f"waiting for {why}; this process loads them after"):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now, last = time.monotonic(), os.stat(path).st_mtime_ns
            beat, seen = last, (now if last != beat else seen)
            if budget is not None and now - seen >= budget:
                raise CompileWaitTimeoutError(
                    f"Buffer construction: waited {now - start:.0f} s for {why}, which has shown no sign of "
                    f"progress for {budget:.0f} s (the construction deadline); run `ubep warm` once on this "
                    "host before starting the ranks, or raise timeout_s",
                    holder,
                    path,
                    now - start,
                )
            time.sleep(POLL_S)


@contextmanager
def _announced(message: str) -> Iterator[None]:
    """Log `message` at INFO if the block is still running after ANNOUNCE_S."""
    timer = threading.Timer(ANNOUNCE_S, log.info, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()

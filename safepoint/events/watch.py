"""Watch a root for commit markers: one loop, which either ingests each committed folder here or emits an event.

`Watcher` is the loop, written once: it rescans ROOT (cheap: committed folders are not descended
into), wakes on inotify where it can, hands each new marker to its sink and, every
`timeouts_every` seconds, applies multi-node timeouts (no flow has to wait for a dead node's
ranks). The sink is what differs: `IngestHere` (`safepoint watch`: ingest in this process, through
a callable the caller gives) or `Emit` (`safepoint watch --emit`: spool the marker, emit its event
and drive it to a finished ingest, see safepoint.events.markers).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config
from safepoint.core.errors import FormatError
from safepoint.core.exits import EXIT_BAD, EXIT_ERROR, EXIT_OK
from safepoint.core.format import MARKER_NAME
from safepoint.core.states import CheckpointState as CS
from safepoint.events.markers import Dispatcher, Marker, ingest_finished
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.assemble import apply_timeouts

DONE = frozenset({CS.VERIFIED, CS.CORRUPT, CS.INVALID, CS.INCOMPLETE, CS.PRUNED})


def committed_folders(root: Path) -> Iterator[Path]:
    """Folders under root holding a marker; a committed folder is not searched further."""
    for dirpath, dirnames, filenames in os.walk(root):
        if MARKER_NAME in filenames:
            dirnames.clear()
            yield Path(dirpath).resolve()
        else:
            dirnames.sort()


def marker_identity(folder: Path) -> tuple[int, int] | None:
    """(mtime_ns, inode) of a folder's marker: changes when the folder is sealed again; None without one."""
    try:
        st = (folder / MARKER_NAME).stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_ino


def finished(catalog: Catalog, folder: Path) -> bool:
    """The catalog holds the folder's checkpoint in an end state: nothing left to ingest."""
    row = catalog.find_by_local_path(str(folder))
    return row is not None and row.state in DONE


def pending_snapshots(root: Path, catalog: Catalog) -> Iterator[Path]:
    return (folder for folder in committed_folders(root) if not finished(catalog, folder))


class ChangeWaiter:
    """Wakes a watcher when a marker appears under root: inotify (via watchfiles) where available,
    plain polling otherwise. Wake-ups are hints; the periodic rescan is what guarantees nothing is
    missed (e.g. a marker written in a folder created before its watch was added)."""

    def __init__(self, root: Path, *, use_inotify: bool = True):
        self.root = Path(root)
        self._event = threading.Event()
        self._stop = threading.Event()
        self.mode = "polling"
        if use_inotify and sys.platform.startswith("linux"):
            try:
                import watchfiles  # noqa: F401
            except ImportError:
                return
            self.mode = "inotify"
            self._thread = threading.Thread(target=self._run, name="marker-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import watchfiles

        def only_markers(change: object, path: str) -> bool:
            return os.path.basename(path) == MARKER_NAME

        try:
            for _changes in watchfiles.watch(self.root, watch_filter=only_markers, debounce=200, step=20,
                                             stop_event=self._stop, rust_timeout=1000, raise_interrupt=False):
                self._event.set()
        except Exception:  # noqa: BLE001 - e.g. inotify watch limit: fall back to polling
            self.mode = "polling"

    def wait(self, timeout: float) -> bool:
        """Sleep until a marker event or `timeout`; True when woken by an event."""
        woke = self._event.wait(timeout)
        self._event.clear()
        return woke

    def close(self) -> None:
        self._stop.set()


class Offer(NamedTuple):
    took: bool     # the sink took the marker on (an ingest ran, an event was spooled)
    settle: bool   # offer this marker no more (until the folder is sealed again)


Say = Callable[[str], None]


class Sink(Protocol):
    """What a watcher does with a committed folder."""

    def wants(self, folder: Path) -> bool:
        """Whether to open the folder at all (False: nothing to do; asked again next pass)."""

    def offer(self, folder: Path, snap: LocalSnapshot, say: Say) -> Offer:
        """Take on a committed folder whose control files are sound."""

    def refuse(self, folder: Path, error: FormatError, say: Say) -> None:
        """A folder whose control files are not (hostile or rotten): never retried until its marker changes."""

    def start(self, say: Say, where: str) -> None:
        """The loop starts watching `where` (the root and how: inotify or polling)."""

    def tick(self, now: float, say: Say) -> None: ...

    def busy(self) -> bool:
        """Work is still in flight (a `--once` watcher waits for it)."""


class Watcher:
    """The watch loop: each pass offers every committed folder with a new marker to the sink, lets the
    sink progress, and applies multi-node timeouts every `timeouts_every` seconds."""

    def __init__(self, root: Path, catalog: Catalog, sink: Sink, *, config: Config | None = None,
                 interval: float = 2.0, timeouts_every: float | None = 10.0, use_inotify: bool = True,
                 on_event: Say | None = None):
        self.root, self.catalog, self.sink, self.config = Path(root), catalog, sink, config
        self.interval, self.timeouts_every = interval, timeouts_every
        self.use_inotify = use_inotify
        self.say: Say = on_event or (lambda text: None)
        self._settled: dict[Path, tuple[int, int]] = {}
        self._last_timeouts = 0.0

    def scan(self) -> int:
        """Offer the folders whose marker is new to the sink; returns how many it took on."""
        took = 0
        for folder in committed_folders(self.root):
            ident = marker_identity(folder)
            if ident is None or self._settled.get(folder) == ident or not self.sink.wants(folder):
                continue
            try:
                snap = LocalSnapshot.open(folder)
            except FormatError as e:
                self._settled[folder] = ident
                self.sink.refuse(folder, e, self.say)
                continue
            offer = self.sink.offer(folder, snap, self.say)
            took += offer.took
            if offer.settle:
                self._settled[folder] = ident
            else:
                self._settled.pop(folder, None)
        return took

    def pass_once(self, now: float | None = None) -> None:
        now = now if now is not None else time.time()
        self.scan()
        self.sink.tick(now, self.say)
        if self.timeouts_every is not None and now - self._last_timeouts >= self.timeouts_every:
            self._last_timeouts = now
            for a in apply_timeouts(self.catalog, self.config, assemble=False):
                self.say(f"{a.run}/{a.step}: {a.state}: {a.assessment.summary()}")

    def run(self, stop: threading.Event | None = None, *, once: bool = False) -> None:
        stop = stop or threading.Event()
        waiter = ChangeWaiter(self.root, use_inotify=self.use_inotify)
        self.sink.start(self.say, f"{self.root} ({waiter.mode})")
        try:
            while not stop.is_set():
                self.pass_once()
                if once and not self.sink.busy():
                    return
                waiter.wait(self.interval)
        finally:
            waiter.close()


class IngestHere:
    """`safepoint watch`: ingest each pending folder in this process with `ingest(folder, snap)` (an exit
    code; `snap` is the folder opened, so the ingest need not read its control files again).

    A folder whose ingest raises (a step the catalog cannot hold, an unreachable destination) is set
    aside until its marker changes and the others go on; one that ended without an end state is
    offered again: a failed copy on the next pass, a part delivered that waits for the others only
    after `recheck_s` (the other nodes' last part assembles the set; this is the safety net, and
    re-ingesting a waiting part every pass would cost a flow run per pass). `worst` is the worst
    exit code so far: 1 for a verdict (hostile control files among them), 2 for a failure.
    """

    def __init__(self, catalog: Catalog, ingest: Callable[[Path, LocalSnapshot], int],
                 describe: Callable[[BaseException], str] = str, *, recheck_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.catalog, self.ingest, self.describe = catalog, ingest, describe
        self.recheck_s, self.clock = recheck_s, clock
        self.worst = EXIT_OK
        self._waiting: dict[Path, float] = {}  # a delivered part -> when to offer it again
        self._done: dict[Path, tuple[int, int] | None] = {}  # finished folders -> their marker when seen so

    def wants(self, folder: Path) -> bool:
        if self.clock() < self._waiting.get(folder, 0.0):
            return False
        ident = marker_identity(folder)
        if folder in self._done and self._done[folder] == ident:  # a stat, not a catalog query per pass
            return False
        if finished(self.catalog, folder):
            self._waiting.pop(folder, None)
            self._done[folder] = ident
            return False
        return True

    def offer(self, folder: Path, snap: LocalSnapshot, say: Say) -> Offer:
        say(f"ingesting {folder}")
        self._waiting.pop(folder, None)
        try:
            code = self.ingest(folder, snap)
        except Exception as e:  # noqa: BLE001 - one bad folder never stops the watcher
            say(f"{self.describe(e)} ({folder}: set aside until its marker changes)")
            self.worst = max(self.worst, EXIT_ERROR)
            return Offer(took=True, settle=True)
        self.worst = max(self.worst, code)
        if code == EXIT_OK and not finished(self.catalog, folder):  # delivered; the set is not complete yet
            self._waiting[folder] = self.clock() + self.recheck_s
        return Offer(took=True, settle=False)

    def refuse(self, folder: Path, error: FormatError, say: Say) -> None:
        say(f"set aside {folder}: {error} (until its marker changes)")
        self.worst = max(self.worst, EXIT_BAD)

    def start(self, say: Say, where: str) -> None:
        pass

    def tick(self, now: float, say: Say) -> None:
        pass

    def busy(self) -> bool:
        return False


class Emit:
    """`safepoint watch --emit`: spool each new marker, emit its event and drive it to a finished ingest."""

    def __init__(self, catalog: Catalog, dispatcher: Dispatcher, to: list[str], node: str):
        self.catalog, self.dispatcher, self.to, self.node = catalog, dispatcher, list(to), node

    def wants(self, folder: Path) -> bool:
        return True

    def offer(self, folder: Path, snap: LocalSnapshot, say: Say) -> Offer:
        marker = Marker.of(snap, self.to, self.node)
        if ingest_finished(self.catalog, marker) is not None or not self.dispatcher.add(marker):
            return Offer(took=False, settle=True)
        say(f"marker {marker.run}/{marker.step} ({marker.node}) at {folder}: event {marker.event_id}")
        return Offer(took=True, settle=True)

    def refuse(self, folder: Path, error: FormatError, say: Say) -> None:
        say(f"not emitting {folder}: {error}")

    def start(self, say: Say, where: str) -> None:
        warm = getattr(self.dispatcher.gateway, "warm", None)
        if warm:
            warm()
        say(f"watching {where}, node {self.node}")

    def tick(self, now: float, say: Say) -> None:
        for m in self.dispatcher.tick(now):
            say(f"ingested {m.run}/{m.step} ({m.node})")

    def busy(self) -> bool:
        return bool(self.dispatcher.spool.all())

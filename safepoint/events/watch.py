"""Watch a root for commit markers: find committed folders, wake on inotify, emit and confirm events.

`pending_snapshots` serves the direct `safepoint watch` (ingest in-process); `EmitWatcher` serves
`safepoint watch --emit` (events to a Prefect server, see safepoint.events).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from safepoint.catalog.store import Catalog
from safepoint.core.config import Config
from safepoint.core.errors import FormatError
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


def pending_snapshots(root: Path, catalog: Catalog) -> Iterator[Path]:
    for folder in committed_folders(root):
        row = catalog.find_by_local_path(str(folder))
        if row is None or row.state not in DONE:
            yield folder


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


class EmitWatcher:
    """`safepoint watch ROOT --emit`: spool every new marker and drive it to a finished ingest.

    Each pass rescans ROOT (cheap: committed folders are not descended into), spools markers it has
    not seen, runs the dispatcher over the spool (safepoint.events) and, every `timeouts_every`
    seconds, applies multi-node timeouts (no flow has to wait for a dead node's ranks).
    """

    def __init__(self, root: Path, to: list[str], catalog: Catalog, dispatcher: Dispatcher, node: str, *,
                 config: Config | None = None, interval: float = 2.0, timeouts_every: float | None = 10.0,
                 use_inotify: bool = True, on_event: Callable[[str], None] | None = None):
        self.root, self.to, self.catalog, self.dispatcher, self.node = Path(root), list(to), catalog, dispatcher, node
        self.config = config
        self.interval, self.timeouts_every = interval, timeouts_every
        self.use_inotify = use_inotify
        self.say = on_event or (lambda text: None)
        self._known: dict[Path, tuple[int, int]] = {}
        self._last_timeouts = 0.0

    def _marker_id(self, folder: Path) -> tuple[int, int] | None:
        return marker_identity(folder)

    def scan(self) -> int:
        """Spool markers not seen before; returns how many were added."""
        added = 0
        for folder in committed_folders(self.root):
            ident = self._marker_id(folder)
            if ident is None or self._known.get(folder) == ident:
                continue
            try:
                snap = LocalSnapshot.open(folder)
            except FormatError as e:
                self.say(f"not emitting {folder}: {e}")
                self._known[folder] = ident
                continue
            marker = Marker.of(snap, self.to, self.node)
            self._known[folder] = ident
            if ingest_finished(self.catalog, marker) is not None:
                continue
            if self.dispatcher.add(marker):
                added += 1
                self.say(f"marker {marker.run}/{marker.step} ({marker.node}) at {folder}: event {marker.event_id}")
        return added

    def pass_once(self, now: float | None = None) -> list[Marker]:
        now = now if now is not None else time.time()
        self.scan()
        done = self.dispatcher.tick(now)
        for m in done:
            self.say(f"ingested {m.run}/{m.step} ({m.node})")
        if self.timeouts_every is not None and now - self._last_timeouts >= self.timeouts_every:
            self._last_timeouts = now
            for a in apply_timeouts(self.catalog, self.config, assemble=False):
                self.say(f"{a.run}/{a.step}: {a.state}: {a.assessment.summary()}")
        return done

    def run(self, stop: threading.Event | None = None, *, once: bool = False) -> None:
        stop = stop or threading.Event()
        waiter = ChangeWaiter(self.root, use_inotify=self.use_inotify)
        warm = getattr(self.dispatcher.gateway, "warm", None)
        if warm:
            warm()
        self.say(f"watching {self.root} ({waiter.mode}), node {self.node}")
        try:
            while not stop.is_set():
                self.pass_once()
                if once and not self.dispatcher.spool.all():
                    return
                waiter.wait(self.interval)
        finally:
            waiter.close()

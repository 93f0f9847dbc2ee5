"""The decisions of a restore, as pure functions: no I/O here (safepoint.restore does the I/O).

- `source_order`: where to read from, best first (the local copy or, for a multi-node checkpoint,
  the local parts, then durable replicas in the configured order of preference; `--from` forces
  its own list);
- `target_action`: what to do with the folder being restored into (fresh, finish an interrupted
  restore, already there, or refuse something else);
- `reuse_plan`: which files already in the folder are worth re-hashing, and which to fetch;
- `file_verdict`: what the attempts at one file, source by source, add up to;
- `checkpoint_verdict`: whether the checkpoint came back whole, has no whole copy (fall back to an
  older one), or could not be read (an infrastructure failure: never a reason to fall back);
- `replica_findings`: which replicas turned out bad, with the reason, for the catalog;
- a scoped (fleet) restore: `parse_ranks` reads `--ranks 0-7,16`, `scope_ranks` resolves `--node`
  or `--ranks` against the checkpoint's recorded parts, `file_rank` / `scoped_files` pick the files
  a set of ranks needs (its own, and every file no rank owns), `part_manifest` names the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from safepoint.core.urls import local_path


@dataclass(frozen=True)
class Source:
    """One place the checkpoint's files can be read from."""

    base: str                 # destination base URL, or the local folder (for the local copy)
    url: str                  # the snapshot: <base>/<run>/<step>, or the local folder
    local: bool = False       # the node's own committed folder (not a replica)
    cataloged: bool = True    # a replica the catalog knows (only those are marked corrupt)
    part: str | None = None   # one node's part: the BLAKE3 its manifest must have; it holds only its files


def _matches(prefix: str, source: Source) -> bool:
    p = prefix.rstrip("/")
    if source.local and "://" in p and (path := local_path(p)) is not None:
        p = str(path)
    return any(x == p or x.startswith(p + "/") for x in (source.url.rstrip("/"), source.base.rstrip("/")))


def source_order(local_path: str | None, replicas: Sequence[tuple[str, str]], *, run: str, step: int,
                 prefer: Sequence[str] = (), forced: Sequence[str] = (),
                 parts: Sequence[tuple[str, str]] = ()) -> list[Source]:
    """Sources, best first.

    `replicas` are (snapshot url, destination base) of the catalog's verified replicas; `parts` the
    (local folder, part manifest BLAKE3) of a multi-node checkpoint's parts, in rank order. Without
    `forced`: the local copy (when the catalog names one) and the local parts, then the replicas
    ordered by the first `prefer` prefix they match (unmatched ones last, in catalog order). With
    `forced`: exactly the sources matching each forced URL, in that order; a forced URL the catalog
    does not know is read as a destination base (or a snapshot URL ending in /<run>/<step>).
    """
    known = ([Source(local_path, local_path, local=True)] if local_path else []) + \
        [Source(path, path, local=True, part=digest) for path, digest in dict.fromkeys(parts)] + \
        [Source(base.rstrip("/"), url.rstrip("/")) for url, base in replicas]
    if forced:
        out: list[Source] = []
        for f in forced:
            hits = [s for s in known if _matches(f, s)]
            if not hits:
                base = f.rstrip("/")
                tail = f"/{run}/{step}"
                base = base[: -len(tail)] if base.endswith(tail) else base
                hits = [Source(base, f"{base}{tail}", cataloged=False)]
            out.extend(h for h in hits if h not in out)
        return out

    def rank(s: Source) -> int:
        if s.local:
            return -1
        return next((i for i, p in enumerate(prefer) if _matches(p, s)), len(prefer))

    return sorted(known, key=rank)  # stable: catalog order within a rank


class TargetAction(str, Enum):
    FRESH = "fresh"          # empty or absent: restore into it
    RESUME = "resume"        # an interrupted restore of ours: finish it, reusing what verifies
    PRESENT = "present"      # already a committed snapshot of this checkpoint: check it, refetch what fails
    CLEAR = "clear"          # holds something else, and --force: remove it, then restore
    REFUSE = "refuse"        # holds something else


def target_action(names: Iterable[str], *, committed_as: tuple[str, int] | None, restore_state: bool,
                  want: tuple[str, int], force: bool) -> TargetAction:
    """What to do with the folder to restore into, from what is in it.

    `names`: its entries (top level); `committed_as`: (run, step) of its valid COMMITTED marker, if
    any; `restore_state`: it holds the state file an interrupted restore leaves behind.
    """
    if not list(names):
        return TargetAction.FRESH
    if committed_as == want:
        return TargetAction.PRESENT
    if committed_as is None and restore_state:
        return TargetAction.RESUME
    return TargetAction.CLEAR if force else TargetAction.REFUSE


def reuse_plan(expected: Mapping[str, int], on_disk: Mapping[str, int | None]) -> tuple[list[str], list[str]]:
    """(files to re-hash in place, files to fetch): only a file of the right size can be reused."""
    rehash = [p for p, size in expected.items() if on_disk.get(p) == size]
    fetch = [p for p, size in expected.items() if on_disk.get(p) != size]
    return rehash, fetch


class Outcome(str, Enum):
    OK = "ok"                # every byte arrived and matched the manifest
    BAD = "bad"              # the source's copy is wrong (hash or size mismatch)
    MISSING = "missing"      # the source does not have it
    ERROR = "error"          # could not be read (network, store): says nothing about the bytes

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Attempt:
    source: Source
    outcome: Outcome
    reason: str = ""


class Verdict(str, Enum):
    WHOLE = "whole"          # every file verified
    NO_COPY = "no_copy"      # some file has no good copy anywhere: fall back (or exit 1 with --step)
    UNREADABLE = "unreadable"  # some file could not be read: infrastructure, exit 2, never a fallback

    def __str__(self) -> str:
        return self.value


def file_verdict(attempts: Sequence[Attempt], sources: int) -> Verdict | None:
    """None while another source is left to try; else what the attempts at one file add up to."""
    if any(a.outcome is Outcome.OK for a in attempts):
        return Verdict.WHOLE
    if len(attempts) < sources:
        return None
    if any(a.outcome is Outcome.ERROR for a in attempts):
        return Verdict.UNREADABLE
    return Verdict.NO_COPY


def checkpoint_verdict(files: Iterable[Verdict]) -> Verdict:
    """No whole copy wins over unreadable: one file proven bad everywhere is enough to fall back."""
    vs = set(files)
    if Verdict.NO_COPY in vs:
        return Verdict.NO_COPY
    if Verdict.UNREADABLE in vs:
        return Verdict.UNREADABLE
    return Verdict.WHOLE


def replica_findings(attempts: Mapping[str, Sequence[Attempt]]) -> dict[Source, tuple[str, str]]:
    """Each cataloged replica found bad: (replica state, reason). Corrupt wins over missing.

    `attempts` maps a file path to the attempts made at it. Errors (network) are not findings; the
    local copy is not a replica.
    """
    out: dict[Source, tuple[str, str]] = {}
    for path, tries in sorted(attempts.items()):
        for a in tries:
            if a.source.local or not a.source.cataloged or a.outcome not in (Outcome.BAD, Outcome.MISSING):
                continue
            state = "corrupt" if a.outcome is Outcome.BAD else "missing"
            prev = out.get(a.source)
            if prev is None or (prev[0] == "missing" and state == "corrupt"):
                out[a.source] = (state, f"{path}: {a.reason}" if a.reason else path)
    return out


# -- a scoped restore: one node's part, or any set of ranks -------------------------------------

class ScopeError(ValueError):
    """A rank set or node that the checkpoint does not have (usage: exit 2)."""


_MAX_RANKS = 1 << 20  # `--ranks 0-99999999999` must not build a list that fills memory


def parse_ranks(text: str) -> tuple[int, ...]:
    """`"0-7,16"` -> (0, 1, ..., 7, 16): sorted, without repeats. ScopeError on anything else."""
    out: set[int] = set()
    for item in str(text).split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", item)
        if m is None:
            raise ScopeError(f"ranks: {item!r} is not a rank or a range like 0-7 (e.g. --ranks 0-7,16)")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ScopeError(f"ranks: {item!r} runs backwards")
        if hi - lo + 1 + len(out) > _MAX_RANKS:
            raise ScopeError(f"ranks: more than {_MAX_RANKS} ranks")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def format_ranks(ranks: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5": the inverse of parse_ranks, for messages."""
    rs = sorted(set(ranks))
    spans: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        spans.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(spans)


def scope_ranks(world_size: int, holders: Sequence[tuple[int, str | None]], *, node: str | None = None,
                ranks: Sequence[int] | None = None) -> tuple[int, ...]:
    """The ranks a scoped restore brings back: `ranks` (all within the world), or those `node` holds.

    `holders`: (rank, node) as the catalog recorded each delivered rank. Both given: the ranks of
    `ranks` (the node is then the name the restored part is committed under). ScopeError when a
    rank is past the world or the node held none.
    """
    if ranks is not None:
        wanted = tuple(sorted(set(ranks)))
        if not wanted:
            raise ScopeError("ranks: none given")
        past = [r for r in wanted if r < 0 or r >= world_size]
        if past:
            raise ScopeError(f"rank {format_ranks(past)} is not in the checkpoint (world size {world_size}, "
                             f"ranks 0-{world_size - 1})")
        return wanted
    if node is None:
        return tuple(range(world_size))
    held = tuple(sorted({r for r, n in holders if n == node}))
    if not held:
        known = sorted({n for _, n in holders if n})
        raise ScopeError(f"node {node!r} holds no rank of this checkpoint"
                         + (f" (its nodes: {', '.join(known)})" if known else " (the catalog names no node)"))
    return held


# A file names its rank as DCP does (`__3_0.distcp`) or as most per-rank savers do (`rank3.pt`,
# `rank_03/`, `mp_rank_03_model_states.pt`). A name with two ranks (`zero_pp_rank_1_mp_rank_00`)
# or none belongs to every rank.
_RANK_NAMES = (re.compile(r"^__(\d+)_\d+\.distcp$"), re.compile(r"(?<![a-z0-9])(?:mp_)?rank[_-]?(\d+)(?![0-9])", re.I))


def file_rank(path: str, world_size: int) -> int | None:
    """The rank whose file this is, by its name; None: a file every rank needs (`.metadata`, a config)."""
    name = path.rsplit("/", 1)[-1]
    m = _RANK_NAMES[0].match(name)
    if m is not None:
        found = {int(m[1])}
    else:
        found = {int(x) for x in _RANK_NAMES[1].findall(path)}
    if len(found) != 1:
        return None
    r = found.pop()
    return r if r < world_size else None


def scoped_files(paths: Iterable[str], world_size: int, ranks: Iterable[int]) -> list[str]:
    """The files `ranks` need: each one a rank of theirs owns, and each one no rank owns."""
    want = set(ranks)
    return [p for p in paths if (r := file_rank(p, world_size)) is None or r in want]


def part_meta(whole_meta: Mapping[str, Any], whole_blake3: str) -> dict[str, Any]:
    """A restored part's meta: the whole's, less its list of parts, plus the digest it was held to."""
    meta = {k: v for k, v in whole_meta.items() if k != "parts"}
    meta["part_of"] = whole_blake3
    return meta

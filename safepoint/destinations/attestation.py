"""When a store's word on a replica is taken (S3Destination.attest), and when it is checked anyway.

A store that refuses a wrong checksum has shown that it compares what arrives with the checksum
sent; its HeadObject checksum then stands for a read-back. Two lies defeat a probe taken on trust:
a store (or a proxy in front of it) that checks only some bodies (small ones, the first ones, a
recognisable probe), and one that checks what arrives, then keeps or reports other bytes. So the
trust is earned, per store (endpoint, bucket, algorithm) and process:

- the probe (a wrong checksum that must be refused) is sent as the kind of request the upload
  sends, a PUT or a part, with random bytes of the size class of the body that goes next (up to the
  real part size) under a random key; a body larger than any probed so far is probed first, and
  every store is probed again after a random amount of uploaded bytes (mean PROBE_MEAN_PARTS
  parts), so no one request is the probe;
- attested objects are read back in full all the same until TRUST_BYTES of them were found as
  attested, and after that a random AUDIT_FRACTION of them. One read-back that finds other bytes
  than the store attested makes it a liar: nothing it says is taken again in this process.

What stays out of reach (docs/reliability.md, "Round four"): a store that lies about every body and
every read is caught only by `scrub` from another path, if at all.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

MiB = 1024 * 1024
TRUST_BYTES = 128 * MiB     # attested bytes a store must have had confirmed by full read-backs, per process
AUDIT_FRACTION = 1 / 32     # after that, the share of attested objects still read back in full
PROBE_MEAN_PARTS = 64       # mean of the (exponential) uploaded bytes between probes, in parts
MIN_PROBE = 64 * 1024       # the smallest probe body

_rng = random.SystemRandom()  # the store must not predict a draw


def probe_size(body: int, part_size: int) -> int:
    """The probe body for a request of `body` bytes: its power-of-two size class in [MIN_PROBE, part_size]. Pure."""
    return min(part_size, max(MIN_PROBE, 1 << max(0, body - 1).bit_length()))


def next_probe_in(part_size: int, draw: float) -> int:
    """Bytes to upload before the next probe: exponential, mean PROBE_MEAN_PARTS parts (`draw` in [0, 1)). Pure."""
    return max(part_size, int(-math.log1p(-draw) * PROBE_MEAN_PARTS * part_size))


def audit(confirmed: int, draw: float) -> bool:
    """Whether to read an attested object back in full: until TRUST_BYTES were confirmed, then at random. Pure."""
    return confirmed < TRUST_BYTES or draw < AUDIT_FRACTION


@dataclass
class StoreTrust:
    """What this process has seen of one store: probes refused, attestations confirmed, a lie."""

    part_size: int
    refused: dict[str, int] = field(default_factory=dict)  # "put"/"part" -> largest body size refused when wrong
    lax: bool = False       # took a wrong checksum, or attested bytes it did not hold
    confirmed: int = 0      # bytes of attested objects a full read-back found as attested
    probe_in: int = 0       # bytes to upload before the refusals are asked again

    def __post_init__(self) -> None:
        self.probe_in = next_probe_in(self.part_size, _rng.random())

    def needs_probe(self, kind: str, body: int) -> bool:
        return not self.lax and self.refused.get(kind, 0) < probe_size(body, self.part_size)

    def spend(self, nbytes: int) -> None:
        """`nbytes` were uploaded: once the countdown runs out, every refusal must be shown again."""
        self.probe_in -= nbytes
        if self.probe_in <= 0:
            self.refused.clear()
            self.probe_in = next_probe_in(self.part_size, _rng.random())

    def audit_next(self) -> bool:
        return audit(self.confirmed, _rng.random())


_stores: dict[tuple[str, str, str], StoreTrust] = {}
lock = threading.Lock()  # held while a store is probed: the files uploaded in parallel wait for one answer


def store(ident: tuple[str, str, str], part_size: int) -> StoreTrust:
    """The one StoreTrust of (endpoint, bucket, algorithm) in this process (call with `lock` held)."""
    if ident not in _stores:
        _stores[ident] = StoreTrust(part_size)
    return _stores[ident]


def forget() -> None:
    """Drop everything learnt (tests: a fresh process)."""
    with lock:
        _stores.clear()

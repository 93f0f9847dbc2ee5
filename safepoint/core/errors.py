"""Safepoint's few exception types. Verification outcomes are data, not exceptions."""


class SafepointError(Exception):
    """Base class: an error Safepoint reports to the user with a clear message."""


class FormatError(SafepointError):
    """Bytes that do not follow docs/format.md (manifest, marker, unsafe path)."""


class CommitError(SafepointError):
    """A folder could not be sealed; nothing was committed."""


class DestinationError(SafepointError):
    """A destination failed in a way retries did not fix."""


class CatalogError(SafepointError):
    """The catalog refused a change (e.g. a transition from an unexpected state)."""


class UsageError(SafepointError):
    """Bad arguments or configuration (exit code 2)."""

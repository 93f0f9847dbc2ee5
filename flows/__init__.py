"""The Prefect edge: flows that run the operations. Importing it registers how `block://` destinations
are resolved (safepoint.flows.credentials), for every flow a worker or `serve` runs."""

from safepoint.flows import credentials as _credentials  # noqa: F401

"""The upload slot's transport: a 503 (a busy SQLite server) is asked again soon, within a budget.

The slot itself, on a real server, is in tests/test_prefect_native.py."""

from __future__ import annotations

import time

import httpx
import pytest

from safepoint.tasks.host_slot import BusyRetry


def answering(statuses: list[int]) -> tuple[httpx.MockTransport, list[str]]:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.content.decode())
        return httpx.Response(statuses[min(len(seen) - 1, len(statuses) - 1)])

    return httpx.MockTransport(answer), seen


@pytest.mark.parametrize("statuses, budget_s, final, asks", [
    ([200], 2.0, 200, 1),                 # an answer at once is passed on
    ([503, 503, 200], 2.0, 200, 3),       # busy twice, then granted: one call to the client
    ([423], 2.0, 423, 1),                 # every slot taken is the caller's to wait for, not a retry
    ([500, 200], 2.0, 500, 1),            # a server error is not "busy"
    ([503], 0.0, 503, 1),                 # no budget: the 503 goes on to Prefect's own retry
])
def test_busy_answers_are_asked_again_within_the_budget(statuses, budget_s, final, asks):
    inner, seen = answering(statuses)
    with httpx.Client(transport=BusyRetry(inner, budget_s=budget_s, pause_s=0.01), base_url="http://x") as c:
        t0 = time.monotonic()
        r = c.post("/v2/concurrency_limits/increment-with-lease", json={"names": ["n"], "slots": 1})
        took = time.monotonic() - t0
    assert (r.status_code, len(seen)) == (final, asks)
    assert all(body == seen[0] for body in seen)  # the same request body each time
    assert took < 1.0  # tens of milliseconds, where Prefect's client sleeps 2 s


def test_a_server_busy_past_the_budget_hands_its_503_back():
    inner, seen = answering([503])
    with httpx.Client(transport=BusyRetry(inner, budget_s=0.3, pause_s=0.02, pause_max_s=0.05),
                      base_url="http://x") as c:
        t0 = time.monotonic()
        r = c.post("/v2/concurrency_limits/increment-with-lease", json={})
        took = time.monotonic() - t0
    assert r.status_code == 503
    assert len(seen) >= 4 and took <= 0.3 + 0.2

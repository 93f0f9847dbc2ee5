"""Checkpoint verdicts as Prefect events, and the automations Safepoint ships to act on them.

The ingest flow emits `safepoint.checkpoint.verified|corrupt|invalid` with the checkpoint as the
resource (`prefect.resource.id: safepoint.checkpoint.RUN.STEP`, the same resource as the watcher's
`safepoint.checkpoint.committed`), so Prefect's own automations can watch checkpoints:

- `safepoint-checkpoint-not-verified` (proactive): a committed checkpoint with no `verified` for
  the same resource within N seconds: the ingest is stuck, failed, or never ran;
- `safepoint-checkpoint-rejected` (reactive): a checkpoint judged corrupt or invalid.

`safepoint automations apply` creates or updates both (by name). Their action is a notification
through a Prefect notification block when one is named, else nothing beyond the automation's own
`prefect.automation.triggered` event, which the UI's event feed and automation page show.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from prefect.automations import Automation
from prefect.events import emit_event
from prefect.events.actions import DoNothing, SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

from safepoint.core.errors import UsageError
from safepoint.core.redact import redact
from safepoint.events.markers import EVENT, OUTCOME_EVENTS, resource, trigger_match

log = logging.getLogger("safepoint.flows.automations")

NOT_VERIFIED = "safepoint-checkpoint-not-verified"
REJECTED = "safepoint-checkpoint-rejected"


def emit_outcome(run: str, step: int, node: str | None, state: str, message: str | None = None) -> None:
    """Emit the verdict event of a checkpoint (nothing for states that are not a verdict)."""
    name = OUTCOME_EVENTS.get(str(state))
    if name is None:
        return
    emit_event(event=name, resource=resource(run, step, node or ""),
               payload={"run": run, "step": step, "state": str(state), "message": redact(message)})


def notification_block(ref: str) -> Any:
    """The notification block `TYPE/NAME` (e.g. slack-webhook/oncall); UsageError when there is none."""
    from prefect.blocks.core import Block

    try:
        return Block.load(ref)
    except ValueError as e:
        raise UsageError(f"--notify {ref}: {e}") from None


def definitions(within_s: float = 1800.0, notify: Any = None) -> list[Automation]:
    """The shipped automations; `notify` is a notification block (e.g. a SlackWebhook) or None."""
    def actions(subject: str) -> list[Any]:
        if notify is None:
            return [DoNothing()]
        return [SendNotification(block_document_id=notify._block_document_id, subject=subject,
                                 body="{{ event.resource['prefect.resource.name'] }}: {{ event.event }} "
                                      "({{ event.payload.message or '' }})")]

    return [
        Automation(
            name=NOT_VERIFIED,
            description=f"A committed checkpoint was not verified within {within_s:.0f} s.",
            trigger=EventTrigger(posture=Posture.Proactive, after={EVENT}, expect={OUTCOME_EVENTS["verified"]},
                                 match=trigger_match(), for_each={"prefect.resource.id"}, threshold=1,
                                 within=timedelta(seconds=within_s)),
            actions=actions("Safepoint: checkpoint not verified in time"),
        ),
        Automation(
            name=REJECTED,
            description="A checkpoint was judged corrupt or invalid.",
            trigger=EventTrigger(posture=Posture.Reactive,
                                 expect={OUTCOME_EVENTS["corrupt"], OUTCOME_EVENTS["invalid"]},
                                 match=trigger_match(), for_each={"prefect.resource.id"}, threshold=1,
                                 within=timedelta(0)),
            actions=actions("Safepoint: checkpoint rejected"),
        ),
    ]


def apply(automations: list[Automation]) -> list[tuple[str, str, str]]:
    """Create each automation, or update the one of the same name; (name, id, 'created'|'updated')."""
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import get_client

    done = []
    with get_client(sync_client=True) as client:
        for a in automations:
            core = AutomationCore(**a.model_dump(exclude={"id", "owner_resource"}))
            existing = client.read_automations_by_name(a.name)
            if existing:
                client.update_automation(automation_id=existing[0].id, automation=core)
                done.append((a.name, str(existing[0].id), "updated"))
            else:
                done.append((a.name, str(client.create_automation(automation=core)), "created"))
    return done

"""Where a run resumes from, decided over the catalog: the catalog reads pages, the rule decides."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from safepoint.rules.resume import ResumeDecision, resume_point_paged

if TYPE_CHECKING:
    from safepoint.catalog.lite import LiteCatalog
    from safepoint.catalog.store import Catalog


def find_resume_point(catalog: Catalog | LiteCatalog, run: str, *, min_replicas: int = 1, max_step: int | None = None,
                      before: datetime | None = None, tag: str | None = None, page: int = 8) -> ResumeDecision:
    """The pure rule safepoint.rules.resume.resume_point over `run` in `catalog`, reading only the rows it needs.

    All pages come from one read transaction (Catalog.resume_pages), so they see one snapshot and the
    answer equals the rule's answer on the whole run; usually one page, one statement.
    """
    with catalog.resume_pages(run, max_step=max_step, before=before) as fetch_page:
        return resume_point_paged(fetch_page, min_replicas=min_replicas, max_step=max_step, before=before,
                                  tag=tag, page=page)

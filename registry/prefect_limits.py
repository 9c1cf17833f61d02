"""Prefect global concurrency limits of one slot, created race-safely.

Shared by the two locks built on them: the promotion gate's (`registry.gatelock`) and the flow's
workspace lock (`flows.pipeline`). Standard library only at import time (Prefect is imported when
called), so the flow module stays light.
"""

# tested by: tests/integration/test_registry_postgres.py

from __future__ import annotations


def ensure_one_slot_limit(name: str) -> None:
    """Create the Prefect global concurrency limit `name` (one slot) unless it exists.

    Prefect's upsert reads, then creates: two processes that start together (two workers, two
    machines registering) both find no limit, and the slower create is answered 409 Conflict.
    The limit then exists, which is all either needs, so a conflict is followed by one more
    upsert (which reads it back and fixes its size if it differs); any other error is raised.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.upsert_global_concurrency_limit_by_name(name=name, limit=1)
        except ObjectAlreadyExists:  # the 409
            client.upsert_global_concurrency_limit_by_name(name=name, limit=1)

"""Waiting on a batch through the official client, as a user of the Batch API would."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Often enough that a bench's clock stops within a quarter second of the batch finishing, rarely
# enough that the polling is a small share of the control plane's work.
POLL_S = 0.25


def wait_for_batch(client: Any, batch_id: str, until: Callable[[Any], bool],
                   timeout_s: float) -> Any:
    """The batch as soon as `until(batch)` holds; TimeoutError after timeout_s."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(POLL_S)
    raise TimeoutError(f"batch {batch_id} did not get there in {timeout_s:.0f}s")

"""Which expert-parallel rank runs a sequence (expert_parallel.py), chosen when it is
admitted: a sequence's KV lives on one rank, so it keeps that rank for its life, preempted
or not.

A new sequence goes to the rank that runs the fewest unfinished ones. Cached prefixes are
each rank's own: the rank is mixed into the root of the sequence's block hashes (as a cache
salt is), so a sequence reuses only blocks whose KV its own rank wrote. A prefix that many
sequences share (a system prompt) is then computed once per rank, not once in all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from minimill.engine.sequence import Sequence


def deal_rank(unfinished: Iterable[Sequence], num_ranks: int) -> int:
    """The rank with the fewest of these sequences (the lowest of equals)."""
    load = [0] * num_ranks
    for seq in unfinished:
        load[seq.rank] += 1
    return min(range(num_ranks), key=load.__getitem__)


def rank_root(root: int | None, rank: int) -> int | None:
    """A sequence's prefix root (sequence.prefix_root) on `rank`: rank 0's is the root
    itself, so one rank hashes as a single engine does."""
    if rank == 0:
        return root
    digest = hashlib.blake2b(f"{root}/{rank}".encode(), digest_size=16,
                             person=b"minimill-rank").digest()
    return int.from_bytes(digest, "little")

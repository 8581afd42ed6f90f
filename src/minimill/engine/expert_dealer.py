"""Which expert-parallel rank runs each of a step's sequences (expert_parallel.py): a
sequence's KV lives on one rank, so it stays there while it runs, and a sequence that
reuses a cached prefix must run where that prefix's KV was written.

Both follow from one record: the rank of the sequence whose first KV block is b. A running
sequence keeps its first block; one that reuses a cached prefix shares that prefix's first
block with the sequence that wrote it (a prefix is reused from its first block on). Only a
sequence that starts from nothing (no token computed: new, or preempted and recomputed
without a cached prefix) is free to go anywhere: it goes to the rank with the fewest of the
step's sequences, which balances the ranks step by step.
"""

from __future__ import annotations

from minimill.engine.scheduler import ScheduledSequence


class SequenceDealer:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        # First block id -> the rank of the sequence that holds it (a pool's worth at most).
        self._rank_of_first: dict[int, int] = {}

    def deal(self, entries: list[ScheduledSequence]) -> list[int]:
        """Each entry's rank, in the step's order."""
        owners: list[int | None] = [None] * len(entries)
        load = [0] * self.num_ranks
        for i, entry in enumerate(entries):
            if entry.seq.num_computed_tokens:
                first = entry.seq.block_table[0]
                # Every computed block was written by a sequence dealt in an earlier step.
                owner = self._rank_of_first.get(first, first % self.num_ranks)
                owners[i] = owner
                load[owner] += 1
        for i, entry in enumerate(entries):
            if owners[i] is None:
                owner = min(range(self.num_ranks), key=load.__getitem__)
                self._rank_of_first[entry.seq.block_table[0]] = owner
                owners[i] = owner
                load[owner] += 1
        return [o for o in owners if o is not None]

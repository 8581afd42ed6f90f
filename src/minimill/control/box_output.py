"""A running exec's streamed output (`box_op_output`): the SQL, inside the caller's transaction.

A host numbers its chunks from 1 for each run of an operation (the run is the op's epoch) and
sends them in order, a chunk again when an answer was lost: a chunk is stored only if its
number is past the highest stored for that run, so each is stored once and the numbers of a
run only grow, which is what lets a reader ask for "everything after (epoch, seq)". A run
stores at most MAX_EXEC_OUTPUT_BYTES characters per stream, as much as its result may hold.
The chunks go when the operation ends (its result holds the whole output) or is queued again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, and_, delete, func, insert, or_, select

from minimill.control.box_records import OutputChunk
from minimill.control.tables import box_op_output
from minimill.transport.box_protocol import MAX_EXEC_OUTPUT_BYTES, BoxOutputChunk

# Ids per IN (...) list: well under every backend's limit on bound parameters.
ID_GROUP = 500


def append(conn: Connection, op_id: str, epoch: int, chunks: Iterable[BoxOutputChunk]) -> int:
    """Store the chunks not stored yet, cut to the run's limit per stream; returns how many
    were stored. The caller holds the operation's row lock (one writer per operation)."""
    last = conn.execute(select(func.max(box_op_output.c.seq)).where(
        box_op_output.c.op_id == op_id, box_op_output.c.epoch == epoch)).scalar() or 0
    used = {str(r.stream): int(r.chars or 0) for r in conn.execute(
        select(box_op_output.c.stream, func.sum(func.length(box_op_output.c.data))
               .label("chars"))
        .where(box_op_output.c.op_id == op_id, box_op_output.c.epoch == epoch)
        .group_by(box_op_output.c.stream))}
    rows = []
    for chunk in sorted(chunks, key=lambda c: c.seq):
        if chunk.seq <= last:
            continue  # sent again: stored already
        room = MAX_EXEC_OUTPUT_BYTES - used.get(chunk.stream, 0)
        data = chunk.data[:max(room, 0)]
        last = chunk.seq
        if not data:
            continue
        used[chunk.stream] = used.get(chunk.stream, 0) + len(data)
        rows.append({"op_id": op_id, "epoch": epoch, "seq": chunk.seq,
                     "stream": chunk.stream, "data": data})
    if rows:
        conn.execute(insert(box_op_output), rows)
    return len(rows)


def since(conn: Connection, op_id: str, epoch: int, seq: int) -> list[OutputChunk]:
    """The operation's chunks after (epoch, seq), in order."""
    rows = conn.execute(
        select(box_op_output.c.epoch, box_op_output.c.seq, box_op_output.c.stream,
               box_op_output.c.data)
        .where(box_op_output.c.op_id == op_id,
               or_(box_op_output.c.epoch > epoch,
                   and_(box_op_output.c.epoch == epoch, box_op_output.c.seq > seq)))
        .order_by(box_op_output.c.epoch, box_op_output.c.seq))
    return [OutputChunk(epoch=int(r.epoch), seq=int(r.seq), stream=str(r.stream),
                        data=str(r.data)) for r in rows]


def drop(conn: Connection, op_ids: Sequence[str]) -> None:
    """Delete the chunks of these operations (they ended, or go back to the queue)."""
    ids = list(op_ids)
    for start in range(0, len(ids), ID_GROUP):
        conn.execute(delete(box_op_output)
                     .where(box_op_output.c.op_id.in_(ids[start:start + ID_GROUP])))

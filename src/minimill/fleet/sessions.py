"""The sessions whose KV this worker's engine last held, as it reports them to placement.

A compact list: the `session_tag` of the most recent `MAX_HELD_SESSIONS` session keys among
the leases it ran, sent with a lease call only when it changed. Placement prefers this site
for those sessions' next turns; nothing depends on it being right (the engine's prefix
cache and KV tiers decide what is actually reused).
"""

from __future__ import annotations

from collections import OrderedDict

from minimill.transport.protocol import MAX_HELD_SESSIONS, session_tag


class HeldSessions:
    def __init__(self, limit: int = MAX_HELD_SESSIONS) -> None:
        self.limit = limit
        self._tags: OrderedDict[str, None] = OrderedDict()  # least recent first
        self._dirty = False

    def add(self, session_key: str) -> None:
        tag = session_tag(session_key)
        if tag in self._tags:
            if next(reversed(self._tags)) == tag:
                return  # already the most recent: nothing new to say
            self._tags.move_to_end(tag)
        else:
            self._tags[tag] = None
            while len(self._tags) > self.limit:
                self._tags.popitem(last=False)
        self._dirty = True

    def changed(self) -> list[str] | None:
        """The tags to send now (None: unchanged since the last send)."""
        if not self._dirty:
            return None
        self._dirty = False
        return list(self._tags)

    def unsent(self) -> None:
        """The last `changed()` answer did not reach the control plane: send it again."""
        self._dirty = True

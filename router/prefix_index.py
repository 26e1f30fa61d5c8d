"""What the router knows of one worker's prefix cache: the block hashes it holds, as
followed through the worker's ``PrefixLog`` (``wire.prefix``) on each stats
poll. Plain bookkeeping; the registry's poll is its only writer.

It can lag the worker by one poll (a block cached since, or evicted since), which
costs a routing choice at worst, never a wrong answer: the worker's own cache
decides what it really reuses.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.wire.prefix import PrefixCursor, PrefixUpdate


class PrefixIndex:
    def __init__(self) -> None:
        self.cursor: PrefixCursor | None = None
        self.hashes: set[int] = set()

    def apply(self, update: PrefixUpdate) -> None:
        """Take the events a poll brought. An update that overlaps what is already
        applied (two polls answered with the same cursor) applies only its new tail;
        one that is older is ignored."""
        if update.snapshot:
            self.hashes = {h for h, stored in update.events if stored}
            self.cursor = update.cursor
            return
        if self.cursor is None or update.epoch != self.cursor.epoch or update.seq <= self.cursor.seq:
            return
        new = update.seq - self.cursor.seq
        if new > len(update.events):  # it does not reach back to our cursor: start over
            self.cursor = None
            return
        for h, stored in update.events[len(update.events) - new :]:
            if stored:
                self.hashes.add(h)
            else:
                self.hashes.discard(h)
        self.cursor = update.cursor

    def cached_blocks(self, prompt_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its hash chain) this worker holds."""
        n = 0
        for h in prompt_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

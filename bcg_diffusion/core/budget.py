"""A pipeline-wide limit on captured signatures, with least-recently-used eviction.

Every captured signature holds graph memory in the pipeline's shared pool. With ``max_signatures``
set, capturing one more than the limit first drops the signature (of any component) replayed longest
ago: its graph is reset, its blocks return to the pool for later captures, and a later call of it
captures again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

__all__ = ["SignatureBudget"]

logger = logging.getLogger(__name__)


class _Evictable(Protocol):
    name: str

    def evict(self, key: Hashable) -> None: ...


class SignatureBudget:
    """Least-recently-used order of the captured signatures of every runner of one pipeline.

    Not thread-safe by itself: the runners call it under the pipeline's lock.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_signatures must be at least 1, got {limit}")
        self.limit = limit
        self.evictions = 0
        self._order: OrderedDict[tuple[int, Hashable], _Evictable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, runner: _Evictable, key: Hashable) -> None:
        """``runner`` replayed ``key``: it becomes the most recently used."""
        self._order.move_to_end((id(runner), key), last=True)

    def admit(self, runner: _Evictable, key: Hashable) -> None:
        """``runner`` captured ``key``; evict the least recently used others beyond the limit."""
        self._order[(id(runner), key)] = runner
        while len(self._order) > self.limit:
            (_, old_key), owner = self._order.popitem(last=False)
            logger.info("%s: evicting a signature (max_signatures=%d reached)", owner.name, self.limit)
            owner.evict(old_key)
            self.evictions += 1

    def forget(self, runner: _Evictable, key: Hashable | None = None) -> None:
        """Drop ``runner``'s ``key`` (or all its keys) from the order, without evicting anything."""
        for entry in [k for k in self._order if k[0] == id(runner) and (key is None or k[1] == key)]:
            del self._order[entry]

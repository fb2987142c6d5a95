"""The slot marks: per Redis slot, the highest value of its marker (its write counter) seen.

Every script's reply starts with its slot's counter; a call carries the slot's mark and the
script refuses when the counter is below it (the slot went back in time: a restored backup, a
lost tail of writes). A mark kept in one process's memory protects that process only: a second
process that never saw the lost writes would admit on the restored slot, and every write it
makes raises the counter again until it has caught up with every mark.

So the marks of every process sharing a data dir live in one memory-mapped file,
``<data dir>/fencegate.marks`` (16,384 unsigned 64-bit integers, 128 KiB, mode 0600): a
counter any process saw in a reply is part of every process's next call on that slot, at
once, without a system call. The page cache is the sharing; the durable copy is the state
file (:mod:`gateway.store.statefile`), written every ``redis.marks_interval_seconds``.

A mark is raised by read, compare, write: two processes raising one slot in the same
microsecond may leave the lower of their two values in the file. Each process also keeps the
marks it saw itself (``own``), and a call presents the higher of the two, so a process never
presents less than it saw; the next reply of that slot raises the shared mark again.

The file also holds the **latch** (the word after the marks): set by the first process that
meets a slot behind its mark, with the time, so every process on the host reports the same
cause. ``fencegate init --confirm-data-loss`` clears it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

from gateway.store.keys import SLOTS

__all__ = ["MARKS_FILE", "SlotMarks"]

MARKS_FILE = "fencegate.marks"
# the marks, then the latch (unix ms; 0: not latched), then the witness: the baseline it
# belongs to (a hash of the durability marker's id) and the highest value this data dir's
# processes got from their witness key (see gateway.store.link.RedisLink.witness)
_LATCH, _WITNESS_BASE, _WITNESS, _WITNESS_AT = SLOTS, SLOTS + 1, SLOTS + 2, SLOTS + 3
_WORDS = SLOTS + 4
_SIZE = 8 * _WORDS


def _open_shared(path: Path) -> tuple[mmap.mmap, memoryview]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < _SIZE:  # a new file (or a short one): zero-filled
            os.ftruncate(fd, _SIZE)
        mapped = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapped, memoryview(mapped).cast("Q")


class SlotMarks:
    """The marks of one process, shared with every process of its data dir (``path``).

    Reads like a mapping of slot → mark (only slots with a mark are items); ``raise_to`` is the
    only way a mark changes, and it only rises. Without a path (no data dir: tests, the model
    checker) the marks are this process's alone.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.own: dict[int, int] = {}
        self.path = path
        self._latched = 0
        self._witness = (0, 0)
        self._map: mmap.mmap | None = None
        self._shared: memoryview | None = None
        if path is not None:
            self._map, self._shared = _open_shared(path)

    # -- the mapping view -------------------------------------------------------------
    def get(self, slot: int, default: int = 0) -> int:
        """The mark a call on ``slot`` presents: the higher of this process's and the shared."""
        own = self.own.get(slot, default)
        shared = self._shared
        if shared is None:
            return own
        other: int = shared[slot]
        return other if other > own else own

    def __getitem__(self, slot: int) -> int:
        mark = self.get(slot)
        if not mark:
            raise KeyError(slot)
        return mark

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < SLOTS and self.get(slot) > 0

    def items(self) -> Iterator[tuple[int, int]]:
        if self._shared is None:
            yield from list(self.own.items())
            return
        shared = self._shared.tolist()[:SLOTS]
        own = self.own
        for slot, mark in enumerate(shared):
            mark = max(mark, own.get(slot, 0))
            if mark:
                yield slot, mark

    def __iter__(self) -> Iterator[int]:
        return (slot for slot, _ in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    def snapshot(self) -> dict[int, int]:
        """Every mark as a plain dict (slot → mark), read now."""
        return dict(self.items())

    # -- changes ----------------------------------------------------------------------
    def raise_to(self, slot: int, mark: int) -> None:
        """Raise ``slot``'s mark to ``mark`` (nothing when it is not higher)."""
        if mark > self.own.get(slot, 0):
            self.own[slot] = mark
        shared = self._shared
        if shared is not None and mark > shared[slot]:
            shared[slot] = mark

    __setitem__ = raise_to

    def merge(self, marks: dict[int, int]) -> None:
        """Raise every slot of ``marks`` (the state file's, at start and every check)."""
        for slot, mark in marks.items():
            self.raise_to(slot, mark)

    def forget_own(self) -> None:
        """Drop this process's own marks (a process restart in the model checker); the shared
        marks stay, as the file outlives a process."""
        self.own.clear()

    clear = forget_own

    # -- the latch --------------------------------------------------------------------
    @property
    def latched_at_ms(self) -> int:
        """When a process of this data dir met a slot behind its mark (0: never)."""
        return int(self._shared[_LATCH]) if self._shared is not None else self._latched

    def latch(self, at_ms: int) -> None:
        if self._shared is not None:
            if not self._shared[_LATCH]:
                self._shared[_LATCH] = at_ms
        elif not self._latched:
            self._latched = at_ms

    # -- the witness ------------------------------------------------------------------
    def witness(self, base: int) -> int:
        """The highest witness value recorded for the baseline ``base`` (0: none)."""
        if self._shared is None:
            return self._witness[1] if self._witness[0] == base else 0
        return int(self._shared[_WITNESS]) if self._shared[_WITNESS_BASE] == base else 0

    def witnessed_at(self) -> int:
        """When (unix seconds) a process of this data dir last recorded a witness value."""
        return int(self._shared[_WITNESS_AT]) if self._shared is not None else self._witness_at

    def record_witness(self, base: int, value: int, *, fresh: bool = False) -> None:
        """Record ``value`` (``fresh``: a new count, the old one expired with its key)."""
        now = int(time.time())
        if self._shared is None:
            if fresh or self._witness[0] != base or value > self._witness[1]:
                self._witness = (base, value)
            self._witness_at = now
            return
        if fresh or self._shared[_WITNESS_BASE] != base:
            self._shared[_WITNESS_BASE] = base
            self._shared[_WITNESS] = value
        elif value > self._shared[_WITNESS]:
            self._shared[_WITNESS] = value
        self._shared[_WITNESS_AT] = now

    def reset(self) -> None:
        """``fencegate init`` (a fresh baseline): every mark and the latch cleared."""
        self.own.clear()
        self._latched = 0
        self._witness = (0, 0)
        if self._shared is not None:
            self._shared[:] = memoryview(bytes(_SIZE)).cast("Q")

    def close(self) -> None:
        if self._shared is not None:
            self._shared.release()
            self._shared = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def reset_file(path: Path) -> None:
    """Clear the marks and the latch of a data dir's marks file, if it has one."""
    if path.exists():
        marks = SlotMarks(path)
        try:
            marks.reset()
        finally:
            marks.close()

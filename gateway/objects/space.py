"""The free-space floor of a local volume: refuse a write before the disk is full.

One worker uploading outputs until the volume is full takes every tenant down with it when
the embedded Redis's AOF shares the volume (with ``appendfsync always`` redis-server exits
on an AOF write error). The file store therefore keeps a floor of free space on its volume,
and on the embedded Redis's volume when they are the same device: an upload that would go
below it is refused with ``507 insufficient_storage`` before a byte is written (from its
``Content-Length``) and while it streams (checked every :data:`CHECK_EVERY` bytes), and the
partial object is removed. ``statvfs`` is asked at most every :data:`FRESH_SECONDS`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CHECK_EVERY", "FRESH_SECONDS", "SpaceFloor"]

CHECK_EVERY = 1024 * 1024
FRESH_SECONDS = 0.5


@dataclass
class SpaceFloor:
    """Keep ``floor`` bytes free on the volume of ``path`` (0: no floor)."""

    path: Path
    floor: int
    _free: int = field(default=0, init=False)
    _at: float = field(default=-1.0, init=False)

    def free(self) -> int:
        """Bytes an unprivileged writer may still use on the volume (cached briefly)."""
        now = time.monotonic()
        if now - self._at > FRESH_SECONDS:
            st = os.statvfs(self.path)
            self._free, self._at = st.f_bavail * st.f_frsize, now
        return self._free

    def room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes leave the floor free (after what is already written)."""
        if self.floor <= 0:
            return True
        return self.free() - size >= self.floor

    def spent(self, size: int) -> None:
        """Count ``size`` bytes just written against the cached reading."""
        self._free -= size

    @staticmethod
    def same_volume(a: Path, b: Path) -> bool:
        try:
            return os.stat(a).st_dev == os.stat(b).st_dev
        except OSError:
            return False

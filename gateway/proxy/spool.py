"""Proxied request bodies too long to hold in memory: a spool file each, and the bytes spooled.

A body longer than ``proxy.buffer_bytes`` is written to a file of its own in the spool
directory (:class:`SpoolFile`, mode 0600) as it is read, and the upstream is sent the file's
bytes, streamed. The bytes spooled at once are counted per tenant and in all
(:class:`SpoolLedger`, one per gateway process): a write past ``spool_bytes_per_tenant`` or
``spool_bytes_total`` is refused (503 ``too_many_held``, ``Retry-After``), so one tenant
cannot fill the disk or take the others' room. A file is removed, and its bytes given back,
exactly once (:meth:`SpoolFile.discard`), whatever ended the request.

Each gateway process spools into a directory of its own under the spool directory
(:class:`SpoolArea`), held by an exclusive ``flock`` on its ``.lock`` for the process's life.
When a process starts spooling it removes every other directory whose lock nobody holds: the
kernel drops a lock when its process ends, however it ends (SIGKILL, OOM, a crash), so the
files of a dead process are reclaimed by the next one, and a live process's never are.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import BinaryIO

from gateway.core.errors import TooManyHeld

__all__ = ["SpoolArea", "SpoolFile", "SpoolLedger", "SpooledBody"]

RETRY_AFTER_SECONDS = 1


def _full(detail: str, limit: str) -> TooManyHeld:
    """The tenant's (or every tenant's) spooled bytes are at their cap: 503, retry later."""
    return TooManyHeld(detail, status=503, limit=limit, retry_after=RETRY_AFTER_SECONDS)


class SpoolLedger:
    """The bytes spooled at once, per tenant and in all (0 caps: none)."""

    def __init__(self, per_tenant: int, total: int) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self.held: defaultdict[str, int] = defaultdict(int)
        self.all = 0

    def take(self, tenant: str, n: int) -> None:
        """Count ``n`` more bytes of ``tenant``'s, or 503 ``too_many_held`` (nothing counted)."""
        if self.per_tenant and self.held[tenant] + n > self.per_tenant:
            raise _full(
                f"tenant {tenant!r} has {self.held[tenant]} bytes of request bodies spooled, "
                f"proxy.spool_bytes_per_tenant is {self.per_tenant}: nothing was sent",
                "proxy.spool_bytes_per_tenant",
            )
        if self.total and self.all + n > self.total:
            raise _full(
                f"proxy.spool_bytes_total ({self.total}) of request bodies are spooled: "
                "nothing was sent",
                "proxy.spool_bytes_total",
            )
        self.held[tenant] += n
        self.all += n

    def give(self, tenant: str, n: int) -> None:
        self.held[tenant] -= n
        self.all -= n
        if self.held[tenant] <= 0:
            del self.held[tenant]


def _locked_by_nobody(lock: Path) -> bool:
    """True when no process holds ``lock`` (the check takes it and lets it go at once)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True  # being removed by another sweep
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the lock if it was taken
    return True


class SpoolArea:
    """This process's spool directory under ``root``, locked for the process's life."""

    def __init__(self, root: Path) -> None:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # made under a name the sweep ignores, locked, then renamed (atomic): a directory the
        # sweep considers always has its lock, so a process starting beside it never takes it
        # for a dead one's
        fresh = Path(tempfile.mkdtemp(prefix=".new-", dir=root))
        self._lock = os.open(fresh / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.directory = root / f"p{os.getpid()}-{fresh.name[len('.new-') :]}"
        fresh.rename(self.directory)
        self.reclaimed = 0
        for other in root.iterdir():
            if other == self.directory or not other.is_dir():
                continue
            if other.name.startswith("p") and _locked_by_nobody(other / ".lock"):
                shutil.rmtree(other, ignore_errors=True)
                self.reclaimed += 1

    def close(self) -> None:
        """Remove this process's directory and let its lock go (at shutdown)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._lock)


class SpooledBody:
    """A complete spooled body: what the upstream is sent (each send opens it anew)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size

    def open(self) -> BinaryIO:
        return self.path.open("rb")


class SpoolFile:
    """One request's spool file, written as its body is read; counted in the ledger."""

    def __init__(self, directory: Path, ledger: SpoolLedger, tenant: str) -> None:
        self.ledger = ledger
        self.tenant = tenant
        self.size = 0
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="body-", dir=directory)  # mode 0600
        self.path = Path(name)
        self.file: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        assert self.file is not None
        self.ledger.take(self.tenant, len(data))
        self.size += len(data)
        self.file.write(data)

    def body(self) -> SpooledBody:
        """The body, complete (the file closed for writing)."""
        assert self.file is not None
        self.file.close()
        self.file = None
        return SpooledBody(self.path, self.size)

    def discard(self) -> None:
        """Remove the file and give its bytes back (again: nothing)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.size >= 0:
            self.path.unlink(missing_ok=True)
            self.ledger.give(self.tenant, self.size)
            self.size = -1

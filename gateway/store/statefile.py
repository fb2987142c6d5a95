"""The gateway's state file: what this deployment has seen of its Redis, where a restart finds it.

``<redis.data_dir>/fencegate.state`` holds one JSON object::

    {"initialised": true, "epoch": 17, "slots": "<base64>"}

- ``initialised``: this data dir initialised a Redis once (a wiped Redis is then never
  mistaken for a new one; the file existing says the same).
- ``epoch``: the highest Redis epoch (``fg:epoch``) seen.
- ``slots``: per Redis Cluster slot, the highest value of the slot's marker (its write
  counter, see ``gateway/store/lua/_prelude.lua``) seen in a script's reply. A Redis whose
  marker is below it lost writes the gateway saw acknowledged (a restored backup).
  Stored as the base64 of 16,384 unsigned 64-bit little-endian integers, slot by slot
  (0: never seen): about 175 kB, read, merged and written in well under a millisecond of
  CPU, where a JSON object of 16,384 numbers took ~20 ms to parse.

Several processes share the file (``serve --workers N``, ``fencegate init``): every write
takes an advisory lock (``fcntl.flock`` on ``fencegate.state.lock``), reads the file, merges
(per slot the maximum, epoch the maximum, ``initialised`` or-ed), writes a temporary file of
its own (pid and a random suffix in the name), fsyncs it and renames it over the old one
(``os.replace``), then fsyncs the directory. A reader without the lock sees the old or the
new file, never a mix. Only ``fencegate init`` replaces the content (``reset``): a fresh
start of a Redis is a new baseline.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import secrets
import sys
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import structlog

from gateway.store.keys import SLOTS

__all__ = ["State", "read", "update"]

log = structlog.get_logger("fencegate.state")


@dataclass(slots=True)
class State:
    initialised: bool = False
    epoch: int = 0
    slots: dict[int, int] = field(default_factory=dict)


def _empty() -> array[int]:
    return array("Q", bytes(8 * SLOTS))


def _decode(text: str) -> array[int]:
    marks = array("Q")
    marks.frombytes(base64.b64decode(text, validate=True))
    if len(marks) != SLOTS:
        raise ValueError(f"{len(marks)} slot marks, expected {SLOTS}")
    if sys.byteorder == "big":  # pragma: no cover
        marks.byteswap()
    return marks


def _encode(marks: array[int]) -> str:
    if sys.byteorder == "big":  # pragma: no cover
        marks = array("Q", marks)
        marks.byteswap()
    return base64.b64encode(marks.tobytes()).decode()


def _read_raw(path: Path) -> tuple[bool, int, array[int]] | None:
    """(initialised, epoch, marks) of the file; None when there is none. A file that exists
    but cannot be parsed still says this data dir was initialised (and is logged)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = orjson.loads(raw)
        slots = doc.get("slots")
        marks = _decode(slots) if slots else _empty()
        return bool(doc.get("initialised", True)), int(doc.get("epoch", 0)), marks
    except (ValueError, TypeError, AttributeError) as exc:
        log.error("state_file_unreadable", path=str(path), error=str(exc))
        return True, 0, _empty()


def read(path: Path | None) -> State:
    """The file's content (slots: only those with a mark); an empty state when there is none."""
    found = _read_raw(path) if path is not None else None
    if found is None:
        return State()
    initialised, epoch, marks = found
    return State(initialised, epoch, {s: m for s, m in enumerate(marks) if m})


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, initialised: bool, epoch: int, marks: array[int]) -> None:
    body = orjson.dumps({"initialised": initialised, "epoch": epoch, "slots": _encode(marks)})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def update(
    path: Path,
    *,
    epoch: int = 0,
    slots: Mapping[int, int] | None = None,
    initialised: bool = False,
    reset: bool = False,
) -> None:
    """Merge into the file under its lock: per slot the maximum, the epoch the maximum,
    ``initialised`` or-ed. ``reset`` starts from an empty state instead of the file's
    (``fencegate init``). Nothing is written when the merge changes nothing."""
    with _locked(path):
        found = None if reset else _read_raw(path)
        was_initialised, was_epoch, marks = found or (False, 0, _empty())
        changed = found is None
        for slot, mark in (slots or {}).items():
            if mark > marks[slot]:
                marks[slot] = mark
                changed = True
        now_initialised = was_initialised or initialised
        now_epoch = max(was_epoch, epoch)
        if changed or (now_initialised, now_epoch) != (was_initialised, was_epoch):
            _write(path, now_initialised, now_epoch, marks)

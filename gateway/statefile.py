"""The gateway's state file: what this deployment has seen of its Redis, where a restart finds it.

``<redis.data_dir>/fencegate.state`` holds one JSON object::

    {"initialised": true, "epoch": 17, "slots": {"5461": 1718000000000123, ...}}

- ``initialised``: this data dir initialised a Redis once (a wiped Redis is then never
  mistaken for a new one; the file existing says the same).
- ``epoch``: the highest Redis epoch (``fg:epoch``) seen.
- ``slots``: per Redis Cluster slot, the highest value of the slot's marker (its write
  counter, see ``gateway/lua/_prelude.lua``) seen in a script's reply. A Redis whose
  marker is below it lost writes the gateway saw acknowledged (a restored backup).

Several processes share the file (``serve --workers N``, ``fencegate init``): every write
takes an advisory lock (``fcntl.flock`` on ``fencegate.state.lock``), reads the file, merges
(per slot the maximum, epoch the maximum, ``initialised`` or-ed), writes a temporary file of
its own (pid and a random suffix in the name), fsyncs it and renames it over the old one
(``os.replace``), then fsyncs the directory. A reader without the lock sees the old or the
new file, never a mix. Only ``fencegate init`` replaces the content (``reset``): a fresh
start of a Redis is a new baseline.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import structlog

__all__ = ["State", "read", "update"]

log = structlog.get_logger("fencegate.state")


@dataclass(slots=True)
class State:
    initialised: bool = False
    epoch: int = 0
    slots: dict[int, int] = field(default_factory=dict)


def _parse(raw: bytes) -> State:
    doc = orjson.loads(raw)
    slots = doc.get("slots") or {}
    return State(
        initialised=bool(doc.get("initialised", True)),
        epoch=int(doc.get("epoch", 0)),
        slots={int(s): int(v) for s, v in slots.items()},
    )


def read(path: Path | None) -> State:
    """The file's content; an empty state when there is none. A file that exists but cannot
    be parsed still says this data dir was initialised (and is logged)."""
    if path is None:
        return State()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return State()
    try:
        return _parse(raw)
    except (ValueError, TypeError, AttributeError) as exc:
        log.error("state_file_unreadable", path=str(path), error=str(exc))
        return State(initialised=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, state: State) -> None:
    body = orjson.dumps(
        {"initialised": state.initialised, "epoch": state.epoch, "slots": state.slots},
        option=orjson.OPT_NON_STR_KEYS,
    )
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
) -> State:
    """Merge into the file under its lock and return what it holds now.

    Per slot the maximum, the epoch the maximum, ``initialised`` or-ed; ``reset`` starts
    from an empty state instead of the file's (``fencegate init``). Nothing is written
    when the merge changes nothing.
    """
    with _locked(path):
        current = State() if reset else read(path)
        merged = State(
            initialised=current.initialised or initialised,
            epoch=max(current.epoch, epoch),
            slots=dict(current.slots),
        )
        for slot, mark in (slots or {}).items():
            if mark > merged.slots.get(slot, 0):
                merged.slots[slot] = mark
        if reset or merged != current or not path.exists():
            _write(path, merged)
        return merged

"""The replicated acknowledgement: no verdict before its writes are fsynced on R replicas.

Redis replication is asynchronous. A fence bump that the primary acknowledged (even with
``appendfsync always``) is lost when the primary dies before its replica received it and
that replica is promoted: a zombie of the old generation is then admitted. With
``[redis] replicas_acked = R`` the auto-pipeline (:mod:`gateway.batching`) ends every
batch, on the same connection and in the same write as its scripts, with:

``INCR fg-ack:{<s>}``
    the covering write. ``WAIT``/``WAITAOF`` only cover the writes of *their own
    connection*; a script that wrote nothing (a replay, "already current", a retried admit
    answered from memory) would be "confirmed" at once, even when what it *read* (written
    by another connection a moment ago) is not on any replica yet. After this write the
    connection's replication offset is the primary's current one, so the two waits below
    cover everything the batch's scripts read as well as what they wrote. ``<s>`` is the
    slot tag of the batch's first key, so the key lives on the node the batch went to
    (Cluster). The key is outside ``fg:``: a wiped Redis stays "without fencegate data".
``WAIT R T``
    until R replicas received it. In front of ``WAITAOF`` because it asks the replicas for
    an acknowledgement now (``REPLCONF GETACK``); ``WAITAOF`` alone waited for their
    once-a-second report (~1 s per batch, measured on Valkey 8.1.8).
``WAITAOF 1 R T``
    until the primary and R replicas fsynced it to their AOF.

Fewer than R (or an error reply, e.g. ``READONLY`` from a demoted primary) fails every
command of the batch with :class:`NotReplicated`: the store turns it into a 503
``store_unavailable`` whose script *did* run (``maybe_applied``), so an admit is given up in
Redis once Redis acknowledges again (see docs/reliability.md). Never use redis-py's own
``wait()``/``waitaof()``: they go to another pooled connection (or, on ``RedisCluster``, to
the default node) and prove nothing about the script's write.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.store.keys import key_slot, slot_tags

__all__ = ["AckPolicy", "AckStatus", "NotReplicated", "ack_key", "hash_slot"]

ACK_PREFIX = "fg-ack:"  # not "fg:": has_fencegate_data() must not see it on a wiped Redis


class NotReplicated(RedisConnectionError):
    """The batch's scripts ran on the primary, but R replicas did not acknowledge it in time.

    A connection error by type, so every caller already treats it as "Redis could not
    serve us" (503); the store reads :attr:`applied` to know the script did run.
    """

    applied = True
    # Cluster: the covering write was redirected (MOVED/ASK): the router's slot map is stale
    stale_map = False


def hash_slot(key: str) -> int:
    """The Cluster slot of a key: its ``{hash tag}`` if it has a non-empty one, else the key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key_slot(key[start + 1 : end])
    return key_slot(key)


def ack_key(key: str) -> str:
    """The covering write's key in the slot of ``key`` (at most one per slot: 16,384)."""
    return ACK_PREFIX + "{" + slot_tags()[hash_slot(key)] + "}"


def first_key(args: Sequence[Any]) -> str | None:
    """The first key of a command as the batcher sends it (EVALSHA/EVAL or a plain one)."""
    name = str(args[0]).upper()
    if name in ("EVALSHA", "EVAL"):
        return str(args[3]) if int(args[2]) > 0 else None
    return str(args[1]) if len(args) > 1 else None


@dataclass
class AckStatus:
    """What one primary's acknowledgements looked like lately (readiness, metrics, logs)."""

    node: str = ""
    acked_batches: int = 0
    failed_batches: int = 0
    failed_commands: int = 0
    last_ok: bool | None = None  # None: no batch yet
    last_reason: str = ""
    last_at: float = field(default=0.0)

    def note(self, ok: bool, reason: str, commands: int) -> None:
        self.last_ok, self.last_reason, self.last_at = ok, reason, time.monotonic()
        if ok:
            self.acked_batches += 1
        else:
            self.failed_batches += 1
            self.failed_commands += commands


@dataclass(frozen=True)
class AckPolicy:
    """``WAIT R T`` + ``WAITAOF 1 R T`` behind a covering write, on the batch's connection."""

    replicas: int
    timeout_ms: int

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.timeout_ms < 1:  # WAIT ... 0 would block forever
            raise ValueError("an acknowledgement needs replicas >= 1 and timeout_ms >= 1")

    def tail(self, key: str) -> list[tuple[str, ...]]:
        """The three commands that end a batch whose first key is ``key``."""
        r, t = str(self.replicas), str(self.timeout_ms)
        return [("INCR", ack_key(key)), ("WAIT", r, t), ("WAITAOF", "1", r, t)]

    def check(self, replies: Sequence[Any]) -> str:
        """'' when the tail's replies acknowledge the batch; else why not (for the 503)."""
        incr, wait, waitaof = replies
        for reply in replies:
            if isinstance(reply, BaseException):
                return f"the acknowledgement failed: {reply}"
        del incr
        if int(wait) < self.replicas:
            return (
                f"{int(wait)} of {self.replicas} replicas received the write within "
                f"{self.timeout_ms} ms"
            )
        local, remote = (int(x) for x in waitaof)
        if local < 1:
            return "the primary did not fsync the write to its AOF"
        if remote < self.replicas:
            return (
                f"{remote} of {self.replicas} replicas fsynced the write within "
                f"{self.timeout_ms} ms"
            )
        return ""

    def failure(self, reason: str) -> NotReplicated:
        return NotReplicated(
            f"Redis did not acknowledge the write on {self.replicas} replica(s): {reason}; "
            "nothing is dispatched for it"
        )

"""The scripts' reply codes, one enum per script (each script's header lists its replies).

A script answers ``{code, …}`` (after the slot counter the store strips); Python compares the
code with these, never with a bare number. The codes every fenced script shares (the prelude
and the fence guard, ``lua/_prelude.lua``) are :class:`Reply`'s; a script's own enum repeats
those it answers, so that one enum reads one script.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "AdmitReply",
    "CancelReply",
    "CheckpointReply",
    "CompleteReply",
    "OutputRecordReply",
    "OutputStageReply",
    "RecordReply",
    "RegisterReply",
    "RelayReply",
    "Reply",
    "ResolveReply",
]


class Reply(IntEnum):
    """Shared by every script that runs through the prelude."""

    DATA_LOST = 8  # {8} the slot's durability marker is missing; {8, 'behind', seen}
    REJECTED = 9  # {9, reason, presented, current, audit_id, pinned_sha}
    TOO_LATE = 11  # {11, now_ms}: it arrived after its "run before" (admit-8, relay-6)


class AdmitReply(IntEnum):
    """admit-8.lua"""

    ADMITTED = 0
    REPLAY = 1
    IN_PROGRESS = 2
    UNKNOWN = 3
    QUEUED = 4
    QUEUED_BEFORE = 5  # an async repeat: the relay has the step already
    REJECTED = Reply.REJECTED
    VOIDED = 10  # the gateway gave this request up before it ran
    TOO_LATE = Reply.TOO_LATE
    OVER_QUOTA = 12


class RegisterReply(IntEnum):
    """register-2.lua"""

    REGISTERED = 0
    CURRENT = 1  # that generation was already current
    REJECTED = Reply.REJECTED


class CancelReply(IntEnum):
    """cancel-1.lua"""

    CANCELLED = 0
    ALREADY = 1
    COMPLETED = 2  # the job completed: not cancelled


class ResolveReply(IntEnum):
    """resolve-6.lua"""

    RESOLVED = 0
    NOT_FOUND = 1
    KNOWN = 2  # the step's outcome is known (or still in flight): not changed


class RecordReply(IntEnum):
    """record-4.lua"""

    RECORDED = 0
    LOST = 1  # another dispatch holds the step, or it was resolved meanwhile


class RelayReply(IntEnum):
    """relay-6.lua"""

    CLAIMED = 0
    HELD = 2  # another dispatch holds the step
    NOTHING = 3  # nothing to send: the step left the queue
    TOO_LATE = Reply.TOO_LATE


class CheckpointReply(IntEnum):
    """checkpoint-3.lua"""

    WRITTEN = 0
    REJECTED = Reply.REJECTED
    REFUSED = 12  # a quota: nothing written


class CompleteReply(IntEnum):
    """complete-3.lua"""

    COMPLETED = 0
    REPLAY = 1
    NOT_RECORDED = 7  # an output is not recorded by this generation
    REJECTED = Reply.REJECTED


class OutputStageReply(IntEnum):
    """output-stage-3.lua"""

    STAGED = 0
    IN_PROGRESS = 2  # an upload of this output by this generation is still running
    REJECTED = Reply.REJECTED


class OutputRecordReply(IntEnum):
    """output-record-3.lua"""

    RECORDED = 0  # recorded; abandon, uncopy: the claim ended; copy: the copy is claimed
    LOST = 1  # another stage of this output replaced this upload (or another copy holds it)
    IN_PROGRESS = 2  # copy: another copy of this upload is still running
    REJECTED = Reply.REJECTED

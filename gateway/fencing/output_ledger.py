"""The output ledger: what each tenant has in the output store, in Redis.

Cap-free bookkeeping shared by the uploads, the completion and the sweeper; the caps
(``quotas.output_bytes``, ``quotas.output_objects``) are applied by
:meth:`gateway.fencing.quotas.Quotas.reserve_output`, whose module docstring describes the
counters: ``fg:quota:{<tenant>}:out`` (object key -> bytes stored there),
``fg:quota:{<tenant>}:out_up`` (``"<object key> <upload id>"`` -> bytes reserved while that
upload runs) and ``fg:quota:{<tenant>}:out_bytes`` (their sum), kept by
:class:`gateway.store.output_records.OutputRecords` (its scripts are the only writes).

A pre-signed URL's reservation is keyed by the staging key its URL writes
(:func:`gateway.objects.signed_key`): it is held while the URL may still write
(:func:`url_valid_until`), until the completion that copied its object deletes that object.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.records import OutputRecord
from gateway.objects import ObjectStore, ObjectStoreError, parse_output_key, parse_signed_key
from gateway.store.output_records import OutputRecords

__all__ = ["URL_SKEW_MS", "OutputLedger", "made_at_ms", "new_upload_id", "url_valid_until"]

log = structlog.get_logger("fencegate.quotas")

# An upload's reservation comes before its stage (the outputs-hash entry the reconciliation
# checks it against), and its settlement after its record: one with no entry yet, or whose
# entry was recorded, younger than this is not given back by a reconciliation, so a
# reservation whose stage or settlement is on its way is not taken for one whose upload ended
# (an abandoned one: its entry's deadline decides, as before).
RESERVATION_GRACE_MS = 60_000


def new_upload_id(now_ms: int) -> str:
    """An upload's id: when it was made (``now_ms``: unix ms on Redis's clock, hex) and 32
    random bits. Redis's clock, not this host's: every gateway's reconciliation reads the
    age of every gateway's ids, whatever their hosts' clocks say."""
    return f"{now_ms:x}{secrets.token_hex(4)}"


# A pre-signed URL is signed to expire ``url_ms`` after its upload id was made (Redis's
# clock, read through this host's); the store judges the expiry on its own clock. What may
# still write through a URL is judged with this much to spare for those clocks' skew (hosts
# kept in time by NTP).
URL_SKEW_MS = 2_000


def url_valid_until(upload: str, url_ms: int) -> int:
    """Until when (unix ms, Redis's clock) a pre-signed URL of ``upload``, valid ``url_ms``,
    may still write its staging key (:meth:`OutputService.upload_url` signs it to expire
    ``url_ms`` after its id was made), with :data:`URL_SKEW_MS`."""
    return made_at_ms(upload) + url_ms + URL_SKEW_MS


def made_at_ms(upload: str) -> int:
    """When :func:`new_upload_id` made ``upload`` (0: an id of another form)."""
    try:
        return int(upload[:-8], 16) if len(upload) > 8 else 0
    except ValueError:
        return 0


class OutputLedger:
    """The charges of the objects a tenant has in the output store (the module docstring):
    cap-free bookkeeping shared by the uploads, the completion and the sweeper; the caps
    are :meth:`Quotas.reserve_output`'s."""

    def __init__(
        self,
        records: OutputRecords,
        objects: ObjectStore,
        clock: Callable[[], int],
        *,
        url_ms: int,
    ) -> None:
        self._records = records
        self._objects = objects
        self._clock = clock  # Redis's clock, unix ms (Store.redis_clock_ms)
        self.url_ms = url_ms  # how long a pre-signed URL is valid (outputs.upload_timeout_seconds)
        self._reconciled: dict[str, float] = {}

    async def reserve(
        self,
        tenant: str,
        key: str,
        upload: str,
        amount: int,
        byte_cap: int,
        object_cap: int,
        *,
        replaces: str = "",
    ) -> int:
        """A :class:`~gateway.store.output_records.LedgerReply` (over the byte or the object
        cap: nothing reserved), else the bytes charged with this reservation. ``replaces``:
        the upload of the same key whose reservation this one takes over (a new pre-signed
        URL for the output)."""
        return await self._records.reserve(
            tenant,
            key=key,
            upload=upload,
            amount=amount,
            byte_cap=byte_cap,
            object_cap=object_cap,
            replaces=replaces,
        )

    async def settle(self, tenant: str, key: str, upload: str, size: int | None) -> None:
        """``upload`` ended: ``size`` the bytes now stored at ``key``, None for nothing
        (failed, refused before a byte). Best effort: a lost settlement stays reserved until
        a reconciliation gives it back."""
        try:
            await self._records.settle(tenant, key=key, upload=upload, size=size)
        except StoreUnavailable:
            log.warning("quota_settle_failed", key=key, kind="output")

    async def released(self, tenant: str, objects: list[str], uploads: list[str]) -> None:
        """The objects ``objects`` left the store; ``uploads`` (``"<key> <upload>"``) wrote
        nothing that is left there. Both are given back. Best effort (see :meth:`settle`)."""
        args = [a for k in objects for a in ("O", k, "")]
        args += [a for u in uploads for a in ("U", u, "")]
        for i in range(0, len(args), 3000):
            try:
                await self._records.fix(tenant, args[i : i + 3000])
            except StoreUnavailable:
                log.warning("quota_release_failed", tenant=tenant, kind="output")
                return

    async def reconcile(self, tenant: str) -> int:
        """Give back the charges of the tenant's objects that left the store and of its
        reservations whose upload ended (module docstring); the entries changed (at most
        once a second per tenant: 0 when skipped)."""
        now = time.monotonic()
        if now - self._reconciled.get(tenant, 0.0) < 1.0:
            return 0
        self._reconciled[tenant] = now
        try:
            charged, reserved = await self._records.charges(tenant)
            if not charged and not reserved:
                return 0
            # listed after the charges were read: an object charged then was written then
            listed = {i.key: i.size async for i in self._objects.list(f"{tenant}/")}
            running = await self._running(tenant, list(reserved))
            now_ms = self._clock()
        except (StoreUnavailable, ObjectStoreError, OSError) as exc:
            log.warning("quota_reconcile_failed", tenant=tenant, kind="output", error=str(exc))
            return 0
        ops: list[str] = []
        for key, charge in charged.items():
            if key not in listed:  # deleted: a key never receives an object again then
                ops += ["o", key, charge]
        reserved_keys = {field.rpartition(" ")[0] for field in reserved}
        for key, size in listed.items():
            if key not in charged and key not in reserved_keys:
                # written with no charge left for it (a pre-signed URL used again after the
                # completion gave its reservation back): charged from now on
                ops += ["s", key, str(size)]
        for field, charge in reserved.items():
            key, _, upload = field.rpartition(" ")
            if parse_signed_key(key) is not None:
                if url_valid_until(upload, self.url_ms) > now_ms:
                    continue  # its URL may still write: held
            else:
                entry = running.get(field)
                if (
                    entry is not None
                    and (entry.upload, entry.state) == (upload, "staged")
                    and max(entry.deadline_ms, entry.copy_deadline_ms) > now_ms
                ):
                    continue  # still running (or a completion copying a pre-signed upload)
                if (
                    entry is not None
                    and (entry.upload, entry.state) == (upload, "recorded")
                    and now_ms - entry.recorded_ms < RESERVATION_GRACE_MS
                ):
                    # recorded just now: the upload's settlement follows its record, and its
                    # object may have been written after the listing above (given back here
                    # and not charged, the bytes would be free until that settlement)
                    continue
                if entry is None and now_ms - made_at_ms(upload) < RESERVATION_GRACE_MS:
                    continue  # reserved just now, not staged yet: its stage may be on its way
            ops += ["u", field, charge]
            if key in listed:
                ops += ["s", key, str(listed[key])]
        changed = 0
        for i in range(0, len(ops), 3000):
            try:
                await self._records.fix(tenant, ops[i : i + 3000])
            except StoreUnavailable:
                return changed
            changed += len(ops[i : i + 3000]) // 3
        if changed:
            log.info("output_quota_reconciled", tenant=tenant, entries=changed)
        return changed

    async def _running(self, tenant: str, fields: list[str]) -> dict[str, OutputRecord]:
        """The outputs-hash entries of the reservations ``fields`` (those that have one)."""
        asked: list[tuple[str, str]] = []
        for field in fields:
            parsed = parse_output_key(field.rpartition(" ")[0])
            if parsed is not None and parsed[0] == tenant:
                asked.append((field, f"{parsed[2]}/{parsed[3]}"))
        if not asked:
            return {}
        found = await self._records.entries_of(
            tenant, [(field.split("/", 2)[1], at) for field, at in asked]
        )
        return {
            field: OutputRecord.parse(at, raw)
            for (field, at), raw in zip(asked, found, strict=True)
            if raw is not None
        }

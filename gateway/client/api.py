"""The SDK's asyncio API: :class:`Scheduler`, :class:`FencedJob`, tokens and problem errors."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import aiohttp

from gateway.client.jobdata import (
    SUPERSEDED,
    CheckpointValue,
    Completion,
    JobData,
    OutputUploaded,
)
from gateway.client.proxying import FencedStep, fenced_step
from gateway.core.errors import (
    AdapterUnavailable,
    BadToken,
    EffectFailed,
    EffectInProgress,
    FencegateError,
    GatewayUnreachable,
    IntentMismatch,
    InvalidRequest,
    JobCancelled,
    JobCompleted,
    LeaseExpired,
    OutcomeUnknown,
    OutputNotStaged,
    Rejection,
    StaleGeneration,
    StoreUnavailable,
    Superseded,
    TryLater,
    UnknownAdapter,
    UnregisteredGeneration,
    error_for_code,
)
from gateway.core.records import EffectResult
from gateway.core.tokens import sign_token

__all__ = [
    "AdapterUnavailable",
    "BadToken",
    "CheckpointValue",
    "Completion",
    "EffectFailed",
    "EffectInProgress",
    "EffectResult",
    "FencedJob",
    "FencegateError",
    "GatewayUnreachable",
    "Generation",
    "IntentMismatch",
    "InvalidRequest",
    "JobCancelled",
    "JobCompleted",
    "LeaseExpired",
    "OutcomeUnknown",
    "OutputNotStaged",
    "OutputUploaded",
    "Rejection",
    "Scheduler",
    "StaleGeneration",
    "StoreUnavailable",
    "Superseded",
    "TryLater",
    "UnknownAdapter",
    "UnregisteredGeneration",
    "mint_token",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Generation:
    job_id: str
    generation: int
    token: str
    lease_expires_at: str | None
    created: bool


def mint_token(
    signing_key: str | bytes, tenant: str, job_id: str, generation: int, *, ttl_seconds: int
) -> str:
    """A signed fencing token, as ``POST …/generations`` returns them (for external schedulers).

    Use the gateway's signing key (the first of ``auth.token_signing_key_env``).
    """
    key = signing_key.encode() if isinstance(signing_key, str) else signing_key
    return sign_token(key, tenant, job_id, generation, int(time.time()) + ttl_seconds)


class _Client:
    """An aiohttp session bound to one gateway and one key."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        data: Any = None,
    ) -> tuple[int, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._own_session = True
        try:
            async with self._session.request(
                method,
                self._base + path,
                json=json,
                data=data,
                headers={**self._headers, **(headers or {})},
                params=params,
            ) as resp:
                body = await resp.json(content_type=None) if resp.content_length != 0 else None
                if resp.status >= 400:
                    raise problem_error(resp.status, body)
                return resp.status, body
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GatewayUnreachable(f"no answer from the gateway: {exc!r}") from exc


def problem_error(status: int, body: Any) -> FencegateError:
    """Rebuild the gateway's error from a problem document."""
    if not isinstance(body, dict) or "code" not in body:
        return FencegateError(f"HTTP {status}: {body!r}", status=status)
    fields = {
        k: v for k, v in body.items() if k not in ("type", "title", "status", "detail", "code")
    }
    return error_for_code(str(body["code"]))(str(body.get("detail", "")), status=status, **fields)


class Scheduler(_Client):
    """The scheduler's side: register generations at takeover, cancel, inspect."""

    async def register(
        self, job_id: str, generation: int | None = None, lease_ms: int | None = None
    ) -> Generation:
        body: dict[str, int] = {}
        if generation is not None:
            body["generation"] = generation
        if lease_ms is not None:
            body["lease_ms"] = lease_ms
        status, out = await self._call("POST", f"/v1/jobs/{job_id}/generations", json=body)
        return Generation(
            job_id=out["job_id"],
            generation=out["generation"],
            token=out["token"],
            lease_expires_at=out["lease_expires_at"],
            created=status == 201,
        )

    async def cancel(self, job_id: str) -> dict[str, Any]:
        _, out = await self._call("POST", f"/v1/jobs/{job_id}/cancel")
        return dict(out)

    async def job(self, job_id: str) -> dict[str, Any]:
        _, out = await self._call("GET", f"/v1/jobs/{job_id}")
        return dict(out)

    async def audit(
        self, *, job_id: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> dict[str, Any]:
        params = {"limit": str(limit)}
        if job_id:
            params["job"] = job_id
        if cursor:
            params["cursor"] = cursor
        _, out = await self._call("GET", "/v1/audit/rejections", params=params)
        return dict(out)


class FencedJob(_Client, JobData):
    """A worker's hold on one job generation: fenced effects, checkpoints, outputs and
    completion (:class:`~gateway.client.jobdata.JobData`), plus automatic heartbeats."""

    def __init__(
        self,
        base_url: str,
        job_id: str,
        token: str | int,
        *,
        api_key: str | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float | None = 5.0,
        retries: int = 5,
        backoff: float = 0.1,
        timeout: float = 60.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, session=session)
        self.job_id = job_id
        self.token = str(token)
        self.worker_id = worker_id
        self.heartbeat_interval = heartbeat_interval
        self.retries = retries
        self.backoff = backoff
        self.superseded: FencegateError | None = None
        self.completion: Completion | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._beating = asyncio.Lock()  # held while a heartbeat is on its way
        self._beats_held = False

    @contextmanager
    def step(self, name: str) -> Iterator[FencedStep]:
        """Inside the block, a proxied call made through one of the SDK's transports
        (:mod:`gateway.client.proxying`) is step ``name`` of this job, fenced by its token."""
        with fenced_step(self, name) as current:
            yield current

    def _fence_headers(self) -> dict[str, str]:
        h = {"Fencing-Token": self.token}
        if self.worker_id:
            h["Worker-Id"] = self.worker_id
        return h

    async def __aenter__(self) -> FencedJob:
        self._owner = asyncio.current_task()
        self.start_heartbeats()
        return self

    def start_heartbeats(self) -> None:
        """Renew the lease every ``heartbeat_interval`` seconds in a task of the running loop
        (none with no interval), until the job is left (``__aexit__``), completed or
        superseded. ``async with`` calls it; :class:`~gateway.client.sync.SyncFencedJob`
        calls it on its own loop."""
        if self.heartbeat_interval and self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat(self.heartbeat_interval))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        await self.aclose()
        if self.superseded is not None and isinstance(exc, asyncio.CancelledError):
            # We cancelled the work: report why, as the typed error, not as a cancel.
            owner = self._owner
            if owner is not None and owner.uncancel() == 0:
                raise self.superseded from None

    def _supersede(self, err: FencegateError) -> None:
        if self.superseded is None:
            self.superseded = err
            if self._owner is not None and self._owner is not asyncio.current_task():
                self._owner.cancel(f"fencegate: {err.code}")

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            async with self._beating:
                if self._beats_held:
                    continue
                try:
                    await self.heartbeat()
                except JobCompleted:
                    return  # completed (by this generation: a stale one hears stale_generation)
                except SUPERSEDED as err:
                    self._supersede(err)
                    return
                except FencegateError:
                    continue  # gateway or store briefly unavailable: try again next beat

    async def _hold_heartbeats(self, held: bool) -> None:
        self._beats_held = held
        if held:
            async with self._beating:  # the heartbeat on its way, if any, has its answer
                pass

    async def heartbeat(self) -> dict[str, Any]:
        """Is this generation still current? Renews the lease. Raises when superseded."""
        _, out = await self._call(
            "POST", f"/v1/jobs/{self.job_id}/fence", headers=self._fence_headers()
        )
        return dict(out)

    async def effect(
        self, step: str, *, adapter: str, operation: str, payload: Mapping[str, Any]
    ) -> EffectResult:
        """Perform one step's side effect under the fence (retrying only what is safe)."""
        body = {"adapter": adapter, "operation": operation, "payload": dict(payload)}
        attempt = 0
        while True:
            try:
                _, out = await self._call(
                    "POST",
                    f"/v1/jobs/{self.job_id}/effects/{step}",
                    json=body,
                    headers=self._fence_headers(),
                )
            except SUPERSEDED as err:
                self.superseded = self.superseded or err
                raise
            except (EffectInProgress, AdapterUnavailable) as err:
                attempt += 1
                if attempt > self.retries:
                    raise
                delay = self.backoff * 2 ** (attempt - 1) * (1 + random.random())
                if isinstance(err, EffectInProgress):
                    delay = max(delay, min(float(err.fields.get("retry_after") or 0), 30.0))
                await asyncio.sleep(delay)
                continue
            return EffectResult(
                job_id=out["job_id"],
                step=out["step"],
                generation=out["generation"],
                state=out["state"],
                replayed=out["replayed"],
                idempotency_key=out["idempotency_key"],
                adapter=out["adapter"],
                result=out["result"],
            )

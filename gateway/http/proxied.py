"""``/proxy/<upstream>/<rest>``: an unmodified client's request, fenced as one step.

In order, each refusal changing nothing:

1. the raw path after the upstream's name is checked (:func:`gateway.proxy.routing.checked_rest`):
   an escape in any spelling is 400 before anything else is read;
2. the worker's fencegate key (``Authorization: Bearer``, where the SDK puts its API key) is
   authenticated and never forwarded; an upstream that is not configured, or not listed for
   the key's tenant, is the same 404;
3. from here on refusals speak the upstream's ``error_dialect`` (:mod:`gateway.proxy.answer`):
   the method (POST, PUT, PATCH, DELETE; GET and HEAD; else 405), the route allow-list
   (else 403) and the values of ``tenant_header_values``' headers (else 403) — a GET or
   HEAD route is a read, passed through with the tenant's credential, never recorded (with
   ``reads = "fenced"`` only after the fence check of its job and token, ``check-2``), and
   ends here; the
   ``Fencegate-Job`` and ``Fencegate-Step`` headers (else 400; without the step header, the
   upstream's ``step_from`` may name the step: :mod:`gateway.proxy.steps`), ``Fencing-Token``,
   an optional ``Worker-Id``; the body is read and decoded (:mod:`gateway.http.codings`: a
   coding other than ``gzip`` or ``deflate`` is 415, a cut or corrupt stream 400);
4. the step is performed through :meth:`EffectService.perform_with` — the same admit script
   as every effect, adapter ``proxy:<upstream>``, the intent digest of
   :func:`gateway.proxy.intent.proxy_intent` — and the upstream's recorded answer is sent as
   the upstream gave it, with ``Fencegate-Outcome: forwarded`` (this call sent it) or
   ``replayed`` (and ``Idempotent-Replayed: true``: an earlier call's answer, nothing sent).
   A call that finds another dispatching its step waits up to ``in_flight_wait_seconds`` for
   that outcome (then its replay), before ``409 effect_in_progress``.

Only allow-listed request headers are forwarded; the client's ``Idempotency-Key`` is removed
(kept in the record as ``client_key``) and the upstream's idempotency header carries the
step's key instead.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from adapters.base import NotDelivered, Unknown
from gateway.core.errors import (
    AdapterUnavailable,
    EffectFailed,
    EffectInProgress,
    FencegateError,
    Forbidden,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    ReplayUnavailable,
    UnsupportedMediaType,
)
from gateway.core.names import checked_name
from gateway.core.reasons import REFUSALS
from gateway.http import appkeys as K
from gateway.http.auth import Principal, caller_as
from gateway.http.expect import checked_expect, continue_if_expected, deferred
from gateway.http.generations import generation_of
from gateway.http.parsing import worker_id_of
from gateway.http.proxy_body import ProxiedBody, Spooling, read_proxied_body, spool_dir
from gateway.proxy.answer import OUTCOME, refusal
from gateway.proxy.config import Upstream, load_upstreams
from gateway.proxy.forward import ProxyAdapter, Recorded, forward_payload
from gateway.proxy.intent import proxy_intent, spooled_body_digest
from gateway.proxy.routing import (
    SAFE_METHODS,
    UNSAFE_METHODS,
    PathRefused,
    checked_rest,
    normalised_path,
)
from gateway.proxy.spool import SpoolLedger
from gateway.proxy.steps import StepRefused, derive_step
from gateway.runtime.logging import bind, request_field
from gateway.runtime.settings import Settings
from gateway.store.keys import JobKeys

__all__ = ["PREFIX", "PROXY", "Proxy", "mount_proxy", "proxy_request"]

PREFIX = "/proxy/"
_CLIENT_KEY = re.compile(r"[\x20-\x7e]{1,255}")
_QUERY = re.compile(r"[\x21\x22\x24-\x7e]*")  # no "#": a fragment is never sent


@dataclass(frozen=True)
class Proxy:
    upstreams: dict[str, Upstream]
    adapters: dict[str, ProxyAdapter]
    spooling: Spooling


PROXY = web.AppKey("proxy", Proxy)


class StreamedAnswer:
    """The client's side of a response over ``max_response_bytes``
    (:class:`~gateway.proxy.forward.ResponseSink`): started with the upstream's status and
    allowed headers, its bytes queued as the upstream's body is read and written by a task of
    its own, ended (its last chunk) only once the step is recorded.

    The upstream is read at its own pace whatever the client does: a client that hangs up
    takes no more bytes; one that falls more than :data:`LAG_BYTES` behind, or takes longer
    than :data:`END_WAIT_SECONDS` for the rest once the step is recorded, is disconnected
    (an incomplete body, never a complete wrong one). Either way the adapter reads the
    upstream's body to its end, so the record is the same."""

    LAG_BYTES = 1 << 20
    END_WAIT_SECONDS = 30.0

    def __init__(self, request: web.Request, generation: int | None) -> None:
        self.request = request
        self.generation = generation  # None: a read (nothing recorded)
        self.response: web.StreamResponse | None = None
        self.gone = False
        self.sent = 0
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._queued = 0
        self._writer: asyncio.Task[None] | None = None
        self.released: Recorded | None = None  # a released status's answer, this call's

    def release(self, answer: Recorded) -> None:
        self.released = answer

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        response = web.StreamResponse(status=status, headers=CIMultiDict(headers))
        response.headers[OUTCOME] = "forwarded"
        if self.generation is not None:
            response.headers["Fencegate-Generation"] = str(self.generation)
        # sent before the handler returns, so the request middleware's header comes too late
        response.headers["X-Request-Id"] = str(request_field("request_id") or "")
        self.response = response
        bind(streamed=True)
        try:
            await response.prepare(self.request)
        except ConnectionError:
            self.gone = True
            return
        self._writer = asyncio.create_task(self._drain(response))

    def write(self, chunk: bytes) -> None:
        if self.gone or self._writer is None:
            return
        self._queued += len(chunk)
        if self._queued > self.LAG_BYTES:
            self._drop("client_fell_behind")
            return
        self._queue.put_nowait(chunk)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def _drain(self, response: web.StreamResponse) -> None:
        while (chunk := await self._queue.get()) is not None:
            try:
                await response.write(chunk)
            except ConnectionError:
                self.gone = True
                bind(client_gone_after_bytes=self.sent)
                return
            self._queued -= len(chunk)
            self.sent += len(chunk)

    def _drop(self, why: str) -> None:
        self.gone = True
        bind(**{why: self.sent})
        if self._writer is not None:
            self._writer.cancel()
        if self.request.transport is not None:
            self.request.transport.close()

    async def end(self) -> web.StreamResponse:
        """The response, complete (its body was the upstream's, in full)."""
        assert self.response is not None
        if self._writer is not None and not self.gone:
            try:  # the bytes still queued go out first
                await asyncio.wait_for(asyncio.shield(self._writer), self.END_WAIT_SECONDS)
            except TimeoutError:
                self._drop("client_too_slow")
        if not self.gone:
            try:
                await self.response.write_eof()
            except ConnectionError:
                self.gone = True
        return self.response

    def abort(self) -> web.StreamResponse:
        """The response, cut short: the connection is closed with no last chunk, so the
        client sees an incomplete body, never a complete wrong one."""
        assert self.response is not None
        self._drop("upstream_broke_off")
        return self.response


def mount_proxy(
    app: web.Application,
    settings: Settings,
    tenants: Collection[str],
    secret: Callable[[str, str], str],
) -> None:
    """Validate ``[upstreams.*]`` (:class:`ConfigError` before anything starts) and, when there
    is one, add the route and the upstreams' HTTP sessions (closed at cleanup)."""
    upstreams = load_upstreams(settings.upstreams, tenants, secret)
    if not upstreams:
        return
    spooling = Spooling(
        spool_dir(settings),
        SpoolLedger(settings.proxy.spool_bytes_per_tenant, settings.proxy.spool_bytes_total),
    )
    adapters = {n: ProxyAdapter(u, settings.bulkheads) for n, u in upstreams.items()}
    proxy = Proxy(upstreams, adapters, spooling)
    app[PROXY] = proxy

    async def sessions(app: web.Application) -> AsyncIterator[None]:
        if settings.proxy.spool_bytes:
            spooling.claim()  # this process's area; dead processes' areas are removed
        yield
        spooling.close()
        for adapter in proxy.adapters.values():
            await adapter.aclose()

    app.cleanup_ctx.append(sessions)
    # every target under the prefix, control characters included: proxy_request refuses them
    app.router.add_route("*", PREFIX + r"{tail:[\s\S]*}", proxy_request, expect_handler=deferred)


async def proxy_request(request: web.Request) -> web.StreamResponse:
    path, _, query = request.raw_path.partition("?")
    if not path.startswith(PREFIX):
        raise NotFound("no such resource")
    name, _, rest = path[len(PREFIX) :].partition("/")
    try:
        rest = checked_rest(rest)
    except PathRefused as exc:
        raise InvalidRequest(f"proxied path refused: {exc}") from None
    if not _QUERY.fullmatch(query):
        raise InvalidRequest("the query must be printable ASCII (percent-encode the rest)")
    checked_expect(request)
    if "Upgrade" in request.headers:
        raise InvalidRequest("a protocol upgrade (Upgrade) is not proxied")
    principal = caller_as(request, "worker")
    upstream = request.app[PROXY].upstreams.get(name)
    if upstream is None or not upstream.serves(principal.tenant):
        raise NotFound(f"no upstream named {name[:128]!r} is configured")
    bind(upstream=name, tenant=principal.tenant)
    try:
        return await _forward(request, upstream, principal, rest, query)
    except FencegateError as exc:
        metrics = request.app[K.METRICS]
        metrics.problem_counter(exc.code, str(exc.http_status)).inc()
        if exc.code in REFUSALS:
            metrics.rejection_counter(exc.code).inc()
        bind(outcome=exc.code)
        config = upstream.config
        return refusal(exc, dialect=config.error_dialect, dedupes_by_key=config.dedupes_by_key)


proxy_request.any_media_type = True  # type: ignore[attr-defined]  # gateway.http.browser
# its body is read by gateway.http.proxy_body (buffered or spooled), not by the middleware
proxy_request.streams_body = True  # type: ignore[attr-defined]


def _forwarded(request: web.Request, upstream: Upstream, tenant: str) -> list[tuple[str, str]]:
    """The request's headers that are forwarded (the allow-list); a header whose values are
    allowed per tenant (``tenant_header_values``) with a value not allowed for ``tenant`` is
    403, before anything is read or sent."""
    forwarded, guarded = upstream.forwarded, upstream.guarded
    headers = []
    for k, v in request.headers.items():
        name = k.lower()
        if name not in forwarded:
            continue
        if name in guarded and not upstream.value_allowed(tenant, name, v):
            raise Forbidden(
                f"this {k} value is not allowed for tenant {tenant!r} on upstream "
                f"{upstream.name!r}; nothing was sent"
            )
        headers.append((k, v))
    return headers


def _required(request: web.Request, header: str, what: str) -> str:
    value = request.headers.get(header)
    if value is None:
        raise InvalidRequest(f"{header} is required: the {what} this request is a step of")
    return checked_name(value, header)


async def _forward(
    request: web.Request, upstream: Upstream, principal: Principal, rest: str, query: str
) -> web.StreamResponse:
    method = request.method
    if method not in UNSAFE_METHODS | SAFE_METHODS:
        raise MethodNotAllowed(f"{method} is not proxied")
    npath = normalised_path(rest)
    if not any(r.matches(method, npath) for r in upstream.routes):
        raise Forbidden(f"{method} {npath} is not a route of upstream {upstream.name!r}")
    headers = _forwarded(request, upstream, principal.tenant)
    if method in SAFE_METHODS:
        return await _pass_read(request, upstream, principal, rest, query, headers)
    job_id = _required(request, "Fencegate-Job", "job")
    worker_id = worker_id_of(request)
    client_key = request.headers.get("Idempotency-Key")
    if client_key is not None and not _CLIENT_KEY.fullmatch(client_key):
        raise InvalidRequest("Idempotency-Key must be 1 to 255 printable ASCII characters")
    step_from = upstream.config.step_from
    named = "Fencegate-Step" in request.headers or not step_from
    step = _required(request, "Fencegate-Step", "step") if named else ""
    if len(request.headers.getall("Content-Type", ())) > 1:
        raise UnsupportedMediaType("more than one Content-Type header")
    spooling = request.app[PROXY].spooling
    await continue_if_expected(request)
    body = await read_proxied_body(request, request.app[K.SETTINGS], spooling, principal.tenant)
    try:
        if not named:
            if body.data is None:
                raise InvalidRequest(
                    f"step_from {step_from!r} needs the body in memory: this one is longer "
                    "than proxy.buffer_bytes (send a Fencegate-Step)"
                )
            try:
                step = derive_step(step_from, client_key, body.data)
            except StepRefused as exc:
                raise InvalidRequest(str(exc)) from None
        return await _perform(
            request,
            upstream,
            principal,
            rest,
            query,
            headers,
            job_id,
            worker_id,
            client_key,
            step,
            body,
        )
    finally:
        body.discard()  # the spool file, once the answer is complete


async def _perform(
    request: web.Request,
    upstream: Upstream,
    principal: Principal,
    rest: str,
    query: str,
    headers: list[tuple[str, str]],
    job_id: str,
    worker_id: str | None,
    client_key: str | None,
    step: str,
    body: ProxiedBody,
) -> web.StreamResponse:
    method = request.method
    npath = normalised_path(rest)
    keys = JobKeys(principal.tenant, job_id)
    bind(job_id=job_id, step=step)
    adapter = request.app[PROXY].adapters[upstream.name]
    generation = await generation_of(
        request, keys, step=step, worker_id=worker_id, adapter=adapter.name
    )
    target = "/" + rest + (f"?{query}" if query else "")
    content_type = request.headers.get("Content-Type", "")
    chosen = upstream.in_intent
    spooled = None
    if body.spooled is not None:  # read from its file off the loop (a multipart's parts)
        spooled = await asyncio.to_thread(
            spooled_body_digest, content_type, body.spooled.path, body.sha256
        )
    digest = proxy_intent(
        upstream.name,
        method,
        npath,
        query,
        content_type,
        body.data or b"",
        [(k, v) for k, v in headers if k.lower() in chosen] if chosen else (),
        spooled=spooled,
    )
    sink = StreamedAnswer(request, generation)
    payload = forward_payload(method, target, headers, body.forwarded, client_key, sink)
    loop = asyncio.get_running_loop()
    waited_until = loop.time() + upstream.config.in_flight_wait_seconds
    pause = 0.05
    try:
        while True:
            try:
                res = await request.app[K.SERVICE].perform_with(
                    keys,
                    step,
                    adapter,
                    generation=generation,
                    operation=method,
                    payload=payload,
                    intent_sha256=digest,
                    worker_id=worker_id,
                    by=principal.who,
                )
                break
            except EffectInProgress:
                # another call dispatches the step: its outcome, when it comes within the
                # bound, is this call's answer (a replay); else 409, which SDKs retry
                left = waited_until - loop.time()
                if left <= 0:
                    raise
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 0.4)
    except EffectFailed as exc:  # a 3xx or 4xx the upstream answered (now, or recorded)
        if sink.response is not None:  # streamed by this call, now recorded
            return await sink.end()
        recorded = Recorded.from_json(exc.fields.get("error"))
        if recorded is None:
            raise
        replayed, generation = bool(exc.fields.get("replayed")), exc.fields["generation"]
    except FencegateError as exc:
        if sink.response is not None:  # the upstream's body broke off mid-stream: unknown
            return sink.abort()
        released = sink.released
        if isinstance(exc, AdapterUnavailable) and released and released.body is not None:
            # a status the upstream documents as not performed: the step is released, and
            # the client gets the upstream's answer (its SDK reads it natively)
            bind(outcome="released", upstream_status=released.status)
            return _answer(released, replayed=False, generation=generation)
        raise
    else:
        if sink.response is not None:  # streamed by this call, now recorded
            return await sink.end()
        found = Recorded.from_json(res.result)
        if found is None:
            raise ReplayUnavailable("the step's record holds no upstream response")
        recorded, replayed, generation = found, res.replayed, res.generation
    bind(outcome="replayed" if replayed else "forwarded", upstream_status=recorded.status)
    return _answer(recorded, replayed=replayed, generation=generation)


async def _pass_read(
    request: web.Request,
    upstream: Upstream,
    principal: Principal,
    rest: str,
    query: str,
    headers: list[tuple[str, str]],
) -> web.StreamResponse:
    """A read passed through: no step, nothing recorded, never an idempotency key; with
    ``reads = "fenced"``, only for a generation that may act on its job now (check-2)."""
    if request.body_exists:
        raise InvalidRequest(f"a {request.method} through the proxy carries no body")
    if upstream.config.reads == "fenced":
        await _check_fence(request, upstream, principal)
    target = "/" + rest + (f"?{query}" if query else "")
    adapter = request.app[PROXY].adapters[upstream.name]
    sink = StreamedAnswer(request, None)
    got = await adapter.read(principal.tenant, request.method, target, headers, sink)
    if isinstance(got, NotDelivered):
        raise AdapterUnavailable(f"{upstream.name}: {got.reason}; nothing was sent")
    if isinstance(got, Unknown):
        if sink.response is not None:
            return sink.abort()
        raise AdapterUnavailable(f"{upstream.name}: {got.reason}", status=504)
    bind(outcome="passed", upstream_status=got.status)
    if sink.response is not None:
        return await sink.end()
    if got.body is None:
        raise ReplayUnavailable(
            f"the upstream answered {got.status} with {got.size} bytes, more than its "
            "max_response_bytes",
            upstream_status=got.status,
        )
    response = web.Response(status=got.status, body=got.body, headers=CIMultiDict(got.headers))
    response.headers[OUTCOME] = "forwarded"
    return response


async def _check_fence(request: web.Request, upstream: Upstream, principal: Principal) -> None:
    """A fenced read's fence check: the job and its token (a step too, when one is named, for
    the audit); a generation that may not act is refused, audited, and nothing is sent."""
    job_id = _required(request, "Fencegate-Job", "job")
    step = request.headers.get("Fencegate-Step")
    if step is not None:
        checked_name(step, "Fencegate-Step")
    keys = JobKeys(principal.tenant, job_id)
    bind(job_id=job_id, step=step)
    worker_id = worker_id_of(request)
    adapter = request.app[PROXY].adapters[upstream.name].name
    generation = await generation_of(
        request, keys, step=step or "", worker_id=worker_id, adapter=adapter
    )
    await request.app[K.STORE].check(
        keys, generation, worker_id or "", step=step or "", adapter=adapter
    )


def _answer(recorded: Recorded, *, replayed: bool, generation: int) -> web.Response:
    if recorded.body is None:
        raise ReplayUnavailable(
            f"the upstream answered {recorded.status} with {recorded.size} bytes, more than its "
            "max_response_bytes: the step is recorded with the body's SHA-256 and size only "
            "and its answer cannot be sent",
            upstream_status=recorded.status,
            sha256=recorded.sha256,
            size=recorded.size,
        )
    response = web.Response(
        status=recorded.status, body=recorded.body, headers=CIMultiDict(recorded.headers)
    )
    response.headers[OUTCOME] = "replayed" if replayed else "forwarded"
    response.headers["Fencegate-Generation"] = str(generation)
    if replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response

"""httpx transports that send a client's calls through fencegate's proxy, each a fenced step.

The ``httpx`` extra (``pip install 'fencegate[httpx]'``); the core SDK does not need httpx.
Mount one on the upstream's own URL and leave the call sites as they are::

    from gateway.client.httpx_transport import FencegateTransport

    route = FencegateTransport(
        "http://fencegate:8080", "partner",
        base_url="https://api.partner.com", api_key="fg_worker_key",
    )
    with httpx.Client(mounts={"https://api.partner.com": route}) as http:
        with job.step("order"):
            http.post("https://api.partner.com/v1/orders", json=order)  # unchanged

The request is rewritten to ``<gateway>/proxy/partner/v1/orders`` with the current step's
``Fencing-Token``, ``Fencegate-Job``, ``Fencegate-Step`` and ``Worker-Id``
(:mod:`gateway.client.proxying`: which step, what is refused before sending).
:class:`AsyncFencegateTransport` is the same for ``httpx.AsyncClient``.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.client.proxying import STEP_HEADERS, JobLike, ProxyRoute

__all__ = ["AsyncFencegateTransport", "FencegateTransport"]


def _rewrite(route: ProxyRoute, request: httpx.Request) -> None:
    # both raise before anything is sent
    set_headers = route.headers(request.method, named="Fencegate-Step" in request.headers)
    url = httpx.URL(route.target(request.method, str(request.url)))
    request.url = url
    if "Fencegate-Step" in set_headers:  # the current step replaces the client's own
        for name in STEP_HEADERS:
            request.headers.pop(name, None)
    request.headers.update(set_headers)
    request.headers["Host"] = url.netloc.decode("ascii")


class FencegateTransport(httpx.BaseTransport):
    """A sync httpx transport through the proxy (the module docstring); ``transport`` is the
    one that sends (default ``httpx.HTTPTransport()``)."""

    def __init__(
        self,
        gateway_url: str,
        upstream: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        job: JobLike | None = None,
        step: str | None = None,
        step_from: bool = False,
        transport: httpx.BaseTransport | None = None,
        **transport_options: Any,
    ) -> None:
        self.route = ProxyRoute(gateway_url, upstream, base_url, api_key, job, step, step_from)
        self._inner = transport or httpx.HTTPTransport(**transport_options)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        _rewrite(self.route, request)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


class AsyncFencegateTransport(httpx.AsyncBaseTransport):
    """:class:`FencegateTransport` for ``httpx.AsyncClient`` (the step is the current task's:
    a task started inside ``with job.step()`` keeps it)."""

    def __init__(
        self,
        gateway_url: str,
        upstream: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        job: JobLike | None = None,
        step: str | None = None,
        step_from: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        **transport_options: Any,
    ) -> None:
        self.route = ProxyRoute(gateway_url, upstream, base_url, api_key, job, step, step_from)
        self._inner = transport or httpx.AsyncHTTPTransport(**transport_options)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        _rewrite(self.route, request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

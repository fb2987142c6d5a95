"""A requests transport adapter that sends a session's calls through fencegate's proxy.

The ``requests`` extra (``pip install 'fencegate[requests]'``); the core SDK does not need
requests. Mount it on the upstream's own URL and leave the call sites as they are::

    from gateway.client.requests_adapter import FencegateAdapter

    session = requests.Session()
    session.mount("https://api.partner.com/", FencegateAdapter(
        "http://fencegate:8080", "partner",
        base_url="https://api.partner.com", api_key="fg_worker_key",
    ))
    with job.step("order"):
        session.post("https://api.partner.com/v1/orders", json=order)   # unchanged

The request is rewritten to ``<gateway>/proxy/partner/v1/orders`` with the current step's
headers (:mod:`gateway.client.proxying`: which step, what is refused before sending).
"""

from __future__ import annotations

from typing import Any

from requests import PreparedRequest, Response
from requests.adapters import HTTPAdapter

from gateway.client.proxying import STEP_HEADERS, JobLike, ProxyRoute

__all__ = ["FencegateAdapter"]


class FencegateAdapter(HTTPAdapter):
    """:class:`requests.adapters.HTTPAdapter` through the proxy (the module docstring); the
    other keyword arguments are ``HTTPAdapter``'s (pool sizes, retries)."""

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
        **adapter_options: Any,
    ) -> None:
        self.route = ProxyRoute(gateway_url, upstream, base_url, api_key, job, step, step_from)
        super().__init__(**adapter_options)

    def send(self, request: PreparedRequest, *args: Any, **kwargs: Any) -> Response:
        method = request.method or "GET"
        # both raise before anything is sent
        set_headers = self.route.headers(method, named="Fencegate-Step" in request.headers)
        request.url = self.route.target(method, request.url or "")
        if "Fencegate-Step" in set_headers:  # the current step replaces the client's own
            for name in STEP_HEADERS:
                request.headers.pop(name, None)
        request.headers.update(set_headers)
        return super().send(request, *args, **kwargs)

"""A stripe-python HTTP client that sends every Stripe call through fencegate's proxy.

The ``stripe`` extra (``pip install 'fencegate[stripe]'``: stripe and requests). Only the
client's construction changes; the calls and the Stripe key in the code stay::

    from gateway.client.stripe_client import stripe_http_client

    client = stripe.StripeClient(
        "sk_live_…",  # never sent: the worker's fencegate key replaces it
        http_client=stripe_http_client("http://fencegate:8080", api_key="fg_worker_key"),
    )
    with job.step("charge"):
        client.v1.payment_intents.create(params={"amount": 2000, "currency": "eur"})

It is stripe's own ``RequestsClient`` on a session whose ``https://api.stripe.com`` is
mounted on a :class:`~gateway.client.requests_adapter.FencegateAdapter` for the
``[upstreams.stripe]`` (``upstream=`` for another name, ``base_url=`` for another API base).
"""

from __future__ import annotations

import requests
import stripe

from gateway.client.proxying import JobLike
from gateway.client.requests_adapter import FencegateAdapter

__all__ = ["stripe_http_client"]

STRIPE_API = "https://api.stripe.com"


def stripe_http_client(
    gateway_url: str,
    *,
    api_key: str | None = None,
    upstream: str = "stripe",
    base_url: str = STRIPE_API,
    job: JobLike | None = None,
    step: str | None = None,
    timeout: float = 80,
) -> stripe.RequestsClient:
    """stripe-python's HTTP client through ``<gateway_url>/proxy/<upstream>`` (the module
    docstring); ``api_key`` None: the StripeClient's own key is sent (set it to the fencegate
    key)."""
    session = requests.Session()
    session.trust_env = False  # HTTPS_PROXY and .netrc never reroute the fenced calls
    adapter = FencegateAdapter(
        gateway_url, upstream, base_url=base_url, api_key=api_key, job=job, step=step
    )
    session.mount(base_url.rstrip("/") + "/", adapter)
    session.mount(adapter.route.proxy_url + "/", adapter)
    return stripe.RequestsClient(session=session, timeout=timeout)

"""gateway.client.proxying: the current step of a proxied call, and where the call is sent."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from gateway.client.proxying import ProxyRoute, current_step, fenced_step
from gateway.core.errors import FencegateError, InvalidRequest, StaleGeneration

pytestmark = pytest.mark.fast


@dataclass
class Job:
    job_id: str = "r"
    token: str = "7"
    worker_id: str | None = None
    superseded: FencegateError | None = None


ROUTE = ProxyRoute("http://gw:8080/", "pay", base_url="https://API.partner.example/api/")


@pytest.mark.parametrize(
    ("url", "sent"),
    [
        ("https://api.partner.example/api/v1/charges?b=2&a=1",
         "http://gw:8080/proxy/pay/v1/charges?b=2&a=1"),
        ("HTTPS://api.PARTNER.example/api", "http://gw:8080/proxy/pay"),
        ("http://gw:8080/proxy/pay/v1/charges", "http://gw:8080/proxy/pay/v1/charges"),
    ],
)  # fmt: skip
def test_a_url_under_the_base_or_the_proxy_is_sent_to_the_proxy(url: str, sent: str) -> None:
    assert ROUTE.target("POST", url) == sent


@pytest.mark.parametrize(
    "url",
    [
        "https://api.partner.example/api-v2/charges",  # a sibling of the base path
        "https://api.partner.example/v1/charges",  # outside the base path
        "http://api.partner.example/api/v1/charges",  # another scheme
        "https://api.partner.example:8443/api/v1/charges",  # another port
        "https://evil.example/api/v1/charges",
        "http://gw:8080/proxy/payments/v1",  # another upstream's prefix
    ],
)
def test_any_other_url_is_refused(url: str) -> None:
    with pytest.raises(InvalidRequest, match="nothing was sent"):
        ROUTE.target("POST", url)


def test_the_innermost_step_wins_and_each_block_restores_the_last() -> None:
    job = Job(worker_id="w-1")
    bound = ProxyRoute("http://gw", "pay", job=Job(job_id="bound"), step="default")
    assert bound.headers("POST")["Fencegate-Step"] == "default"
    with fenced_step(job, "outer"):
        with fenced_step(job, "inner"):
            assert bound.headers("POST") == {
                "Fencing-Token": "7", "Fencegate-Job": "r", "Fencegate-Step": "inner",
                "Worker-Id": "w-1",
            }  # fmt: skip
        assert bound.headers("POST")["Fencegate-Step"] == "outer"
    assert current_step() is None
    assert bound.headers("POST")["Fencegate-Job"] == "bound"


def test_an_unsafe_call_without_a_step_is_refused_a_read_is_not() -> None:
    route = ProxyRoute("http://gw", "pay", api_key="fg-key")
    with pytest.raises(InvalidRequest, match="needs a step"):
        route.headers("POST")
    assert route.headers("GET") == {"Authorization": "Bearer fg-key"}
    # a request that names its own step is sent with it
    assert route.headers("POST", named=True) == {"Authorization": "Bearer fg-key"}


def test_a_superseded_job_raises_its_error() -> None:
    job = Job(superseded=StaleGeneration("gone", presented=1, current=2))
    with fenced_step(job, "s"), pytest.raises(StaleGeneration):
        ROUTE.headers("POST")


async def test_tasks_and_threads_started_in_a_step_keep_it() -> None:
    seen: list[str | None] = []

    def in_thread() -> None:
        step = current_step()
        seen.append(step.step if step else None)

    with fenced_step(Job(), "charge"):
        task = asyncio.create_task(asyncio.to_thread(in_thread))
    await task
    plain = threading.Thread(target=in_thread)  # a bare thread starts with no context
    plain.start()
    plain.join()
    assert seen == ["charge", None]


def test_a_route_is_checked_when_it_is_made() -> None:
    with pytest.raises(ValueError, match="http"):
        ProxyRoute("gw:8080", "pay")
    with pytest.raises(ValueError, match="query"):
        ProxyRoute("http://gw", "pay", base_url="https://api.example/?x=1")
    with pytest.raises(ValueError, match="needs its job"):
        ProxyRoute("http://gw", "pay", step="s")

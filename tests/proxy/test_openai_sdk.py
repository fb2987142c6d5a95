"""The real, unmodified ``openai`` SDK through the proxy, its ``base_url`` pointed at
``/proxy/<upstream>/v1`` and an OpenAI-style receiver behind it (``error_dialect =
"openai"``): a completion is sent once and replayed, a stale generation raises the SDK's own
``ConflictError`` after exactly one attempt (``x-should-retry: false``), and a transient
refusal (``effect_in_progress``) is retried by the SDK itself until it gets the answer."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import openai
import pytest

from tests.conftest import Gateway
from tests.support.proxying import (
    KEYS,
    SECRETS,
    Receiver,
    auth,
    chat_completion,
    register,
    upstreams,
)

MESSAGES: list[Any] = [{"role": "user", "content": "summarise the report"}]


@pytest.fixture
async def og(make_gateway: Any, receiver: Receiver, secrets: None) -> Gateway:
    receiver.reply = chat_completion
    llm = {
        "base_url": receiver.url,
        "tenants": ["acme"],
        "routes": ["POST /v1/chat/completions"],
        "credentials_env": {"acme": "PAY_ACME"},
        "allow_private": True,
        "error_dialect": "openai",
        "in_flight_wait_seconds": 0.1,
    }
    g: Gateway = await make_gateway(auth=auth(), upstreams={**upstreams(receiver.url), "llm": llm})
    return g


class Attempts:
    """The SDK's HTTP attempts, counted by its own client's event hooks."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.advice: list[str | None] = []  # each answer's X-Should-Retry
        self.on_status: dict[int, asyncio.Event] = {}

    async def response(self, response: httpx2.Response) -> None:
        self.statuses.append(response.status_code)
        self.advice.append(response.headers.get("x-should-retry"))
        if (event := self.on_status.get(response.status_code)) is not None:
            event.set()


def client(
    g: Gateway, job: str, token: int, attempts: Attempts | None = None
) -> openai.AsyncOpenAI:
    hooks = {"response": [attempts.response]} if attempts else {}
    return openai.AsyncOpenAI(
        api_key=KEYS["acme"],  # the worker's fencegate key, where the SDK puts its API key
        base_url=str(g.client.make_url("/proxy/llm/v1")),
        default_headers={"Fencing-Token": str(token), "Fencegate-Job": job},
        http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),
    )


async def test_a_completion_is_sent_once_with_the_tenants_key_and_replayed(
    og: Gateway, receiver: Receiver
) -> None:
    gen = await register(og, "j")
    async with client(og, "j", gen) as llm:
        step = {"Fencegate-Step": "summary"}
        first = await llm.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, extra_headers=step
        )
        assert first.id == "chatcmpl-1"
        assert first.choices[0].message.content == "re: summarise the report"
        raw = await llm.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MESSAGES, extra_headers=step
        )
        assert raw.headers["Idempotent-Replayed"] == "true"
        assert raw.headers["Fencegate-Outcome"] == "replayed"
        assert raw.parse().id == "chatcmpl-1"  # the recorded completion, parsed by the SDK
    [seen] = receiver.seen
    assert seen.path_qs == "/v1/chat/completions"
    assert seen.headers["Authorization"] == f"Bearer {SECRETS['PAY_ACME']}"
    assert seen.headers["Idempotency-Key"] == "acme/j:summary"


async def test_a_stale_generation_raises_the_sdks_own_error_after_one_attempt(
    og: Gateway, receiver: Receiver
) -> None:
    old = await register(og, "j")
    await register(og, "j")  # a takeover: generation `old` is a zombie now
    attempts = Attempts()
    async with client(og, "j", old, attempts) as llm:  # max_retries: the SDK's default, 2
        with pytest.raises(openai.ConflictError) as raised:
            await llm.chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES, extra_headers={"Fencegate-Step": "s"}
            )
    assert attempts.statuses == [409]  # x-should-retry: false, so no retry
    err = raised.value
    assert err.code == "stale_generation" and err.type == "invalid_request_error"
    assert err.response.headers["X-Should-Retry"] == "false"
    assert receiver.seen == []


async def test_a_transient_refusal_is_retried_by_the_sdk_until_it_gets_the_answer(
    og: Gateway, receiver: Receiver
) -> None:
    gen = await register(og, "j")
    gate = receiver.hold()
    step = {"Fencegate-Step": "slow"}
    async with client(og, "j", gen) as first_llm:
        first = asyncio.create_task(
            first_llm.chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES, extra_headers=step
            )
        )
        await receiver.arrived.wait()  # the first call is dispatching the step
        attempts = Attempts()
        attempts.on_status[409] = gate  # the upstream answers once the SDK was refused
        async with client(og, "j", gen, attempts) as llm:
            second = await llm.chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES, extra_headers=step
            )
        assert (await first).id == second.id == "chatcmpl-1"
    assert attempts.statuses[0] == 409 and attempts.statuses[-1] == 200
    assert attempts.advice[0] == "true"  # effect_in_progress: transient, with Retry-After
    assert len(receiver.seen) == 1

"""gateway.proxy.steps: RFC 6901 pointers and the step a request names without a header."""

from __future__ import annotations

import pytest

from gateway.proxy.steps import StepRefused, check_step_from, derive_step, json_pointer

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("pointer", "tokens"),
    [("/a", ("a",)), ("/a/b~1c", ("a", "b/c")), ("/m~0n", ("m~n",)), ("/", ("",)),
     ("/0/x", ("0", "x"))],
)  # fmt: skip
def test_a_pointer_is_split_and_unescaped(pointer: str, tokens: tuple[str, ...]) -> None:
    assert json_pointer(pointer) == tokens


@pytest.mark.parametrize("value", ["", "idempotency_key", "json:/id", "json:/a/0"])
def test_valid_step_from_values(value: str) -> None:
    assert check_step_from(value) == value


@pytest.mark.parametrize("value", ["json:", "json:id", "json:/a~2", "Idempotency-Key", "body"])
def test_invalid_step_from_values(value: str) -> None:
    with pytest.raises(ValueError, match=r"must|not followed"):
        check_step_from(value)


def test_the_step_at_a_pointer_of_the_json_body() -> None:
    body = b'{"items": [{"id": "a"}, {"id": "b-2"}], "n": 1}'
    assert derive_step("json:/items/1/id", None, body) == "b-2"
    for pointer in ("/items/2/id", "/items/01/id", "/n", "/items", "/missing"):
        with pytest.raises(StepRefused):
            derive_step("json:" + pointer, None, body)


def test_the_idempotency_key_as_the_step() -> None:
    assert derive_step("idempotency_key", "order.42_x", b"") == "order.42_x"
    for key in (None, "a b", "a:b", "é"):
        with pytest.raises(StepRefused):
            derive_step("idempotency_key", key, b"")
    with pytest.raises(StepRefused, match="Fencegate-Step"):
        derive_step("", "order-42", b"")

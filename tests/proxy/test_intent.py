"""gateway.proxy.intent: what makes two proxied requests the same intent, and what does not."""

from __future__ import annotations

import pytest

from gateway.proxy.intent import body_digest, proxy_intent, sorted_query

pytestmark = pytest.mark.fast

FORM = "application/x-www-form-urlencoded"
JSON = "application/json"


def intent(body: bytes, content_type: str = FORM, query: str = "", **kw: str) -> str:
    return proxy_intent(
        kw.get("upstream", "pay"),
        kw.get("method", "POST"),
        kw.get("path", "/v1/charges"),
        query,
        content_type,
        body,
    )


def multipart(boundary: str, parts: list[tuple[str, str, bytes]]) -> bytes:
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename:
            out += b"Content-Type: text/plain\r\n"
        out += b"\r\n" + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_json_key_order_and_whitespace_do_not_count() -> None:
    a = intent(b'{"amount":5,"meta":{"x":1,"y":[1,2]}}', JSON)
    b = intent(b'{ "meta": {"y": [1, 2], "x": 1},\n "amount": 5 }', JSON)
    assert a == b


def test_a_changed_json_field_is_another_intent() -> None:
    assert intent(b'{"amount":5}', JSON) != intent(b'{"amount":6}', JSON)
    assert intent(b'{"l":[1,2]}', JSON) != intent(b'{"l":[2,1]}', JSON)  # arrays are ordered


def test_json_integers_are_exact() -> None:
    big = b'{"n":123456789012345678901234567890}'
    near = b'{"n":123456789012345678901234567891}'
    assert intent(big, JSON) != intent(near, JSON)


def test_a_json_media_type_suffix_is_json_and_charset_does_not_count() -> None:
    a = intent(b'{"a":1,"b":2}', "application/merge-patch+json")
    b = intent(b'{"b":2,"a":1}', "application/merge-patch+json; charset=utf-8")
    assert a == b


def test_a_body_that_is_not_json_is_its_bytes() -> None:
    assert body_digest(JSON, b"{not json")["bytes"]
    assert intent(b"{not json", JSON) != intent(b"{not  json", JSON)


def test_reordered_form_fields_are_the_same_intent() -> None:
    assert intent(b"amount=5&currency=eur&metadata[a]=1") == intent(
        b"metadata[a]=1&currency=eur&amount=5"
    )


def test_a_repeated_form_key_keeps_its_order() -> None:
    assert intent(b"items[]=a&items[]=b&x=1") == intent(b"x=1&items[]=a&items[]=b")
    assert intent(b"items[]=a&items[]=b") != intent(b"items[]=b&items[]=a")


def test_a_changed_form_field_is_another_intent() -> None:
    assert intent(b"amount=5&currency=eur") != intent(b"amount=50&currency=eur")


def test_form_encoding_spellings_decode_the_same() -> None:
    assert intent(b"note=a+b&x=%7E") == intent(b"x=~&note=a%20b")


def test_multipart_boundaries_do_not_count() -> None:
    parts = [("purpose", "", b"dispute_evidence"), ("file", "a.txt", b"hello")]
    a = multipart("b1" + "0" * 30, parts)
    b = multipart("Xy" + "9" * 40, list(reversed(parts)))
    ct = "multipart/form-data; boundary="
    assert intent(a, ct + "b1" + "0" * 30) == intent(b, ct + "Xy" + "9" * 40)


def test_a_changed_multipart_part_is_another_intent() -> None:
    ct = "multipart/form-data; boundary=bb"
    a = multipart("bb", [("file", "a.txt", b"hello")])
    b = multipart("bb", [("file", "a.txt", b"hellO")])
    c = multipart("bb", [("file", "b.txt", b"hello")])
    assert len({intent(a, ct), intent(b, ct), intent(c, ct)}) == 3


def test_other_media_types_are_their_bytes() -> None:
    assert intent(b"<a/>", "text/xml") == intent(b"<a/>", "text/xml")
    assert intent(b"<a/>", "text/xml") != intent(b"<a />", "text/xml")
    assert intent(b"<a/>", "text/xml") != intent(b"<a/>", "application/xml")


def test_the_query_is_sorted_by_name_keeping_repeated_names_in_order() -> None:
    assert sorted_query("b=2&a=1&a=0") == [("a", "1"), ("a", "0"), ("b", "2")]
    assert intent(b"", query="b=2&a=1") == intent(b"", query="a=1&b=2")
    assert intent(b"", query="a=1&a=2") != intent(b"", query="a=2&a=1")
    assert intent(b"", query="a=1") != intent(b"", query="a=2")


def test_method_path_and_upstream_are_part_of_the_intent() -> None:
    base = intent(b"a=1")
    assert base != intent(b"a=1", method="PUT")
    assert base != intent(b"a=1", path="/v1/refunds")
    assert base != intent(b"a=1", upstream="other")


def test_chosen_headers_join_the_digest_by_lower_case_name_and_value() -> None:
    def with_headers(*headers: tuple[str, str]) -> str:
        return proxy_intent("pay", "POST", "/v1/charges", "", JSON, b"{}", headers)

    base = with_headers(("Stripe-Account", "acct_1"), ("Stripe-Version", "v1"))
    assert with_headers(("stripe-version", "v1"), ("STRIPE-ACCOUNT", "acct_1")) == base
    assert with_headers(("Stripe-Account", "acct_2"), ("Stripe-Version", "v1")) != base
    assert with_headers(("Stripe-Account", "acct_1")) != base
    assert with_headers() == proxy_intent("pay", "POST", "/v1/charges", "", JSON, b"{}")
    # repeated values keep their order
    assert with_headers(("X-A", "1"), ("X-A", "2")) != with_headers(("X-A", "2"), ("X-A", "1"))


def test_a_digest_without_chosen_headers_is_the_one_recorded_before_them() -> None:
    # pinned steps recorded before chosen headers existed must still match their retries
    digest = proxy_intent("pay", "POST", "/v1/charges", "b=2&a=1", JSON, b'{"amount": 5}')
    assert digest == "b7df93efad0508e7587c9fb2d0f99a90c832a63a9980c50ddef1275de37837ce"

"""gateway.proxy.routing: the SSRF corpus — path escapes, refused addresses, route patterns —
and the guarded resolver against real name resolution."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.proxy.routing import (
    AddressRefused,
    GuardedResolver,
    PathRefused,
    address_refused,
    checked_rest,
    normalised_path,
    parse_route,
)

pytestmark = pytest.mark.fast

ESCAPES = [
    "..",
    ".",
    "a/../b",
    "a/./b",
    "%2e%2e/x",
    "%2E%2E/x",
    ".%2e/x",
    "%2e./x",
    "%2e",
    "a%2fb",
    "a%2Fb",
    "a%5cb",
    "a%5Cb",
    "a\\b",
    "a//b",
    "/a",
    "a/",
    "",
    "a%00b",
    "a%0d%0ab",
    "a%7fb",
    "a\x00b",
    "a\tb",
    "a b",
    "caf\u00e9",
    "a%zz",
    "a%2",
    "a%",
    "a?b",
    "a#b",
    'a"b',
]


@pytest.mark.parametrize("rest", ESCAPES)
def test_every_spelling_of_an_escape_is_refused(rest: str) -> None:
    with pytest.raises(PathRefused):
        checked_rest(rest)


@pytest.mark.parametrize("rest", ["v1/charges", "v1/charges/ch_1/capture", "a%20b", "x:y@z", "~u"])
def test_plain_paths_pass_as_sent(rest: str) -> None:
    assert checked_rest(rest) == rest


def test_normalised_paths_decode_unreserved_escapes_only() -> None:
    assert normalised_path("v1/%7Eu/%61") == "/v1/~u/a"
    assert normalised_path("a%2ab") == "/a%2Ab"


REFUSED = [
    "127.0.0.1",
    "127.8.9.10",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # shared address space
    "0.0.0.0",
    "255.255.255.255",
    "224.0.0.1",
    "198.18.0.1",
    "::1",
    "::",
    "fe80::1",
    "fd00::1",
    "fc00::1",
    "ff02::1",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",
    "2002:7f00:1::",  # 6to4 wrapping 127.0.0.1
    "2002:a9fe:a9fe::",  # 6to4 wrapping 169.254.169.254
    "64:ff9b::7f00:1",  # NAT64 prefix (not global)
]


@pytest.mark.parametrize("address", REFUSED)
def test_private_loopback_link_local_and_wrapped_addresses_are_refused(address: str) -> None:
    assert address_refused(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700::1111"])
def test_global_addresses_are_allowed(address: str) -> None:
    assert not address_refused(ipaddress.ip_address(address))


async def test_the_resolver_refuses_names_of_loopback_and_numeric_forms() -> None:
    resolver = GuardedResolver(allow_private=False)
    try:
        for name in ("localhost", "127.0.0.1", "2130706433", "0x7f.1", "0177.0.0.1"):
            with pytest.raises(AddressRefused):
                await resolver.resolve(name, 80)
    finally:
        await resolver.close()


async def test_the_resolver_with_allow_private_resolves_loopback() -> None:
    resolver = GuardedResolver(allow_private=True)
    try:
        found = await resolver.resolve("localhost", 80)
    finally:
        await resolver.close()
    assert found and all(ipaddress.ip_address(r["host"]).is_loopback for r in found)


def test_route_patterns_match_one_segment_per_star() -> None:
    route = parse_route("POST /v1/payment_intents/*/capture")
    assert route.matches("POST", "/v1/payment_intents/pi_1/capture")
    assert not route.matches("POST", "/v1/payment_intents/pi_1/x/capture")
    assert not route.matches("POST", "/v1/payment_intents/capture")
    assert not route.matches("PUT", "/v1/payment_intents/pi_1/capture")


@pytest.mark.parametrize(
    "route",
    ["OPTIONS /v1/x", "POST v1/x", "POST /v1/../x", "POST /v1/%2e%2e", "post /v1", "POST /a b"],
)
def test_unusable_routes_are_refused(route: str) -> None:
    with pytest.raises(ValueError, match="route"):
        parse_route(route)

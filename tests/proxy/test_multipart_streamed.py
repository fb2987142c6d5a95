"""gateway.proxy.intent.multipart_parts_streamed: a spooled multipart body's parts, read from
its file a piece at a time, are exactly what the in-memory digest finds in the whole body —
for well-formed bodies, for malformed ones (both answer None: the bytes), at any chunking."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.intent import body_digest, multipart_parts_streamed, spooled_body_digest

pytestmark = pytest.mark.fast

BOUNDARY = "xYz-42"
CT = f"multipart/form-data; boundary={BOUNDARY}"


def reader(body: bytes, chunk: int):  # type: ignore[no-untyped-def]
    pos = 0

    def read(_n: int) -> bytes:
        nonlocal pos
        piece = body[pos : pos + chunk]
        pos += len(piece)
        return piece

    return read


def whole(body: bytes) -> object:
    digest = body_digest(CT, body)
    return digest.get("parts")


# bytes that make boundaries, separators and lines likely, so malformed bodies are explored too
ATOMS = st.sampled_from(
    [b"--", b"\r\n", b"\r\n\r\n", f"--{BOUNDARY}".encode(), f"--{BOUNDARY}--".encode(),
     b'Content-Disposition: form-data; name="a"', b'; filename="f.txt"', b"Content-Type: x/y",
     b"a", b"-", b"\r", b"\n", b"zz"]
)  # fmt: skip
PART = st.tuples(
    st.sampled_from(["a", "b", "file"]),
    st.sampled_from(["", "f.bin"]),
    st.binary(max_size=40) | st.lists(ATOMS, max_size=6).map(b"".join),
)


def well_formed(parts: list[tuple[str, str, bytes]], preamble: bytes, epilogue: bytes) -> bytes:
    out = preamble
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += content + b"\r\n"
    return out + f"--{BOUNDARY}--".encode() + epilogue


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(PART, min_size=1, max_size=4),
    preamble=st.sampled_from([b"", b"preamble\r\n"]),
    epilogue=st.sampled_from([b"", b"\r\n", b"\r\nepilogue"]),
    chunk=st.integers(1, 9),
)
def test_a_well_formed_body_has_the_same_parts_streamed(
    parts: list[tuple[str, str, bytes]], preamble: bytes, epilogue: bytes, chunk: int
) -> None:
    body = well_formed(parts, preamble, epilogue)
    assert multipart_parts_streamed(reader(body, chunk), BOUNDARY) == whole(body)


@settings(max_examples=400, deadline=None)
@given(body=st.lists(ATOMS, max_size=14).map(b"".join), chunk=st.integers(1, 9))
def test_any_body_gets_the_same_answer_streamed(body: bytes, chunk: int) -> None:
    assert multipart_parts_streamed(reader(body, chunk), BOUNDARY) == whole(body)


def test_a_spooled_multipart_body_is_digested_by_its_parts(tmp_path: Path) -> None:
    body = well_formed([("file", "f.bin", b"\x00" * 300_000), ("a", "", b"1")], b"", b"\r\n")
    path = tmp_path / "body"
    path.write_bytes(body)
    assert spooled_body_digest(CT, path, "ignored") == body_digest(CT, body)
    other = tmp_path / "other"
    other.write_bytes(b"not multipart")
    assert spooled_body_digest(CT, other, "abc") == {"media": "multipart/form-data", "bytes": "abc"}
    raw = spooled_body_digest("application/octet-stream", path, "abc")
    assert raw == {"media": "application/octet-stream", "bytes": "abc"}


def test_a_spooled_json_or_form_body_is_canonical_up_to_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "body"
    path.write_bytes(b'{ "b": [1, 2],\n "a": 1 }')
    same = body_digest("application/json", b'{"a":1,"b":[1,2]}')
    assert spooled_body_digest("application/json", path, "s") == same
    path.write_bytes(b"b=2&a=1")
    form = "application/x-www-form-urlencoded"
    assert spooled_body_digest(form, path, "s") == body_digest(form, b"a=1&b=2")
    monkeypatch.setattr("gateway.proxy.intent.CANONICAL_BYTES", 3)
    assert spooled_body_digest(form, path, "s") == {"media": form, "bytes": "s"}

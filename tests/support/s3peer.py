"""A real S3-compatible HTTP server on loopback for the outputs tests: moto in server mode.

``moto`` is a test dependency only (the ``dev`` extra), never a runtime one. The server
is a separate process (``python -m moto.server``) on a free loopback port; the tests
talk to it through the gateway (obstore's S3 client) and read it back with boto3 (which
moto depends on anyway), so what a test asserts about the bucket does not go through the
code under test.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import boto3

from gateway.store.embedded import die_with_parent, free_port


@dataclass
class MotoServer:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    _client: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),  # the server dies with the test run
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "moto server exited at start"
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("moto server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self) -> Any:
        if self._client is None:
            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing",
            )  # fmt: skip
        return self._client

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every key under ``prefix`` with its size (ListObjectsV2, one page is enough)."""
        page = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000)
        return {o["Key"]: int(o["Size"]) for o in page.get("Contents", [])}

    def get(self, bucket: str, key: str) -> bytes:
        body: bytes = self.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        return body

    def content_type(self, bucket: str, key: str) -> str:
        return str(self.client().head_object(Bucket=bucket, Key=key)["ContentType"])

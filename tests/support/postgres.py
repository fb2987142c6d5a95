"""A PostgreSQL server of the test session's own: Debian's binaries (``make postgres``
installs them), a throwaway data dir, loopback TCP on a free port, trust auth for its one
superuser. As root (CI) the server runs as the ``postgres`` system user, which PostgreSQL
requires; its data dir is then a private folder in /tmp owned by that user."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gateway.store.embedded import free_port

__all__ = ["PostgresServer", "pg_bin"]


def pg_bin(name: str) -> str:
    """The newest installed server binary ``name`` (initdb, postgres)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version)
    if found:
        return found[-1]
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise RuntimeError(
        f"PostgreSQL's {name} is missing: run `make postgres` (as root it installs Debian's "
        "postgresql), or apt-get install postgresql"
    )


def _version(path: str) -> int:
    part = Path(path).parents[1].name
    return int(part) if part.isdigit() else 0


class PostgresServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="fencegate-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._user = pwd.getpwnam("postgres") if os.getuid() == 0 else None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_server_user(self) -> None:  # preexec_fn: drop root before exec
        assert self._user is not None
        os.setgid(self._user.pw_gid)
        os.setuid(self._user.pw_uid)

    def start(self) -> None:
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self.root.chmod(0o700)
        drop = self._as_server_user if self._user is not None else None
        subprocess.run(
            [pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--no-sync", "-E", "UTF8", "--no-instructions"],
            check=True, capture_output=True, preexec_fn=drop, timeout=120,
        )  # fmt: skip
        with self.log.open("wb") as log:
            if self._user is not None:
                os.chown(self.log, self._user.pw_uid, self._user.pw_gid)
            self.proc = subprocess.Popen(
                [pg_bin("postgres"), "-D", str(self.data), "-h", "127.0.0.1",
                 "-p", str(self.port), "-k", str(self.root), "-c", "fsync=off",
                 "-c", "max_connections=50"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=drop,
            )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError("postgres exited:\n" + self.log.read_text(errors="replace"))
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

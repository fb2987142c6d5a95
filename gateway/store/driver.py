"""What fencegate's Redis connections tell the server about themselves (``CLIENT SETINFO``).

Given explicitly: left to redis-py, every new connection reads the installed ``redis``
distribution's metadata (``importlib.metadata.version``, ~9 ms of CPU on the event loop per
connection — a pool refilled after a failover paid it per socket). ``CLIENT LIST`` shows
``lib-name=redis-py(fencegate_v<version>)``.
"""

from __future__ import annotations

import redis
from redis.driver_info import DriverInfo

from gateway import __version__

__all__ = ["driver_info"]


def driver_info() -> DriverInfo:
    """A fresh description per client (redis-py keeps it by reference in each pool)."""
    return DriverInfo(lib_version=redis.__version__).add_upstream_driver("fencegate", __version__)

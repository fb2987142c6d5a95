"""Object stores for attempt-scoped job outputs, through ``obstore``.

:mod:`gateway.objects.store` is the one module that talks to an object store: the local
filesystem (the embedded default) or S3 (any S3-compatible service). It knows nothing
of fences; the fenced decisions around every write are in :mod:`gateway.fencing.outputs`.
"""

from gateway.objects.store import (
    ObjectInfo,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
    build_object_store,
    output_key,
    parse_output_key,
    parse_signed_key,
    runtime_started,
    signed_key,
    staged_key,
    valid_output_name,
)

__all__ = [
    "ObjectInfo",
    "ObjectStore",
    "ObjectStoreError",
    "PreconditionFailed",
    "build_object_store",
    "output_key",
    "parse_output_key",
    "parse_signed_key",
    "runtime_started",
    "signed_key",
    "staged_key",
    "valid_output_name",
]

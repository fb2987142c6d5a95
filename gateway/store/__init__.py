"""The Redis tier: the store, its Lua scripts and their trailer, the auto-pipeline, key names,
durability (markers, epoch, state file), the embedded server and the audit chain's anchors.

Below :mod:`gateway.fencing`; imports only :mod:`gateway.runtime` and :mod:`gateway.core`."""

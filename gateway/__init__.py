"""fencegate: a fencing-token gateway for external side effects."""

__version__ = "0.1.0"

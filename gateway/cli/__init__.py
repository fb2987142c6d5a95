"""The ``fencegate`` command: one module per command group. The top layer: it may import any."""

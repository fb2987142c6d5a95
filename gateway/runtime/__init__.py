"""Process-wide runtime: settings (the TOML file and ``FENCEGATE_*``), structured logs, metrics.

The bottom of the server's layers: every layer may import it; it imports only gateway.core."""

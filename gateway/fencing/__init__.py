"""The fencing rules above the store: the effect service, the relay, quotas, tenancy, bulkheads.

Called by gateway.http and gateway.cli; calls gateway.store and the adapters."""

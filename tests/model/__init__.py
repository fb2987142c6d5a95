"""Exhaustive exploration of the fencing protocol on a real Redis."""

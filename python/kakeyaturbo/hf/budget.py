"""The decoded-block budget shared by all layers of one cache.

Decoded blocks are kept (so they are not decoded again on every step) only while the bytes they
take fit in a budget the user set explicitly; the default budget is zero, so by default the cache
holds compressed bytes and nothing else.
"""

from __future__ import annotations


class DecodedBudget:
    """A byte counter with a fixed limit: first come, first served, never evicts."""

    def __init__(self, limit_bytes: int) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"decoded_cache_bytes must be a non-negative int, got {limit_bytes!r}")
        self.limit = limit_bytes
        self.used = 0

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit; return whether they did."""
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back bytes reserved earlier."""
        self.used = max(0, self.used - nbytes)

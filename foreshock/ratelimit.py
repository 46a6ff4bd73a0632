"""Log lines that a peer or a faulty device can repeat without bound, at most one per key a minute.

    limiter = LogLimiter(log)
    limiter.warning(path, "error reading %s: %s", path, exc)   # the first one, then one a minute per path

The line that ends a quiet period says how many were held back since the last one. Counting every
occurrence is the caller's business (a Prometheus counter, an error total): this only bounds the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

LOG_EVERY_SECONDS = 60.0


class LogLimiter:
    """At most one log line per key every `seconds`; at most `max_keys` keys remembered (the oldest
    forgotten first), so a flood of distinct keys cannot grow it either."""

    def __init__(self, logger: logging.Logger, seconds: float = LOG_EVERY_SECONDS, *, max_keys: int = 4096,
                 clock=time.monotonic):
        self.logger = logger
        self.seconds = seconds
        self.max_keys = max_keys
        self._clock = clock
        self._seen: dict[Hashable, list] = {}  # key -> [last logged at, held back since]

    def log(self, level: int, key: Hashable, message: str, *args) -> bool:
        """Log unless this key was logged less than `seconds` ago; returns whether it logged."""
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.seconds:
            seen[1] += 1
            return False
        held = seen[1] if seen is not None else 0
        if seen is None:
            if len(self._seen) >= self.max_keys:
                del self._seen[next(iter(self._seen))]
            self._seen[key] = [now, 0]
        else:
            seen[0], seen[1] = now, 0
        if held:
            message += " (%d more since the last report)"
            args = (*args, held)
        self.logger.log(level, message, *args)
        return True

    def warning(self, key: Hashable, message: str, *args) -> bool:
        return self.log(logging.WARNING, key, message, *args)

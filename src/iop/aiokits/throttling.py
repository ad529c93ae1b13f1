"""A log line per interval for events anyone on the network can cause as often as they like.

Malformed requests, refused connections and failed handshakes come from outside, unauthenticated:
logging each one lets a client flood the log (and the disk, and whatever ships it). A
`LogThrottle` writes the first line of a burst at once and then at most one line per interval,
each saying how many similar lines it left out since the one before.
"""

from __future__ import annotations

import logging
import time


class LogThrottle:
    """At most one line per `interval` seconds through `logger`; the rest are counted."""

    def __init__(self, logger: logging.Logger, *, interval: float = 60.0) -> None:
        self._logger = logger
        self._interval = interval
        self._next = 0.0
        self._left_out = 0

    @property
    def left_out(self) -> int:
        """Lines held back since the last one written."""
        return self._left_out

    def log(
        self, level: int, message: str, *args: object, exc_info: BaseException | None = None
    ) -> bool:
        """Write the line now (with `exc_info`'s traceback), or count it; True when written."""
        now = time.monotonic()
        if now < self._next:
            self._left_out += 1
            return False
        self._next = now + self._interval
        if self._left_out:
            message += " (and %d more like it since the last such line)"
            args = (*args, self._left_out)
            self._left_out = 0
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True

    def error(self, message: str, *args: object, exc_info: BaseException | None = None) -> bool:
        return self.log(logging.ERROR, message, *args, exc_info=exc_info)

    def warning(self, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, message, *args)

    def info(self, message: str, *args: object) -> bool:
        return self.log(logging.INFO, message, *args)

"""Stop strings over streamed text: text is released as soon as it can no longer be the start
of a stop string, and a match cuts the text before the stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed decoded text; get back the text that is final and the stop string that matched."""

    __slots__ = ("_held", "stops")

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        buf = self._held + text
        match_at, matched = len(buf), None
        for stop in self.stops:
            at = buf.find(stop)
            if 0 <= at < match_at:
                match_at, matched = at, stop
        if matched is not None:
            self._held = ""
            return buf[:match_at], matched
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """The text held back as a possible stop-string start, at the end of the stream."""
        held, self._held = self._held, ""
        return held

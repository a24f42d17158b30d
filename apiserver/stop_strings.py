"""A request's stop strings, indexed the way the detokenizer looks for them: by their last character.

A stop string found in a token's new text ends in that text, so only the strings whose last character the new
text holds can be there. Most tokens hold none of those characters, and cost one set test instead of a search
per stop string (64 strings on 16 choices of 8,000 tokens had tripled the API server's CPU). A search still
costs about the string's length, which is what --max-stop-string-chars bounds.
"""
from __future__ import annotations


class StopStrings:
    __slots__ = ("_by_end", "_ends", "hold")

    def __init__(self, strings: list[str]):
        """`strings`: distinct, as the request gave them (empty ones never match)."""
        by_end: dict[str, list[tuple[int, str]]] = {}  # (its place in the request, the string)
        for place, string in enumerate(strings):
            if string:
                by_end.setdefault(string[-1], []).append((place, string))
        self._by_end = by_end
        self._ends = frozenset(by_end)
        # Characters at the end of the text that could still grow into a stop string.
        self.hold = max((len(s) for group in by_end.values() for _, s in group), default=1) - 1

    def __bool__(self) -> bool:
        return bool(self._by_end)

    def first_in(self, text: str, new_start: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` and where it begins, given that none ends before `new_start` (of two
        that begin at one place, the one the request gave first)."""
        new = text[new_start:]
        ends = self._ends
        if ends.isdisjoint(new):
            return None
        best = None  # (where it begins, its place, the string)
        for end in ends.intersection(new):
            for place, stop in self._by_end[end]:
                # A match may begin in the older text: it can only end in the new one.
                at = text.find(stop, max(0, new_start - len(stop) + 1))
                if at >= 0 and (best is None or (at, place) < best[:2]):
                    best = at, place, stop
        return None if best is None else (best[0], best[2])


NO_STOP_STRINGS = StopStrings([])

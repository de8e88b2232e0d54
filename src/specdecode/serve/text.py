"""Turning a choice's tokens into the text a client may be sent so far.

A round can emit several tokens at once and a stop string can end inside them; the engine cuts
the tokens after the one that completes a stop string and the text before it. While a choice
runs, the text sent is held back (1) at an incomplete UTF-8 character (the decoder's U+FFFD at
the end) and (2) at any tail that could still grow into a stop string, so nothing after a stop
string is ever sent, even when the stop string spans rounds.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """One choice's text: feed it the full decoded text after each round, get the new part that
    is safe to send."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.sent = ""

    def delta(self, text: str, final: bool) -> str:
        """The part of `text` not sent yet that may be sent now. final=True: the choice has
        finished and `text` is its whole text (already cut before a stop string)."""
        if not final:
            hits = [text.find(s) for s in self.stops if s in text]
            if hits:  # a whole stop string (the engine ends the choice there): never past it
                text = text[: min(hits)]
            while text.endswith("\ufffd"):
                text = text[:-1]
            text = text[: len(text) - stop_holdback(text, self.stops)]
        if not text.startswith(self.sent):  # the decoder revised earlier text: wait for the end
            return ""
        new = text[len(self.sent) :]
        self.sent = text
        return new

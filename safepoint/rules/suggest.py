"""Close matches for a mistyped name (a run), so "no checkpoints for 'my-rnu'" can say what was meant."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_matches(word: str, known: Iterable[str], n: int = 3) -> list[str]:
    """The known names most like `word`, best first (difflib's ratio, at least 0.6, ties in name order);
    never `word` itself."""
    found = difflib.get_close_matches(word, sorted({k for k in known if k != word}), n=n, cutoff=0.6)
    return sorted(found, key=lambda m: (-difflib.SequenceMatcher(None, word, m).ratio(), m))


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """' (did you mean 'a' or 'b'?)' for the close matches of `word`, or '' when there are none."""
    found = close_matches(word, known)
    if not found:
        return ""
    return " (did you mean " + " or ".join(repr(m) for m in found) + "?)"

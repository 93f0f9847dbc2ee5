"""Names as text for a console or a log: their control characters visible, never acted on.

Folder, file and tensor names come from whoever wrote the checkpoint. Printed raw, an escape
sequence (`\\x1b]0;...`, `\\x1b[31m`) or a carriage return rewrites the user's terminal, and a
newline forges a log line; shown as `\\x1b`, `\\r` or `\\n`, the name is visibly what it is.
"""

from __future__ import annotations


def visible(text: str, *, keep: str = "") -> str:
    """`text` with every character str.isprintable() refuses (except those in `keep`) as its Python
    escape: C0 and C1 controls, DEL, bidi overrides, line separators, and the lone surrogates of an
    undecodable file name (which could not even be encoded for the terminal)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)

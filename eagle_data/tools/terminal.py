"""Data text as a terminal shows it: literally.

A dataset's text reaches the tools' output (a source name, a prompt, an answer, a sample
id), and a terminal acts on control characters instead of showing them: an escape sequence
in a row could set the window title, clear the screen or recolour what follows, and a
carriage return writes over the line already shown. Every piece of data text a tool prints
goes through `literal`, which shows each control character as a `\\xNN` escape.
"""

from __future__ import annotations

# C0 (ESC among them), DEL and C1: what a terminal may act on.
CONTROL = [*range(0x20), 0x7F, *range(0x80, 0xA0)]
ONE_LINE = {c: f"\\x{c:02x}" for c in CONTROL}
# A prompt or an answer keeps its lines and indentation readable; a carriage return is
# still shown, since it would hide what came before it on the line.
MULTILINE = {c: e for c, e in ONE_LINE.items() if chr(c) not in "\n\t"}


def literal(text, multiline: bool = False) -> str:
    """`text` (any value, as str) with every control character shown as `\\xNN`; with
    `multiline`, newlines and tabs are kept."""
    return str(text).translate(MULTILINE if multiline else ONE_LINE)

"""How many lines a user writes to change one script into another (the "≤ N lines" claims of the docs)."""

from __future__ import annotations

import ast
import difflib


def code_lines(text: str) -> list[str]:
    """The script's lines without its module docstring (what a diff of the code shows)."""
    body = ast.parse(text).body
    lines = text.splitlines()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines = lines[body[0].end_lineno or 0:]
    return lines


def changed_lines(before: str, after: str) -> int:
    """Lines of ``after``'s code that are new or altered (what the user writes), blank lines and the module
    docstring aside."""
    a, b = code_lines(before), code_lines(after)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(1 for tag, _, _, j1, j2 in ops if tag in ("insert", "replace") for line in b[j1:j2] if line.strip())

"""Plain text from docstrings and help strings, written as Markdown for the documentation site.

Help texts and field docs are prose with a few reStructuredText habits (````code````); here the
code spans become Markdown's, and every other character Markdown would read as markup (``*``,
``_``, ``<``, ...) is escaped, so that the page shows the text exactly as ``--help`` does.
"""

from __future__ import annotations

import re

_CODE = re.compile(r"``(.+?)``|`([^`]+)`")
_ESCAPED = "\\`*_[]#|"


def code(text: str) -> str:
    """``text`` as one Markdown code span (backticks inside it are fenced by longer runs)."""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def escape(text: str) -> str:
    """``text`` with Markdown's markup characters escaped and HTML's written as entities."""
    out = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "".join(f"\\{ch}" if ch in _ESCAPED else ch for ch in out)


def prose(text: str) -> str:
    """One paragraph of ``text`` (whitespace collapsed): its ````code```` and ```code``` spans
    as code spans, the rest escaped."""
    text = " ".join(text.split())
    parts, end = [], 0
    for match in _CODE.finditer(text):
        parts.append(escape(text[end:match.start()]))
        parts.append(code(match.group(1) or match.group(2)))
        end = match.end()
    parts.append(escape(text[end:]))
    return "".join(parts)


def fenced(text: str, lang: str = "text") -> str:
    """``text`` as a fenced code block, its lines' trailing spaces removed."""
    body = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    fence = "`" * max(3, max((len(r) + 1 for r in re.findall(r"`{3,}", body)), default=0))
    return f"{fence}{lang}\n{body}\n{fence}"


def anchor(*words: str) -> str:
    """A stable heading id: the words lower-cased, joined by ``-``, other characters dropped."""
    text = "-".join(words).lower().replace("_", "-").replace(".", "-")
    return re.sub(r"[^a-z0-9-]+", "", text)

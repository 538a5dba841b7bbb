"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

Pages link to files of the repository that are not pages of the site: a report folder under
``docs/``, or a file outside ``docs/`` (``../configs/wikitext103-ecp.yaml``). Such a link
points, in the built site, to the file in the repository at ``repo_url`` when ``mkdocs.yml``
sets one, and otherwise becomes its text in code (the path), since the site does not hold it.
A link to a path that exists nowhere is left as written, so MkDocs reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def repository_target(target: str, page_src: str, docs_dir: Path, root: Path,
                      site_files: set[str]) -> str | None:
    """The repository path a relative link from ``page_src`` names, if it exists in the
    repository but is not a file of the site (None otherwise)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_src), path))
    if joined in site_files:
        return None
    on_disk = (docs_dir / joined).resolve()
    try:
        relative = on_disk.relative_to(root.resolve())
    except ValueError:
        return None
    return relative.as_posix() if on_disk.exists() else None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    site_files = {f.src_uri for f in files}
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        text, target = match.groups()
        path = repository_target(target, page.file.src_uri, docs_dir, root, site_files)
        if path is None:
            return match.group(0)
        if repo_url:
            kind = "tree" if (root / path).is_dir() else "blob"
            return f"[{text}]({repo_url}/{kind}/main/{path})"
        return text if text.startswith("`") else f"`{path}`"

    # Links inside fenced code are text, not links.
    pieces, end = [], 0
    for fence in FENCE.finditer(markdown):
        pieces.append(LINK.sub(rewrite, markdown[end:fence.start()]))
        pieces.append(fence.group(0))
        end = fence.end()
    pieces.append(LINK.sub(rewrite, markdown[end:]))
    return "".join(pieces)

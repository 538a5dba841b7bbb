"""The documentation site's generated files, rendered from the code they describe.

- ``docs/reference/cli.md`` from the ``ecp`` argparse parsers (``cli_page``);
- ``docs/reference/config.md`` from the config dataclasses and presets (``config_page``);
- ``docs/reference/api.md``, mkdocstrings directives for the public API (``api_page``);
- ``docs/img/masks/*.svg``, each architecture's attention mask from its predicate (``masks``);
- ``docs/results.md``, its prose from the leading study's ``results.md.in`` and its numbers
  from the committed report, and the results block of ``README.md`` and ``docs/index.md`` from
  its ``landing.md.in`` (``results_page``);
- ``docs/img/evidence5-mechanism.svg``, Evidence V's accuracy against distance from its
  committed verdict file (``mechanism``).

``python -m ecp_lm.docsgen`` writes them (``--check``: only says which differ); the tests check
that the committed files equal a fresh rendering.
"""

from __future__ import annotations

from pathlib import Path

REGENERATE = "python -m ecp_lm.docsgen"
"""The command that rewrites every generated file (``make docs-gen``)."""


def render_all(root: Path | None = None) -> dict[str, str]:
    """Every generated file, by path relative to the repository root, as its text (the
    results page where ``root``, the repository, holds its template)."""
    from ecp_lm.docsgen import api_page, cli_page, config_page, masks, mechanism, results_page

    pages = {"docs/reference/cli.md": cli_page.render(),
             "docs/reference/config.md": config_page.render(),
             "docs/reference/api.md": api_page.render()}
    results = None if root is None else results_page.render(root)
    if results is not None:
        pages[results_page.PAGE] = results
    for page in results_page.LANDINGS:
        text = None if root is None else results_page.landing(root, page)
        if text is not None:
            pages[page] = text
    picture = None if root is None else mechanism.render(root)
    if picture is not None:
        pages[mechanism.PICTURE] = picture
    return {**pages, **masks.render_all()}


def stale(root: Path, files: dict[str, str] | None = None) -> list[str]:
    """The generated files under ``root`` that are missing or differ from a fresh rendering."""
    files = render_all(root) if files is None else files
    return [path for path, text in files.items()
            if not (root / path).is_file() or (root / path).read_bytes() != text.encode()]


def write_all(root: Path) -> list[str]:
    """Write every generated file that differs under ``root``; returns their paths."""
    files = render_all(root)
    changed = stale(root, files)
    for path in changed:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(files[path].encode())
    return changed

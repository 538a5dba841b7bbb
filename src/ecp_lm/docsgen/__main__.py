"""``python -m ecp_lm.docsgen [--check] [--root DIR]``: regenerate the documentation's generated
files (reference pages and mask pictures) in the repository at DIR (default: the current folder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ecp_lm.docsgen import stale, write_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ecp_lm.docsgen", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the repository root (default: the current folder)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming the files that differ")
    args = parser.parse_args(argv)
    if not (args.root / "mkdocs.yml").is_file():
        print(f"error: {args.root} has no mkdocs.yml; give the repository root with --root",
              file=sys.stderr)
        return 2
    if args.check:
        changed = stale(args.root)
        for path in changed:
            print(f"stale: {path}")
        return 1 if changed else 0
    for path in write_all(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

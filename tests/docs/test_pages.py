"""The documentation's pages run: the code blocks of ``docs/getting-started.md`` and of every
``docs/tutorials/*.md``, one test per page (a new page is picked up by its file name).

The convention a page's fenced code blocks follow:

- Blocks are handled in the order they appear, in one fresh temporary folder per page, which is
  the working directory of every block of the page (so a later block sees what an earlier one
  wrote).
- ```` ```bash ```` blocks run with ``bash -euo pipefail``, with the virtual environment's bin
  folder first on ``PATH`` (``ecp`` is the installed command) and ``HF_HUB_OFFLINE=1``,
  ``HF_DATASETS_OFFLINE=1``, ``OMP_NUM_THREADS=1``, ``TQDM_DISABLE=1`` and ``MPLBACKEND=Agg``
  set, and ``ECP_LM_CACHE`` inside the page's folder (ecp's caches never in the user's home).
- ```` ```python ```` blocks are each written to a file and run by the environment's python, on
  their own: a block is a complete program (imports included), sharing no names with the
  others, only the folder.
- A block whose nearest non-blank line above is ``<!-- skip: REASON -->`` is not run (the reason
  is listed in the test summary): a multi-node ``torchrun``, a Hub download, a GPU-only step.
- A block whose nearest non-blank line above is ``<!-- file: NAME -->`` is written to NAME in the
  folder (folders created) instead of being run, whatever its language: a YAML config, a small
  text file a later block reads.
- ```` ```text ````, ```` ```console ```` and blocks of any other language are shown, not run.
- A block that fails fails the page's test, which names the page and line, the block's first
  line, its exit code and the last lines of its output. A page with no block to run fails (every
  tutorial must be exercised). A page gets ``ECP_DOCS_PAGE_TIMEOUT`` seconds in all (default
  300); a page that runs longer fails naming the block it was in.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIXTURES = Path(__file__).parent / "fixtures"
PAGES = sorted([*([DOCS / "getting-started.md"] if (DOCS / "getting-started.md").exists()
                  else []), *(DOCS / "tutorials").glob("*.md")])
TIMEOUT = float(os.environ.get("ECP_DOCS_PAGE_TIMEOUT", "300"))
TAIL = 40
"""Lines of a failing block's output shown."""

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>skip|file):\s*(?P<arg>.*?)\s*-->\s*$")
SKIPPED: list[str] = []
"""``page:line: reason`` of every block skipped in this session (printed in the summary)."""


@dataclass
class Block:
    line: int
    """The line of the opening fence (1-based)."""
    lang: str
    code: str
    marker: tuple[str, str] | None = None
    """("skip", reason) or ("file", name) from the comment above the block."""

    @property
    def first_line(self) -> str:
        return next((ln for ln in self.code.splitlines() if ln.strip()), "").strip()


@dataclass
class Report:
    ran: list[int] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the marker comment above each."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and not re.match(
                rf"^ {{0,{indent}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip()
                for ln in lines[i + 1:end]]
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        found = MARKER.match(above)
        blocks.append(Block(i + 1, opening["lang"].lower(), "\n".join(body) + "\n",
                            (found["kind"], found["arg"]) if found else None))
        i = end + 1
    return blocks


def environment(folder: Path) -> dict[str, str]:
    """The blocks' environment: the venv first on PATH, offline, one thread, and ecp's own
    cache (token caches, fetched corpora) inside the page's folder, never the user's."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1", "MPLBACKEND": "Agg",
            "ECP_LM_CACHE": str(folder / ".ecp-lm-cache")}


def run_block(command: list[str], folder: Path, timeout: float) -> tuple[int | None, str]:
    """(exit code, output) of ``command`` in ``folder``; exit code None if it ran past
    ``timeout`` seconds (then its whole process group is killed)."""
    process = subprocess.Popen(command, cwd=folder, env=environment(folder),
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=max(timeout, 0.1))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def run_page(page: Path, workdir: Path, timeout: float = TIMEOUT) -> Report:
    """Run ``page``'s blocks by the convention above in ``workdir``/page; fails the test at the
    first failing block."""
    folder, scripts = workdir / "page", workdir / "blocks"
    folder.mkdir(parents=True)
    scripts.mkdir(parents=True)
    report, deadline = Report(), time.monotonic() + timeout
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(DOCS) else page.name
    for n, block in enumerate(parse_blocks(page.read_text())):
        if block.marker and block.marker[0] == "skip":
            report.skipped.append((block.line, block.marker[1]))
            continue
        if block.marker and block.marker[0] == "file":
            target = folder / block.marker[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
            report.written.append(block.marker[1])
            continue
        if block.lang == "bash":
            script = scripts / f"{n:03d}.sh"
            command = ["bash", "-euo", "pipefail", str(script)]
        elif block.lang == "python":
            script = scripts / f"{n:03d}.py"
            command = [sys.executable, str(script)]
        else:
            continue
        script.write_text(block.code)
        code, output = run_block(command, folder, deadline - time.monotonic())
        where = f"{name}:{block.line}: `{block.first_line}`"
        tail = "\n".join(output.splitlines()[-TAIL:])
        if code is None:
            pytest.fail(f"{where} was still running when the page's {timeout:g} s were up "
                        f"(ECP_DOCS_PAGE_TIMEOUT)\n--- last output ---\n{tail}", pytrace=False)
        if code != 0:
            pytest.fail(f"{where} exited with {code}\n--- last {TAIL} lines of its output "
                        f"---\n{tail}", pytrace=False)
        report.ran.append(block.line)
    if not report.ran:
        pytest.fail(f"{name} has no block that runs (a bash or python block without a skip "
                    f"marker): a page's commands must be exercised", pytrace=False)
    return report


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_runs(page: Path, tmp_path: Path) -> None:
    report = run_page(page, tmp_path)
    name = page.relative_to(DOCS).as_posix()
    SKIPPED.extend(f"docs/{name}:{line}: {reason}" for line, reason in report.skipped)


# The runner itself, on pages of its own --------------------------------------------------------

def test_runner_runs_a_page_in_order_honouring_markers(tmp_path: Path) -> None:
    report = run_page(FIXTURES / "passing.md", tmp_path)
    assert report.written == ["config/notes.yaml"]
    assert [reason for _, reason in report.skipped] == ["would fail if it ran"]
    assert len(report.ran) == 4  # 3 bash blocks and 1 python block; text and console not run
    assert (tmp_path / "page" / "from-python.txt").read_text() == "seen: 2 lines\n"


def test_runner_reports_a_failing_block(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_page(FIXTURES / "failing.md", tmp_path)
    message = str(failed.value)
    assert "failing.md:9: `echo before the failure`" in message
    assert "exited with 3" in message and "about to fail" in message
    assert not (tmp_path / "page" / "after.txt").exists()  # no block after the failure ran


def test_runner_fails_a_page_without_runnable_blocks(tmp_path: Path) -> None:
    page = tmp_path / "empty.md"
    page.write_text("# Nothing to run\n\n```text\nls\n```\n\n<!-- skip: no -->\n```bash\nls\n```\n")
    with pytest.raises(pytest.fail.Exception, match="has no block that runs"):
        run_page(page, tmp_path / "work")


def test_runner_stops_a_page_past_its_time(tmp_path: Path) -> None:
    page = tmp_path / "slow.md"
    page.write_text("# Slow\n\n```bash\nsleep 30 &\nwait\n```\n")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"slow.md:3: `sleep 30 &` was still running"):
        run_page(page, tmp_path / "work", timeout=1)
    assert time.monotonic() - started < 10

"""``docs/reference/cli.md``: every ``ecp`` command and subcommand as its parser describes it.

The page is rendered from the argparse parsers that ``ecp_lm.cli.build_parser`` builds, so it
says what ``ecp ... --help`` says: each command's usage line, description, arguments and options
(help text, choices, default) and its epilog (the examples), under a heading with a stable anchor
(``#ecp-train``, ``#ecp-data-prepare``). Help is formatted at a fixed width of 100 columns
whatever the terminal, so the page does not depend on where it is generated.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ecp_lm.docsgen.markdown import anchor, code, escape, fenced, prose

WIDTH = 100
"""The columns help text is formatted to (argparse reads them from ``COLUMNS``)."""

INTRO = """\
Every command of `ecp`, as `ecp COMMAND --help` prints it: usage, arguments and options with
their defaults, and examples. A `train` run's `section.key=value` settings are listed in
[Configuration](config.md).
"""


@contextmanager
def fixed_width() -> Iterator[None]:
    """Within it, argparse formats help for ``WIDTH`` columns and without colour."""
    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR")}
    os.environ.update(COLUMNS=str(WIDTH + 2), NO_COLOR="1")  # argparse uses columns - 2
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def top_parser() -> argparse.ArgumentParser:
    """The ``ecp`` parser with every subcommand's arguments added."""
    from ecp_lm.cli import build_parser

    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of each subcommand of ``parser``, in the order added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, sub, helps.get(name) or sub.description or ""))
    return found


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("ecp",)
         ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under ``parser`` (itself first) with its command words, depth first."""
    yield path, parser
    for name, sub, _ in subcommands(parser):
        yield from walk(sub, (*path, name))


def documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions ``--help`` lists: arguments and options, not subcommand lists or hidden ones."""
    return [a for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)]


def invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """How the action is written: ``--out DIR``, ``-h, --help``, ``SOURCE``."""
    formatter = parser._get_formatter()
    if not action.option_strings:
        return formatter._metavar_formatter(action, action.dest)(1)[0]
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    args = formatter._format_args(action, action.dest.upper())
    return ", ".join(action.option_strings) + " " + args


def default_text(action: argparse.Action) -> str | None:
    """The default worth showing: not for flags, unset values or empty lists."""
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS) or default == []:
        return None
    return str(default)


def action_item(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One bullet: the invocation, its help, then whether it is required, its choices and its
    default (where the help does not give it) in parentheses."""
    formatter = parser._get_formatter()
    text = prose(formatter._expand_help(action)) if action.help else ""
    line = f"- {code(invocation(parser, action))}" + (f": {text}" if text else "")
    extras = ["required"] if action.required and action.option_strings else []
    if action.choices and not isinstance(action.choices, dict):
        extras.append("choices: " + ", ".join(code(str(c)) for c in action.choices))
    default = default_text(action)
    if default is not None and "default" not in (action.help or ""):  # the help may say it
        extras.append(f"default: {code(default)}")
    return line + (f" ({'; '.join(extras)})" if extras else "")


def formatted(parser: argparse.ArgumentParser, text: str) -> str:
    """``text`` as ``--help`` prints it under this parser's formatter (raw or refilled)."""
    formatter = parser._get_formatter()
    formatter.add_text(text)
    return formatter.format_help()


def epilog(parser: argparse.ArgumentParser) -> str | None:
    """The parser's epilog as its help shows it when no other option is given."""
    write = getattr(parser, "help_epilog", None)
    if write is not None:
        return write([])
    return parser.epilog


def command_section(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    name = " ".join(path)
    level = "#" * min(len(path) + 1, 4)
    out = [f"{level} {name} {{#{anchor(*path)}}}", "", fenced(parser.format_usage()), ""]
    if parser.description:
        out += [prose(parser.description), ""]
    subs = subcommands(parser)
    if subs:
        out += ["Commands:", ""]
        out += [f"- [{code(' '.join((*path, sub_name)))}](#{anchor(*path, sub_name)}): "
                f"{prose(text)}" for sub_name, _, text in subs]
        out.append("")
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in documented(parser)]
        if not actions:
            continue
        title = f"**{escape(group.title or '')}**"
        if group.description:
            title += f": {prose(group.description)}"
        out += [title, "", *(action_item(parser, a) for a in actions), ""]
    text = epilog(parser)
    if text:
        out += [fenced(formatted(parser, text)), ""]
    return out


def render() -> str:
    """The page's Markdown."""
    with fixed_width():
        parser = top_parser()
        lines = ["# Command line", "",
                 "<!-- Generated by `python -m ecp_lm.docsgen` from the argparse parsers "
                 "(ecp_lm.cli); do not edit. -->", "", INTRO]
        for path, sub in walk(parser):
            lines += command_section(path, sub)
    return "\n".join(lines).rstrip("\n") + "\n"

"""Every ``--help`` ends with examples that parse, ``ecp eval --help`` names its figures, and the
two preset lists are told apart where a name is in both."""

from __future__ import annotations

import argparse
import shlex

import pytest

from ecp_lm.cli import build_parser, main


def parsers(parser: argparse.ArgumentParser, name: str = "ecp"):
    """``(command line, parser)`` of ``parser`` and of every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


COMMANDS = dict(parsers(build_parser()))


def test_every_command_is_walked():
    assert {"ecp", "ecp data", "ecp data prepare", "ecp data info", "ecp train", "ecp eval",
            "ecp generate", "ecp export", "ecp plot", "ecp complexity", "ecp bench",
            "ecp demo"} <= set(COMMANDS)


def examples(text: str) -> list[str]:
    """The ``ecp ...`` lines after the last ``examples:`` heading of a help text."""
    tail = text[text.rindex("examples:"):].splitlines()[1:]
    return [line.strip() for line in tail if line.strip().startswith("ecp ")]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_ends_with_examples_that_parse(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = COMMANDS[name].format_help()
    lines = examples(text)
    assert lines, text
    tail = text[text.rindex("examples:"):].rstrip().splitlines()[1:]
    assert all(line.startswith("  ") for line in tail), text  # the examples end the help
    for line in lines:
        argv = shlex.split(line)[1:]
        if name != "ecp":  # a command's own examples run that command
            assert " ".join(argv).startswith(name.removeprefix("ecp ")), line
        args = build_parser().parse_args(argv)  # exits (SystemExit) on a usage error
        assert callable(args.run), line
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [["--help"], ["data", "prepare", "--help"], ["eval", "--help"]])
def test_examples_survive_argparse_formatting(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # narrower than some examples: kept whole all the same
    assert main(argv) == 0
    text = capsys.readouterr().out
    name = " ".join(["ecp", *argv[:-1]])
    assert examples(text) == examples(COMMANDS[name].format_help())


def test_eval_help_names_its_figures():
    text = " ".join(COMMANDS["ecp eval"].format_help().split())
    for figure in ("loss", "perplexity", "bits per byte", "word-level perplexity", "accuracy",
                   "pixel"):
        assert figure in text, figure


@pytest.mark.parametrize("name, takes, other", [
    ("ecp train", "ecp train --config takes run presets", "ecp complexity --preset takes model"),
    ("ecp complexity", "ecp complexity --preset takes model presets",
     "ecp train --config takes run"),
])
def test_shared_preset_names_say_which_list(name, takes, other, monkeypatch):
    from ecp_lm.config import PRESETS
    from ecp_lm.run.config import RUN_PRESETS

    monkeypatch.setenv("COLUMNS", "100")
    text = " ".join(COMMANDS[name].format_help().split())
    assert takes in text and other in text
    shared = [n for n in RUN_PRESETS if n in PRESETS]
    assert shared  # tiny and paper are in both lists
    assert f"{' and '.join(shared)} are in both lists" in text

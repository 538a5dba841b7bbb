"""The run configuration described for people: every ``section.key`` with the value a preset,
a YAML file and overrides give it, and the documentation under its field (``ecp train
--help``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import yaml

from ecp_lm.run.config import RUN_PRESETS, SECTION_TYPES, parse_override, read_yaml


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    import ast
    import inspect
    import itertools
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def config_values(preset_or_path: str | None = None,
                  overrides: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """The value of every ``section.key`` as a preset or YAML file sets it, with ``overrides``
    applied (the defaults where it sets none; None: all defaults). Raw values: a size the
    architecture derives (``model.latent_len``, ``model.window``, ``model.block_len``, ...)
    stays null unless set."""
    values = {section: {f.name: f.default for f in fields(cls)}
              for section, cls in SECTION_TYPES.items()}
    data = {} if preset_or_path is None else (
        RUN_PRESETS[preset_or_path] if preset_or_path in RUN_PRESETS
        else read_yaml(preset_or_path))
    for section, items in data.items():
        values.get(section, {}).update(items or {})
    for item in overrides:
        (section, name), value = parse_override(item)
        values.get(section, {})[name] = value
    return values


def yaml_scalar(value: Any) -> str:
    """``value`` as it is typed in YAML or an override: ``null``, ``true``, ``0.001``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def describe_fields(values: dict[str, dict[str, Any]] | None = None, width: int = 100) -> str:
    """Every ``section.key=value`` (``config_values``; default: the defaults) and its
    documentation, for ``--help``, wrapped to ``width`` columns."""
    import textwrap

    values = values or config_values()
    column = 34  # where the documentation starts
    lines = []
    for section, cls in SECTION_TYPES.items():
        docs = field_docs(cls)
        for f in fields(cls):
            key = f"  {section}.{f.name}={yaml_scalar(values[section][f.name])}"
            doc = docs.get(f.name, "").replace("``", "")
            wrapped = textwrap.wrap(doc, max(20, width - column),
                                    break_on_hyphens=False) or [""]
            if len(key) < column - 1:
                lines.append(f"{key:<{column}}{wrapped[0]}".rstrip())
                wrapped = wrapped[1:]
            else:
                lines.append(key)
            lines += [" " * column + part for part in wrapped]
    return "\n".join(lines)

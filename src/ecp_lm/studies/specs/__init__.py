"""The live studies, one module each holding one ``spec.Study`` named ``STUDY``; a study of
one's own is a Python file that does the same (``load("my_study.py")``)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from ecp_lm.studies.spec import Study

NAMES = ("evidence4", "evidence5")


def load(name: str) -> Study:
    """A live study by name, or the ``STUDY`` of a Python file."""
    if name in NAMES:
        return importlib.import_module(f"ecp_lm.studies.specs.{name}").STUDY
    path = Path(name)
    if path.suffix != ".py":
        raise ValueError(f"unknown study {name!r}: studies are {', '.join(NAMES)}, or a .py "
                         f"file that defines STUDY")
    if not path.is_file():
        raise ValueError(f"study file {name} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"ecp_study_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    study = getattr(module, "STUDY", None)
    if not isinstance(study, Study):
        raise ValueError(f"study file {name} defines no STUDY (an ecp_lm.studies.spec.Study)")
    return study

"""benchmarks/dropout.py: each case runs what it names (the library case torch's bernoulli masks
on the mask or flash kernel, the native case the hashed masks on the native kernel), and the
table and JSON carry every case of every architecture."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dropout.py"


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT, "dropout_bench_script")


def test_each_case_runs_its_kernels_and_masks(script, native_kernel, monkeypatch):
    from ecp_lm import build_model
    from ecp_lm.model.kernels import native

    bernoulli, seeds = [], []  # torch's residual masks; the native kernel's draws
    real_dropout, real_seed = torch.nn.functional.dropout, native._seed
    monkeypatch.setattr(torch.nn.functional, "dropout",
                        lambda *a, **kw: bernoulli.append(1) or real_dropout(*a, **kw))
    monkeypatch.setattr(native, "_seed", lambda: seeds.append(1) or real_seed())
    for arch, attention in (("ecp", "mask"), ("transformer", "flash")):
        for name, (cfg, library) in script.cases(arch, 0.1).items():
            model, ran = build_model(cfg).train(), []
            real_attend = type(model.arch).attend
            bernoulli.clear()
            seeds.clear()
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(type(model.arch), "attend", lambda self, *a, ran=ran,
                              f=real_attend: ran.append(a[-1]) or f(self, *a))
                with native.library_dropout() if library else nullcontext():
                    model.loss(torch.randint(0, 256, (2, 257)))
            expected = {"dropout 0": "native" if arch == "ecp" else "flash",
                        "library": attention, "native": "native"}[name]
            assert set(ran) == {expected}, (arch, name)
            assert bool(bernoulli) == (name == "library"), (arch, name)
            assert bool(seeds) == (name == "native"), (arch, name)


def test_the_table_and_json(script, native_kernel, tmp_path, capsys):
    out = tmp_path / "dropout.json"
    assert script.main(["--archs", "ecp,transformer", "--rounds", "1", "--repeats", "1",
                        "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.count("\n| ecp |") == 1 and "| transformer |" in table
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {"ecp", "transformer"}
    for cases in report["seconds"].values():
        assert set(cases) == {"dropout 0", "library", "native"}
        assert all(s > 0 for s in cases.values())
    with pytest.raises(SystemExit):
        script.main(["--p", "1.5"])

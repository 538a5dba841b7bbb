"""Reading metrics.jsonl (resumes, truncated tails, bad lines) and rendering learning curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ecp_lm.plot import plot_runs, read_metrics, run_label

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "tokens": step * 4096, "loss": loss, "lr": 1e-3,
            "tokens_per_s": 5e4, "elapsed_s": step * 0.1}


def valid(step: int, loss: float, bpb: float | None) -> dict:
    return {"kind": "valid", "step": step, "tokens": step * 4096, "loss": loss,
            "bits_per_byte": bpb, "ppl_token": math.exp(loss), "accuracy": None,
            "elapsed_s": step * 0.1}


def write_run(root: Path, name: str, records: list[dict], tail: str = "",
              arch: str | None = None) -> Path:
    run = root / name
    run.mkdir()
    lines = [json.dumps(r) for r in records]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    if arch is not None:
        config = f"model:\n  arch: {arch}\n  dim: 64\ntrain:\n  lr: 0.001\n"
        (run / "config.yaml").write_text(config)
    return run


@pytest.fixture
def resumed_run(tmp_path: Path) -> Path:
    """Run to step 300, crash, resume from the step-200 checkpoint and re-log 300 and 400."""
    records = [train(s, 5.0 - s / 200) for s in (100, 200, 300)]
    records += [valid(200, 4.2, 1.9), {"kind": "checkpoint", "step": 200, "path": "ckpt.pt"}]
    records += [train(300, 3.25), train(400, 3.0), valid(400, 3.1, 1.5)]
    return write_run(tmp_path, "ecp-small", records, tail='{"kind": "train", "step": 5', arch="ecp")


@pytest.fixture
def train_only_run(tmp_path: Path) -> Path:
    return write_run(tmp_path, "baseline", [train(s, 5.5 - s / 150) for s in (50, 150, 250)])


def test_read_metrics_keeps_last_record_per_step_sorted(resumed_run: Path) -> None:
    metrics = read_metrics(resumed_run)
    assert set(metrics) == {"train", "valid"}
    assert [r["step"] for r in metrics["train"]] == [100, 200, 300, 400]
    assert metrics["train"][2]["loss"] == 3.25  # the resumed run's value, not the first
    assert [(r["step"], r["bits_per_byte"]) for r in metrics["valid"]] == [(200, 1.9), (400, 1.5)]


def test_read_metrics_sorts_out_of_order_steps(tmp_path: Path) -> None:
    run = write_run(tmp_path, "r", [train(30, 1.0), train(10, 3.0), train(20, 2.0)])
    assert [r["step"] for r in read_metrics(run)["train"]] == [10, 20, 30]


def test_bad_middle_line_names_file_and_line(tmp_path: Path) -> None:
    tail = '{"kind": "tr\n' + json.dumps(train(2, 2.0))
    run = write_run(tmp_path, "r", [train(1, 3.0)], tail=tail)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2:"):
        read_metrics(run)


def test_missing_folder_or_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nowhere"):
        read_metrics(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty/metrics\.jsonl"):
        read_metrics(tmp_path / "empty")


def test_run_label_uses_arch_or_folder_name(resumed_run: Path, train_only_run: Path) -> None:
    assert run_label(resumed_run) == "ecp-small (ecp)"
    assert run_label(train_only_run) == "baseline"


@pytest.mark.parametrize("x", ["tokens", "step"])
def test_plot_runs_writes_png(tmp_path: Path, resumed_run: Path, train_only_run: Path,
                              x: str) -> None:
    out = plot_runs([resumed_run, train_only_run], tmp_path / "plots" / "nested" / "c.png", x=x)
    assert out == tmp_path / "plots" / "nested" / "c.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["c.png"]  # no temp file left behind


def test_plot_runs_train_only(tmp_path: Path, train_only_run: Path) -> None:
    out = plot_runs([train_only_run], tmp_path / "c.png", title="baseline")
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert out.stat().st_size > 5_000


def test_plot_runs_rejects_unknown_x(tmp_path: Path, train_only_run: Path) -> None:
    with pytest.raises(ValueError, match="elapsed_s"):
        plot_runs([train_only_run], tmp_path / "c.png", x="elapsed_s")
    assert not (tmp_path / "c.png").exists()


MAGIC = {".png": PNG_SIGNATURE, ".jpg": b"\xff\xd8\xff", ".jpeg": b"\xff\xd8\xff",
         ".pdf": b"%PDF-", ".svg": b"<?xml"}


@pytest.mark.parametrize("suffix", [".png", ".jpg", ".JPEG", ".pdf", ".svg"])
def test_plot_writes_the_format_its_suffix_names(capsys, tmp_path: Path, train_only_run: Path,
                                                 suffix: str) -> None:
    from helpers import run_cli

    out = tmp_path / f"curves{suffix}"
    for _ in range(2):  # the second time over its own figure
        code, _, err = run_cli(capsys, "plot", train_only_run, "--out", out)
        assert code == 0 and err == ""
        data = out.read_bytes()
        assert data.startswith(MAGIC[suffix.lower()]), data[:16]
    if suffix == ".svg":
        assert b"<svg" in data[:2000]


@pytest.mark.parametrize("name, fragment", [
    ("curves.gif", "--out {out} has suffix .gif"), ("curves", "--out {out} has no suffix")])
def test_plot_refuses_a_suffix_it_cannot_write(capsys, tmp_path: Path, train_only_run: Path,
                                               name: str, fragment: str) -> None:
    from helpers import run_cli

    out = tmp_path / name
    code, stdout, err = run_cli(capsys, "plot", train_only_run, "--out", out)
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert fragment.format(out=out) in err and ".png, .pdf, .svg, .jpg, .jpeg" in err
    assert not out.exists()


def test_plot_never_overwrites_a_figure_ecp_did_not_write(capsys, tmp_path: Path,
                                                          train_only_run: Path) -> None:
    from helpers import run_cli

    for name, data in (("paper.pdf", b"%PDF-1.4 a user's paper"),
                       ("photo.jpg", b"\xff\xd8\xff\xe0 a user's photo"),
                       ("drawing.svg", b"<?xml version='1.0'?><svg/>")):
        (tmp_path / name).write_bytes(data)
        code, _, err = run_cli(capsys, "plot", train_only_run, "--out", tmp_path / name)
        assert code == 2 and "was not written by ecp" in err
        assert (tmp_path / name).read_bytes() == data


def test_files_that_are_not_utf8_are_named(capsys, tmp_path: Path) -> None:
    from helpers import run_cli

    run = write_run(tmp_path, "r", [train(1, 3.0)])
    (run / "metrics.jsonl").write_bytes(b'{"kind": "train", "step": 1, "loss": 3.0\xff}\n')
    with pytest.raises(ValueError, match=r"r/metrics\.jsonl is not UTF-8 text \(byte 40"):
        read_metrics(run)
    labelled = write_run(tmp_path, "s", [train(1, 3.0)], arch="ecp")
    (labelled / "config.yaml").write_bytes(b"model:\n  arch: \xffcp\n")
    with pytest.raises(ValueError, match=r"s/config\.yaml is not a UTF-8 YAML file"):
        run_label(labelled)
    report = tmp_path / "report.json"
    report.write_bytes(b'{"kind": "per_position"\xff}')
    code, _, err = run_cli(capsys, "plot", "--per-position", report, "--out",
                           tmp_path / "p.png")
    assert code == 2 and f"{report} is not UTF-8 text" in err and err.count("\n") == 1

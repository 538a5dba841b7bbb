"""RunConfig: presets, YAML, dotted overrides with type checks, one-line errors."""

import pytest

from ecp_lm.run.config import RUN_PRESETS, RunConfig
from ecp_lm.run.describe import describe_fields


def test_presets_load():
    for name in RUN_PRESETS:
        cfg = RunConfig.load(name)
        assert cfg.model.arch == "ecp"


def test_overrides_are_typed():
    cfg = RunConfig.load("tiny", ["model.d_model=128", "train.lr=3e-4", "model.tied_kv=true",
                                  "model.arch=double", "train.eval_max_tokens=null"])
    assert (cfg.model.d_model, cfg.train.lr, cfg.model.tied_kv) == (128, 3e-4, True)
    assert cfg.model.arch == "double" and cfg.train.eval_max_tokens is None
    assert RunConfig.load("tiny", ["train.lr=1"]).train.lr == 1.0  # int accepted for float


def test_yaml_round_trip(tmp_path):
    cfg = RunConfig.load("demo", ["model.arch=ssplit"])
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    assert RunConfig.load(str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    ("model.width=3", "unknown config key model.width"),
    ("optim.lr=3", "unknown config section"),
    ("train.steps=many", "config key train.steps expects int, got 'many'"),
    ("model.tied_kv=3", "config key model.tied_kv expects bool, got 3"),
    ("train.lr=fast", "config key train.lr expects float"),
    ("model.latent_len=1.5", "config key model.latent_len expects int or null"),
    ("lr=3", "not of the form section.key=value"),
    ("model.d_model=66", "d_model=66 is not divisible by n_heads=4"),
    ("train.schedule=linear", "train.schedule='linear'"),
    ("train.seed=-1", "train.seed=-1 must be from 0 to 4294967295"),
    ("train.seed=4294967296", "train.seed=4294967296"),
    ("data.bpe_vocab_size=256", "data.bpe_vocab_size=256 must be an integer from 257"),
    ("data.bpe_vocab_size=10000000", "data.bpe_vocab_size=10000000 .* 1,048,576"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ValueError, match=message) as err:
        RunConfig.load("tiny", [override])
    assert "\n" not in str(err.value)


def test_bad_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  arch: ecp\n  colour: blue\n")
    with pytest.raises(ValueError, match="unknown config key model.colour"):
        RunConfig.load(str(path))
    with pytest.raises(ValueError, match="neither a preset"):
        RunConfig.load(str(tmp_path / "missing.yaml"))


def test_help_documents_every_key():
    text = describe_fields()
    for key in ("model.num_segments", "data.tokenizer", "train.grad_accum", "train.fsdp"):
        assert key in text
    assert "Micro-batches per optimiser step" in text


def test_seed_bounds_that_train():
    assert RunConfig.load("tiny", ["train.seed=4294967295"]).train.seed == 2**32 - 1
    assert RunConfig.load("tiny", ["train.seed=0"]).train.seed == 0


def test_unreadable_yaml_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"model:\n  arch: ecp\xff\n")
    with pytest.raises(ValueError, match=f"{path} is not a UTF-8 YAML file"):
        RunConfig.load(str(path))
    path.write_text("model: [\n")
    with pytest.raises(ValueError, match=f"{path} is not valid YAML: .* line"):
        RunConfig.load(str(path))

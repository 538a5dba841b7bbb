"""Configs saved by an earlier release under the names sizes had then: block_local's block was
``window``. A run folder's and a checkpoint's ``config.yaml`` written that way load to the model
they describe (block_len = the saved window), while a file a user writes now is refused."""

from __future__ import annotations

import pytest
import torch
import yaml

from ecp_lm import ModelConfig, build_model
from ecp_lm.run.checkpoint import read_checkpoint, save_checkpoint
from ecp_lm.run.config import RunConfig
from ecp_lm.run.folder import check_run_folder, is_legacy_run
from helpers import random_tokens

NEW = ModelConfig(arch="block_local", block_len=8)


def earlier_release_yaml() -> str:
    """A run config as an earlier release wrote it: ``model:`` with arch block_local and its
    block as ``window: 8``, every other field as ``ModelConfig().to_dict()`` had it (no
    block_len or group_len key)."""
    data = RunConfig().to_dict()
    model = {k: v for k, v in ModelConfig().to_dict().items()
             if k not in ("block_len", "group_len")}
    data["model"] = {**model, "arch": "block_local", "window": 8}
    return yaml.safe_dump(data, sort_keys=False)


def same_model(cfg: ModelConfig) -> None:
    """``cfg`` builds the model ``NEW`` does: the same parameters and the same outputs."""
    torch.manual_seed(0)
    got = build_model(cfg).eval()
    torch.manual_seed(0)
    want = build_model(NEW).eval()
    assert got.cfg.block_len == 8 and got.cfg.window is None
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name
    tokens = random_tokens(2, 40, vocab=256)
    with torch.no_grad():
        assert torch.equal(got(tokens), want(tokens))


def test_a_run_folder_of_an_earlier_release(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(earlier_release_yaml())
    (run / "metrics.jsonl").write_text("")
    saved = RunConfig.load(str(run / "config.yaml"), saved=True)
    assert saved.model == NEW
    same_model(saved.model)
    assert is_legacy_run(run)  # recognised as a run folder
    # --resume with the same model in today's names: unchanged, so it starts again
    assert check_run_folder(RunConfig(model=NEW), run, resume=True) is None
    with pytest.raises(ValueError, match="changed model config"):
        check_run_folder(RunConfig(model=ModelConfig(arch="block_local", block_len=16)), run,
                         resume=True)
    # the same file as a user's --config is a config written now: refused with the new name
    with pytest.raises(ValueError, match=r"model\.window=8: .*set block_len=8"):
        RunConfig.load(str(run / "config.yaml"))


def test_a_checkpoint_of_an_earlier_release(tmp_path):
    torch.manual_seed(0)
    model = build_model(NEW)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, model.state_dict(), RunConfig(model=NEW), None, None, {"step": 0})
    (ckpt / "config.yaml").write_text(earlier_release_yaml())
    loaded = read_checkpoint(ckpt)
    assert loaded.config.model == NEW
    same_model(loaded.config.model)
    restored = loaded.load_model()
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name
    tokens = random_tokens(2, 40, vocab=256)
    with torch.no_grad():
        assert torch.equal(restored(tokens), model.eval()(tokens))

"""ModelConfig validation (one test per ValueError case), YAML round-trip and presets."""

import dataclasses

import pytest

from ecp_lm import PRESETS, ModelConfig, build_model
from ecp_lm.config import ARCHS, architecture


def raises(match: str, **fields):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)


def test_unknown_arch():
    raises(r"arch='mamba3' is not one of", arch="mamba3")


def test_d_model_not_divisible_by_heads():
    raises(r"d_model=66 is not divisible by n_heads=4", d_model=66, n_heads=4)


def test_odd_head_dim_with_rope():
    raises(r"head dimension d_model/n_heads=9 is odd", d_model=36, n_heads=4)
    ModelConfig(d_model=36, n_heads=4, rope="none")  # fine without RoPE


def test_seq_len_not_divisible_by_segments_for_ecp():
    raises(r"seq_len=100 is not divisible by num_segments=8", arch="ecp", seq_len=100,
           num_segments=8)
    ModelConfig(arch="transformer", seq_len=100, num_segments=8)  # S unused by the transformer


@pytest.mark.parametrize("arch", ["perceiver_ar", "double", "compressed_double", "ssplit"])
@pytest.mark.parametrize("latent_len", [0, 64, -3])
def test_latent_len_range(arch, latent_len):
    raises(rf"latent_len={latent_len} is not in 1..seq_len-1=63", arch=arch, seq_len=64,
           latent_len=latent_len, num_segments=1)


def test_ssplit_history_not_divisible():
    raises(r"history length seq_len-latent_len=24 is not divisible by num_segments=5",
           arch="ssplit", seq_len=64, latent_len=40, num_segments=5)


@pytest.mark.parametrize("p", [0, 32, 40])
def test_compressed_len_range(p):
    raises(rf"compressed_len={p} is not in 1..history_len-1=31", arch="compressed_double",
           seq_len=64, compressed_len=p)


def test_compressed_double_needs_two_layers():
    raises(r"needs n_layers >= 2", arch="compressed_double", n_layers=1)


@pytest.mark.parametrize("name", ["vocab_size", "d_model", "n_layers", "n_heads", "seq_len",
                                  "num_segments", "ff_mult"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes(name, value):
    raises(rf"{name}={value} must be a positive integer", **{name: value})


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_range(p):
    raises(rf"dropout={p} is outside \[0, 1\)", dropout=p)


def test_other_choices():
    raises(r"rope='some'", rope="some")
    raises(r"attn_impl='fast'", attn_impl="fast")
    raises(r"num_classes=1", num_classes=1)
    raises(r"tie_embeddings=True needs the language-model head", num_classes=10,
           tie_embeddings=True)


def test_defaults_resolved():
    cfg = ModelConfig(arch="compressed_double", seq_len=64)
    assert (cfg.latent_len, cfg.compressed_len) == (None, None)  # what the user set: nothing
    resolved = cfg.resolved()
    assert (resolved.latent_len, resolved.history_len, resolved.compressed_len) == (32, 32, 16)
    assert cfg.history_len == 32 and cfg.latent_len is None  # resolved() leaves cfg as it was
    assert ModelConfig(arch="ecp", seq_len=64, num_segments=4).segment_len == 16
    assert ModelConfig(arch="ssplit", seq_len=64, num_segments=4).segment_len == 8


@pytest.mark.parametrize(("arch", "field", "at_64", "at_1024"), [
    ("sliding_window", "window", 25, 397),  # the same score entries as ECP at N, S = 4
    ("block_local", "block_len", 32, 512),  # 2m
    ("s2", "group_len", 16, 256),  # m
    ("perceiver_ar", "latent_len", 32, 512),  # N/2
    ("compressed_double", "compressed_len", 16, 256),  # h/2
])
def test_derived_sizes_never_go_stale(arch, field, at_64, at_1024):
    """A size left unset is derived from the others where it is needed: a replaced seq_len, a
    YAML edit or a preset gets the value a fresh config would, not one derived before."""
    cfg = ModelConfig(arch=arch, seq_len=64, num_segments=4)
    assert getattr(cfg.resolved(), field) == at_64
    longer = dataclasses.replace(cfg, seq_len=1024)
    assert getattr(longer.resolved(), field) == at_1024
    fresh = ModelConfig(arch=arch, seq_len=1024, num_segments=4)
    assert longer == fresh and getattr(fresh.resolved(), field) == at_1024
    assert build_model(longer).arch.cfg == fresh.resolved()


def as_an_earlier_release_saved(cfg: ModelConfig) -> dict:
    """``cfg``'s fields as an earlier release wrote them: derived sizes written out, each
    renamed size under its old name, and no block_len or group_len keys (s2's G was N/S)."""
    from ecp_lm.config import architecture

    data = cfg.resolved().to_dict()
    for old, new in architecture(cfg.arch).renamed.items():
        data[old] = data.pop(new)
    for name in ("block_len", "group_len"):
        data.pop(name, None)
    return data


@pytest.mark.parametrize("arch", ARCHS)
def test_configs_of_earlier_releases_load_to_the_same_model(arch):
    """Earlier releases wrote the derived sizes into config.yaml, under the names they had then;
    such a config describes the same model as the plain one (same parameters, same outputs,
    same resolved sizes)."""
    import torch

    plain = ModelConfig(arch=arch, seq_len=64, num_segments=4)
    written = ModelConfig.from_saved(as_an_earlier_release_saved(plain))  # what 0.3 saved
    assert written.resolved() == plain.resolved()
    assert ModelConfig.from_saved(plain.to_dict()) == plain  # and what this release saves
    torch.manual_seed(0)
    a = build_model(plain)
    torch.manual_seed(0)
    b = build_model(written)
    tokens = torch.randint(0, 256, (2, 64))
    assert torch.equal(a(tokens), b(tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_yaml_round_trip(tmp_path, arch):
    plain = ModelConfig(arch=arch, seq_len=64, num_segments=4)
    attends = not all(architecture(a).recurrent for a in plain.layer_archs)  # keys to tie
    cfg = ModelConfig(arch=arch, seq_len=64, num_segments=4, tied_kv=attends, rope="first",
                      dropout=0.1)
    path = tmp_path / "model.yaml"
    cfg.to_yaml(path)
    assert ModelConfig.from_yaml(path) == cfg


def test_yaml_unknown_field(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("arch: ecp\nwidth: 3\n")
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_yaml(path)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), (b"arch: ecp\n\xff\n", r"is not a UTF-8 YAML file \(byte 10"),
    (b"arch: [ecp\n", "is not valid YAML: .* line 2"), (b"- ecp\n", "expected a mapping")])
def test_yaml_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "model.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{path}.*{message}") as err:
        ModelConfig.from_yaml(path)
    assert "\n" not in str(err.value) and "Errno" not in str(err.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_presets_valid_for_every_arch(arch):
    for name in PRESETS:
        ModelConfig.from_preset(name, arch=arch)


def test_paper_preset_scale():
    cfg = ModelConfig.from_preset("paper")
    assert (cfg.arch, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.num_segments) == \
        ("ecp", 768, 12, 6, 2048, 8)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.from_preset("huge")


# One name per meaning: window is sliding_window's, block_len block_local's, group_len s2's ------

def test_the_baselines_defaults_are_set_from_ecp_segments():
    """Left unset, b = 2m and G = m, with m = N/S, ECP's segment: in a fresh config and in one
    whose N was replaced."""
    for n in (64, 1024):
        block = ModelConfig(arch="block_local", seq_len=n, num_segments=4)
        group = ModelConfig(arch="s2", seq_len=n, num_segments=4)
        assert (block.block_len, group.group_len) == (None, None)
        assert block.resolved().block_len == 2 * (n // 4) and block.resolved().window is None
        assert group.resolved().group_len == n // 4 == group.segment_len
        assert dataclasses.replace(block, seq_len=2 * n).resolved().block_len == n
        assert dataclasses.replace(group, seq_len=2 * n).resolved().group_len == n // 2
    assert build_model(ModelConfig(arch="block_local", seq_len=64)).arch.period == 32
    assert build_model(ModelConfig(arch="s2", seq_len=64)).arch.period == 16


def test_a_new_config_that_calls_block_local_s_block_window_is_refused():
    with pytest.raises(ValueError, match=r"^window=8: arch='block_local' .*block_len.*"
                                         r"set block_len=8"):
        ModelConfig(arch="block_local", window=8)
    with pytest.raises(ValueError, match=r"window=8: .*set block_len=8"):
        ModelConfig.from_dict({"arch": "block_local", "window": 8})
    with pytest.raises(ValueError, match=r"window=8: .*set block_len=8"):  # both: not guessed
        ModelConfig.from_saved({"arch": "block_local", "window": 8, "block_len": 16})
    assert ModelConfig(arch="block_local", block_len=8).resolved().block_len == 8


def test_a_saved_block_local_window_is_read_as_its_block_len():
    import torch

    from ecp_lm.config import saved_fields

    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in ("block_len", "group_len")}
    old.update(arch="block_local", window=8)  # as an earlier release wrote it
    cfg = ModelConfig.from_saved(old)
    assert cfg == ModelConfig(arch="block_local", block_len=8)
    assert saved_fields({"arch": "sliding_window", "window": 8})["window"] == 8  # its own name
    torch.manual_seed(0)
    a = build_model(cfg)
    torch.manual_seed(0)
    b = build_model(ModelConfig(arch="block_local", block_len=8))
    tokens = torch.randint(0, 256, (2, 64))
    assert torch.equal(a(tokens), b(tokens))


@pytest.mark.parametrize(("name", "owners"), [("window", ("sliding_window", "longformer",
                                                         "routing")),
                                              ("block_len", ("block_local",)),
                                              ("group_len", ("s2",))])
def test_each_size_is_refused_where_the_pattern_has_none(name, owners):
    users = " and ".join(owners) + (" use" if len(owners) > 1 else " uses")
    for arch in ARCHS:
        if arch in owners:
            assert getattr(ModelConfig(arch=arch, **{name: 8}), name) == 8
        elif not (arch == "block_local" and name == "window"):
            raises(rf"^{name}=8 is set, but arch='{arch}' has no {name} \(only {users} "
                   rf"one\)", arch=arch, **{name: 8})

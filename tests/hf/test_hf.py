"""Hugging Face transformers: export -> from_pretrained gives our logits for every architecture
and for hybrid layer patterns, save/load round trips (tied embeddings, bfloat16, the hybrid's
fields through config.json), greedy generate() equals ecp_lm.generate token for token (ECP and
local-only hybrids past 3N in constant cache memory, a hybrid with a global layer past N),
pipelines produce text, and bad input is refused. Offline: nothing reaches a hub."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import ecp_lm.hf  # noqa: F401  (registers the model type)
from ecp_lm.cli import main
from ecp_lm.config import ARCHS, ModelConfig
from ecp_lm.data.tokenizers import ByteTokenizer, train_bpe
from ecp_lm.generation import generate
from ecp_lm.hf import CACHE_FIELD, EcpLmCache, EcpLmConfig, EcpLmForCausalLM
from ecp_lm.hf.export import export_checkpoint, to_transformers_tokenizer
from ecp_lm.run.checkpoint import save_checkpoint
from ecp_lm.run.config import RunConfig
from helpers import (
    PERCEIVER_FAMILY,
    TINY,
    random_tokens,
    sharp_model,
    write_corpus,
)

N, M = TINY["seq_len"], TINY["seq_len"] // TINY["num_segments"]
BYTES = 256  # vocabulary of the models whose text is decoded

GLOBAL_HYBRID = "sliding_window*2,transformer"
LOCAL_HYBRID = "ecp,block_local,sliding_window"
HYBRIDS: dict[str, dict] = {
    # A global layer: inputs of at most N; generation past N slides the window, recomputing.
    GLOBAL_HYBRID: dict(layer_pattern="sliding_window*2,transformer", n_layers=3),
    # Local layers only: any length, each layer decoding on its own ring (2m, b = 8, w = 13).
    LOCAL_HYBRID: dict(layer_pattern="ecp,block_local,sliding_window", n_layers=3, block_len=8),
    "ecp,s2 rope_base=500": dict(layer_pattern="ecp,s2", rope_base=500.0),
    # The global layers' rotary embedding: none (Llama 4), or a base of their own (Gemma 3).
    "s2,transformer global_rope=none": dict(layer_pattern="s2,transformer", global_rope="none"),
    "ecp,transformer rope_base_global=100": dict(layer_pattern="ecp,transformer",
                                                 rope_base_global=100.0),
}
CASES: dict[str, dict] = {**{arch: dict(arch=arch) for arch in ARCHS},
                          **{name: dict(arch="hybrid", **fields_) for name, fields_ in
                             HYBRIDS.items()},
                          # attention sinks: a cache of w + k slots, through config.json
                          "sliding_window sink_tokens=3": dict(arch="sliding_window",
                                                               sink_tokens=3),
                          # Longformer's windows per layer, dilation and global tokens
                          "longformer per layer": dict(arch="longformer", window="5,9",
                                                       dilation="1,2", global_tokens=2),
                          # Llama's skeleton: RMSNorm, SwiGLU, no biases, through config.json
                          "llama": dict(arch="transformer", norm="rmsnorm", mlp="swiglu",
                                        bias=False),
                          "ecp on llama's skeleton": dict(arch="ecp", norm="rmsnorm",
                                                          mlp="swiglu", bias=False)}
"""Every architecture by its name, and the hybrids by their pattern: ``sharp_model`` keywords."""


def case_model(case: str, **overrides):
    return sharp_model(**{**CASES[case], **overrides})


def write_checkpoint(path, model, tokenizer=None):
    save_checkpoint(path, model.state_dict(), RunConfig(model=model.cfg), tokenizer, None,
                    {"step": 0})
    return path


def cache_of(output):
    """The cache of a model or generate() output (its field's name depends on the version)."""
    return getattr(output, CACHE_FIELD)


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def new_tokens(model) -> int:
    """Well past 3N where the architecture streams (no limit on its inputs); past the window N
    where it slides."""
    return 3 * N + 7 if model.arch.max_len is None else 2 * N


@pytest.mark.parametrize("case", CASES)
def test_export_then_from_pretrained_gives_our_logits(case, tmp_path):
    model = case_model(case)
    files = export_checkpoint(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "hf")
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(files)
    loaded = load(tmp_path / "hf")
    assert isinstance(loaded, EcpLmForCausalLM) and loaded.model.cfg == model.cfg
    with torch.no_grad():
        for length in (N, M + 3, 1):
            tokens = random_tokens(2, length, seed=length)
            ours = model(tokens)  # the last P positions (all but for the perceiver family)
            out = loaded(tokens)
            assert out.logits.size(1) == length
            torch.testing.assert_close(out.logits[:, length - ours.size(1):], ours, atol=1e-6,
                                       rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_labels_give_the_loss_of_model_loss(case):
    model = case_model(case)
    wrapper = EcpLmForCausalLM.from_language_model(model)
    tokens = random_tokens(2, N)
    with torch.no_grad():
        loss = wrapper(tokens, labels=tokens).loss
        torch.testing.assert_close(loss, model.loss(tokens), atol=1e-6, rtol=0)


def test_save_pretrained_round_trip_with_tied_embeddings(tmp_path):
    model = sharp_model("ecp", tie_embeddings=True)
    wrapper = EcpLmForCausalLM.from_language_model(model)
    wrapper.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert loaded.model.head.weight is loaded.model.embed.weight  # tied again, stored once
    assert loaded.config.to_model_config() == model.cfg
    assert loaded.state_dict().keys() == wrapper.state_dict().keys()
    for name, tensor in wrapper.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = random_tokens(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=1e-6, rtol=0)


def test_bfloat16_load_computes_and_decodes_in_bfloat16(tmp_path):
    model = sharp_model("ecp")
    EcpLmForCausalLM.from_language_model(model).save_pretrained(tmp_path)
    loaded = load(tmp_path, torch_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    tokens = random_tokens(2, 20)
    with torch.no_grad():
        logits = loaded(tokens).logits
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits.float(), model(tokens), atol=0.1, rtol=0.05)
        out = loaded.generate(tokens[:, :5], do_sample=False, max_new_tokens=3 * N,
                              return_dict_in_generate=True)
    assert out.sequences.shape == (2, 5 + 3 * N)
    assert all(cache.k.dtype == torch.bfloat16 for cache in cache_of(out).kv)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prompt_len", [1, M + 1, N - 1])
def test_greedy_generate_equals_ecp_lm_generate(case, prompt_len):
    """With transformers' cache (ours inside it) and, for one prompt length, without one."""
    model = case_model(case)
    wrapper = EcpLmForCausalLM.from_language_model(model)
    prompt = random_tokens(2, prompt_len, seed=prompt_len)
    n = new_tokens(model)
    expected = generate(model, prompt, n, temperature=0.0)
    with torch.no_grad():
        cached = wrapper.generate(prompt, do_sample=False, max_new_tokens=n)
        assert torch.equal(cached, expected)
        if prompt_len == M + 1:
            plain = wrapper.generate(prompt, do_sample=False, max_new_tokens=n, use_cache=False)
            assert torch.equal(plain, expected)


@pytest.mark.parametrize(("case", "n_layers", "batch", "capacities"), [
    ("ecp", 3, 1, [2 * M] * 3),
    (LOCAL_HYBRID, None, 2, [2 * M, 8, 13]),  # ecp's 2m, block_local's b, sliding_window's w
    ("longformer per layer", None, 1, [5 + 2, 17 + 2]),  # (w - 1)·d + 1 and g global slots
])
def test_generating_past_3n_keeps_each_layer_s_ring(case, n_layers, batch, capacities):
    """ECP, and a hybrid of local layers each on a ring of its own capacity: 3N + 7 tokens in
    constant cache memory, no tokens kept, every ring full."""
    model = case_model(case, **({} if n_layers is None else {"n_layers": n_layers}))
    wrapper = EcpLmForCausalLM.from_language_model(model)
    sizes = []
    wrapper.register_forward_hook(lambda module, args, out: sizes.append(cache_of(out).nbytes()))
    prompt = random_tokens(batch, 5)
    n = 3 * N + 7
    with torch.no_grad():
        out = wrapper.generate(prompt, do_sample=False, max_new_tokens=n,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, generate(model, prompt, n, temperature=0.0))
    assert len(sizes) == n and len(set(sizes)) == 1  # the bytes never grow
    cache = cache_of(out)
    assert isinstance(cache, EcpLmCache) and cache.get_seq_length() == 5 + n - 1
    assert cache.tokens.numel() == 0  # the rings are everything: no tokens kept
    assert [layer.k.size(2) for layer in cache.kv] == capacities
    assert capacities == [model.arch.layer(i).cache_capacity for i in range(len(capacities))]
    assert all(layer.filled == layer.k.size(2) for layer in cache.kv)


def test_transformer_perceiver_and_global_hybrid_keep_at_most_a_window_of_tokens():
    for case in ("transformer", "double", GLOBAL_HYBRID):
        wrapper = EcpLmForCausalLM.from_language_model(case_model(case))
        with torch.no_grad():
            out = wrapper.generate(random_tokens(2, 5), do_sample=False, max_new_tokens=2 * N,
                                   return_dict_in_generate=True)
        assert cache_of(out).kv is None and cache_of(out).tokens.shape == (2, N)


def test_a_cache_continues_where_it_stopped():
    """Calling forward by hand: the prompt with use_cache=True, then one token at a time
    with the returned cache, gives what ecp_lm.generate gives."""
    for case in ("ecp", "perceiver_ar", LOCAL_HYBRID, GLOBAL_HYBRID):
        model = case_model(case)
        wrapper = EcpLmForCausalLM.from_language_model(model)
        prompt = random_tokens(2, 7)
        expected, expected_logits = generate(model, prompt, 12, return_logits=True)
        with torch.no_grad():
            out = wrapper(prompt, use_cache=True)
            steps = [out.logits[:, -1]]
            for i in range(11):
                out = wrapper(expected[:, 7 + i:8 + i], cache=cache_of(out))
                steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), expected_logits, atol=1e-5, rtol=0)


def test_beam_search_with_the_cache_equals_without():
    for case in ("ecp", "transformer", LOCAL_HYBRID, GLOBAL_HYBRID):
        wrapper = EcpLmForCausalLM.from_language_model(case_model(case))
        prompt = random_tokens(2, 5)
        with torch.no_grad():
            cached = wrapper.generate(prompt, num_beams=3, do_sample=False, max_new_tokens=20)
            plain = wrapper.generate(prompt, num_beams=3, do_sample=False, max_new_tokens=20,
                                     use_cache=False)
        assert torch.equal(cached, plain)


def test_padding_is_refused():
    wrapper = EcpLmForCausalLM.from_language_model(sharp_model("ecp"))
    prompt = random_tokens(2, 6)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="padding"):
        wrapper.generate(prompt, attention_mask=mask, max_new_tokens=3)
    with torch.no_grad():  # an all-ones mask is fine
        wrapper.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_tokenizer_ids_match_ours(kind):
    texts = ["hello world", "naïve café — 日本語 🙂\n\ttabs  and   spaces", "\x00\x7f", " a ",
             "it's 1234"]
    ours = ByteTokenizer() if kind == "bytes" else train_bpe([" ".join(texts) * 20], 300)
    theirs = to_transformers_tokenizer(ours)
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text).tolist(), text
        assert theirs.decode(ids) == ours.decode(ids) == text


@pytest.mark.parametrize(("kind", "case"), [("bytes", "ecp"), ("bpe", "ecp"),
                                            ("bytes", GLOBAL_HYBRID), ("bytes", LOCAL_HYBRID)])
def test_pipeline_generates_offline(kind, case, tmp_path):
    if kind == "bytes":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = train_bpe([write_corpus(tmp_path / "corpus.txt").read_text()], 300)
    model = case_model(case, vocab_size=max(BYTES, tokenizer.vocab_size))
    ckpt = write_checkpoint(tmp_path / "ckpt", model, tokenizer)
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("the model")["input_ids"] == \
        tokenizer.encode("the model").tolist()
    generator = pipeline("text-generation", model=str(tmp_path / "hf"))
    prompt = "the model reads"
    n = new_tokens(model)  # past N (a global layer slides its window) or past 3N
    text = generator(prompt, max_new_tokens=n, do_sample=False)[0]["generated_text"]
    ids = torch.as_tensor(tokenizer.encode(prompt))[None]
    expected = generate(model, ids, n, temperature=0.0)[0, ids.size(1):]
    assert text == prompt + tokenizer.decode(expected)


def test_export_refuses_a_classifier_and_bad_paths(tmp_path, capsys):
    classifier = sharp_model("ecp", num_classes=3)
    ckpt = write_checkpoint(tmp_path / "ckpt", classifier)
    for argv, fragment in [
            (["--ckpt", ckpt, "--out", tmp_path / "hf"], "num_classes=3"),
            (["--ckpt", tmp_path / "missing", "--out", tmp_path / "hf"], "does not exist")]:
        code = main(["export", *map(str, argv)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("ecp: error:"), lines
        assert fragment in lines[0]
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="not a causal language model"):
        EcpLmForCausalLM(EcpLmConfig(num_classes=3))


@pytest.mark.parametrize("keep", [0.005, 0.9], ids=["header", "tensors"])
def test_a_truncated_export_is_one_error_naming_the_file(tmp_path, keep):
    """from_pretrained (ours: EcpLmForCausalLM's, also under trust_remote_code) of an export
    whose model.safetensors was cut short: one ValueError naming the file, not safetensors'
    error from inside transformers."""
    export_checkpoint(write_checkpoint(tmp_path / "ckpt", sharp_model("ecp")), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    with open(weights, "r+b") as f:  # a copy cut short (the export's own version is replaced
        f.truncate(int(keep * weights.stat().st_size))  # atomically, never truncated)
    for remote in (False, True):
        with pytest.raises(ValueError) as caught:
            load(tmp_path / "hf", trust_remote_code=remote)
        message = str(caught.value)
        assert str(weights) in message and "truncated" in message and "\n" not in message


def test_config_maps_model_config_one_to_one():
    cfg = sharp_model("compressed_double").cfg
    config = EcpLmConfig.from_model_config(cfg)
    assert config.to_model_config() == cfg
    assert {k: getattr(config, k) for k in cfg.to_dict()} == cfg.to_dict()
    with pytest.raises(ValueError, match="num_segments=7"):
        EcpLmConfig(seq_len=32, num_segments=7)


def test_config_takes_every_model_config_field_with_its_default():
    """EcpLmConfig names ModelConfig's fields one by one: a field it lacked would be lost on the
    way through config.json (set to its default)."""
    params = inspect.signature(EcpLmConfig.__init__).parameters
    for f in fields(ModelConfig):
        assert f.name in params, f.name
        assert params[f.name].default == f.default, f.name
    cfg = case_model("ecp,transformer rope_base_global=100", rope_base=2000.0).cfg
    assert EcpLmConfig.from_model_config(cfg).to_model_config() == cfg


HYBRID_FIELDS = {"layer_pattern": GLOBAL_HYBRID, "rope_base": "ecp,s2 rope_base=500",
                 "global_rope": "s2,transformer global_rope=none",
                 "rope_base_global": "ecp,transformer rope_base_global=100"}


@pytest.mark.parametrize("field", HYBRID_FIELDS)
def test_each_hybrid_field_goes_through_config_json(field, tmp_path):
    """An exported hybrid loads as the model it is; the same folder with ``field`` dropped from
    config.json (its default) is refused or computes other logits: the field is written, read
    and used."""
    model = case_model(HYBRID_FIELDS[field])
    assert getattr(model.cfg, field) != getattr(ModelConfig(), field)
    export_checkpoint(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    assert data[field] == getattr(model.cfg, field)
    loaded = load(tmp_path / "hf")
    assert loaded.model.cfg == model.cfg
    tokens = random_tokens(2, N)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=1e-6, rtol=0)
    del data[field]
    path.write_text(json.dumps(data))
    if field == "layer_pattern":
        with pytest.raises(ValueError, match="needs a layer_pattern"):
            load(tmp_path / "hf")
        return
    dropped = load(tmp_path / "hf")
    assert getattr(dropped.model.cfg, field) == getattr(ModelConfig(), field)
    with torch.no_grad():
        assert (dropped(tokens).logits - model(tokens)).abs().max() > 1e-3  # atol 1e-6 above


def test_an_export_written_before_the_hybrid_fields_loads_with_their_defaults(tmp_path):
    """config.json of an export without layer_pattern, rope_base, global_rope and
    rope_base_global: the model every export was then (one architecture, RoPE base 10000)."""
    model = sharp_model("ecp")
    export_checkpoint(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    for name in HYBRID_FIELDS:
        del data[name]
    path.write_text(json.dumps(data))
    loaded = load(tmp_path / "hf")
    assert loaded.model.cfg == model.cfg
    tokens = random_tokens(2, N)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=0, rtol=0)


def test_an_export_of_an_earlier_release_names_block_local_s_block_window(tmp_path):
    """config.json of an earlier ``ecp export``: block_local's block as ``window``, no block_len
    or group_len key. It describes the same model as today's names."""
    config = EcpLmConfig(arch="block_local", window=8)
    assert config.to_model_config() == ModelConfig(arch="block_local", block_len=8)
    assert (config.window, config.block_len, config.group_len) == (None, 8, None)
    assert EcpLmConfig(arch="s2", group_len=6, seq_len=60, num_segments=8).to_model_config() \
        == ModelConfig(arch="s2", group_len=6, seq_len=60, num_segments=8)
    model = sharp_model("block_local", block_len=8)
    export_checkpoint(write_checkpoint(tmp_path / "ckpt", model), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data["window"] = data.pop("block_len")
    del data["group_len"]
    path.write_text(json.dumps(data))
    loaded = load(tmp_path / "hf")
    assert loaded.model.cfg == model.cfg and loaded.config.block_len == 8
    tokens = random_tokens(2, N)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), atol=0, rtol=0)


def test_importing_ecp_lm_does_not_import_transformers():
    code = ("import sys, ecp_lm, ecp_lm.cli, ecp_lm.generation\n"
            "from ecp_lm import build_model, ModelConfig\n"
            "build_model(ModelConfig())\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_perceiver_family_logits_cover_every_position():
    """Logits for every position, as a causal LM's (what a harness such as lm-evaluation-harness
    slices): the last l are the model's own over the window, the first l its predictions in
    the window of the first l tokens; logits_to_keep keeps the last of them."""
    x = random_tokens(1, N)
    for arch in PERCEIVER_FAMILY:
        model = sharp_model(arch)
        wrapper = EcpLmForCausalLM.from_language_model(model)
        with torch.no_grad():
            logits = wrapper(x).logits
            own, first = model(x), model(x[:, :N // 2])
            assert logits.shape == (1, N, TINY["vocab_size"]) and own.size(1) == N // 2
            torch.testing.assert_close(logits[:, N // 2:], own)
            torch.testing.assert_close(logits[:, :N // 2], first)
            torch.testing.assert_close(wrapper(x, logits_to_keep=3).logits, own[:, -3:])

"""Model configuration: one validated dataclass for every architecture, presets, YAML.

Notation follows the research (SPEC §1): N = ``seq_len``, l = ``latent_len``, h = N - l,
S = ``num_segments``, m = N / S, p = ``compressed_len``, L = ``n_layers``, w = ``window``,
b = ``block_len``, G = ``group_len``. Each name has one meaning: ``window`` is sliding_window's
alone, and each baseline's size is its own field.

A config is plain data: it holds what the user set, and a size left unset stays ``None``
(``latent_len``, ``compressed_len``, ``window``, ``block_len``, ``group_len``). The sizes that
follow from the others are
derived where they are needed, by ``resolved()``, so ``dataclasses.replace``, a YAML edit or a
preset never carries a value derived from sizes that have since changed. The shared fields are
checked here; each architecture derives and checks its own (``Architecture.defaults`` and
``Architecture.check`` in ``model/archs/``), on the resolved view, when the config is built.
The recurrent mixers' sizes (``mixer_width``, ``state_size``, ``conv_size``, ``chunk_size``) are
such fields of their own too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from ecp_lm.model.archs.base import Architecture

ARCHS: tuple[str, ...] = ("transformer", "perceiver_ar", "double", "compressed_double", "ssplit",
                          "ecp", "sliding_window", "block_local", "s2", "mamba2",
                          "gated_deltanet", "rwkv7", "rwkv4", "mamba", "mlstm", "slstm",
                          "performer", "xlstm", "sparse_transformer", "longformer",
                          "compressive", "routing")
"""The architectures' names, readable without torch; each is one class in ``model/archs/``,
looked up in its ``REGISTRY`` (which holds these, and any architecture registered there)."""

HYBRID = "hybrid"
"""``arch`` of a model whose layers follow ``layer_pattern``, each an architecture of its own."""
STACKS: dict[str, str] = {"xlstm": "mlstm,slstm,mlstm*6"}
"""Named stacks: an ``arch`` whose layers follow ``layer_pattern`` of its own kinds, and the
pattern it takes when none is set (xLSTM[7:1], its sLSTM block second, as xLSTM's code
places it)."""

MAX_VOCAB = 1 << 32
"""The most token ids a model may have: a token cache stores ids as 32-bit unsigned integers."""
ROPE_MODES = ("all", "first", "none")
NORMS = ("layernorm", "rmsnorm")
OPTIONS: dict[str, tuple[str, ...]] = {"forget_gate": ("sigmoid", "exp"),
                                       "sparse_pattern": ("strided", "fixed")}
"""The choices of one architecture's own (``Architecture.options``), each unset by default."""
MLPS = ("gelu", "swiglu")
GLOBAL_ROPE_MODES = ("all", "none")
ATTN_IMPLS = ("auto", "native", "flash", "mask", "flex", "chunked", "fla", "mamba_ssm",
              "mlstm_kernels", "reference")


@dataclass
class ModelConfig:
    """Everything that determines a model's shape and the function it computes."""

    arch: str = "ecp"
    """One of ``transformer``, ``perceiver_ar``, ``double``, ``compressed_double``, ``ssplit``,
    ``ecp``, the local baselines ``sliding_window``, ``block_local``, ``s2``, the recurrent
    mixers ``mamba2``, ``gated_deltanet``, ``rwkv7``, ``rwkv4``, ``mamba``, xLSTM's ``mlstm`` and
    ``slstm`` and their stack ``xlstm``, the ``performer`` (FAVOR+), the
    ``sparse_transformer``, ``longformer``, ``compressive``, ``routing``; or ``hybrid``, whose
    layers follow ``layer_pattern``."""
    vocab_size: int = 256
    """Number of token ids (256 for raw bytes)."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of decoder blocks (L)."""
    n_heads: int = 4
    """Attention heads per block; ``d_model`` must be divisible by it."""
    seq_len: int = 64
    """Training window N. ``ecp`` accepts longer inputs; every other architecture at most N."""
    latent_len: int | None = None
    """Latent length l of the perceiver family (default N/2): the positions that are predicted."""
    num_segments: int = 4
    """S: how many segments a pattern cuts its span into: ``ecp``'s window N, in segments of
    m = N/S, and ``ssplit``'s history, in segments of h/S. The same-cost baselines take their
    default sizes from ECP's m = N/S (``window``, ``block_len``, ``group_len``).
    ``segment_len`` is the segment length (for ``s2``, its group G)."""
    compressed_len: int | None = None
    """p: rows the history is compressed to after layer 0 (``compressed_double``; default h/2)."""
    window: int | str | None = None
    """w: the window of ``sliding_window`` and ``longformer``: each query sees itself and w - 1
    earlier positions (default: the same unmasked score entries as ``ecp`` at this N and S, from
    ECP's m = N/S; about 3m/2). For ``longformer`` also a comma list, one width per layer
    (``'32,64,128,256'``). ``routing``'s: its local heads' window and the keys of its cluster
    a routed query sees at most (default ⌈N/k⌉)."""
    block_len: int | None = None
    """b: ``block_local``'s block, causal attention within blocks of b positions aligned to 0
    (default 2m = 2·N/S from ECP's m, ECP's one-layer reach). Configs saved by an earlier
    release, which called it ``window``, are read with that name."""
    group_len: int | None = None
    """G: ``s2``'s group, causal attention within groups of G positions, half of the heads' shifted
    by G/2; even (default ECP's m = N/S, which then needs N divisible by S)."""
    dilation: int | str | None = None
    """d: ``longformer``'s dilation, one for every layer or a comma list of one per layer
    (default 1): in a layer with d > 1, heads H/2 .. H - 1 see w positions d apart."""
    global_tokens: int = 0
    """g: ``longformer``'s global tokens: positions 0 .. g - 1, which every later query sees
    besides its window (decoding keeps them in g slots of their own). 0 (default): none."""
    memory_len: int | None = None
    """n_m: ``compressive``'s memory, the layer inputs of the previous n_m positions a segment
    attends to besides itself (default m = N/S); its compressed memory has n_m slots too."""
    num_clusters: int | None = None
    """k: ``routing``'s centroids per routed head (default ⌈√N⌉, the paper's)."""
    compression_rate: int | None = None
    """c: ``compressive``'s compression, c evicted positions to a compressed slot (default 4);
    it divides m and ``memory_len``."""
    sink_tokens: int = 0
    """k: attention sinks of ``sliding_window`` (and of a hybrid's sliding_window layers): every
    query at position q also sees positions 0 .. k - 1 (those <= q) besides its window, as in
    StreamingLLM; decoding keeps them in k slots of their own, never evicted. 0 (default): none.
    Below ``window``; refused for a model without sliding_window layers."""
    mixer_width: int | None = None
    """The width of a recurrent mixer's value stream, summed over its heads: ``mamba2``'s and
    ``mamba``'s expanded channels (default 2·d_model, their expand = 2) and ``gated_deltanet``'s
    values (default 2·d_model, its expand_v = 2); a multiple of n_heads for the two with heads.
    ``ecp_lm.model.match_parameters`` sets it so that a model has another architecture's
    parameter count."""
    state_size: int | None = None
    """N: the state per channel of ``mamba2`` (Mamba-2's d_state; default 64) and ``mamba``
    (default 16)."""
    conv_size: int | None = None
    """Taps of the short causal convolution of ``mamba2``, ``mamba``, ``gated_deltanet``,
    ``mlstm`` and ``slstm`` (default 4)."""
    chunk_size: int | None = None
    """Tokens per chunk of a recurrent mixer's chunked kernel (default 64 for ``mamba2`` and
    ``gated_deltanet``, 32 for ``rwkv7``, 8 for ``rwkv4``, 16 for ``mamba`` and ``mlstm``, each kind
    its own in a hybrid; set, every kind's); the results do not depend on it beyond rounding."""
    num_features: int | None = None
    """M: ``performer``'s random features per head (default K·ln K rounded, K = d_model /
    n_heads, the paper's)."""
    feature_redraw: int | None = None
    """``performer``: training steps between two draws of its random features (default 1000);
    evaluation uses the features saved with the model."""
    stride: int | None = None
    """ℓ: ``sparse_transformer``'s stride, its local heads' window and its strided heads' step
    (its fixed pattern's block); default ⌈√N⌉."""
    summary_len: int | None = None
    """c: the last positions of each block that the fixed pattern of ``sparse_transformer``
    lets every later query see (default max(1, ℓ // 16))."""
    forget_gate: str | None = None
    """The forget gates of ``mlstm`` and ``slstm`` (and their stack ``xlstm``): ``sigmoid``
    (unset) or ``exp``, xLSTM's two choices."""
    sparse_pattern: str | None = None
    """``sparse_transformer``'s pattern: ``strided`` (unset) or ``fixed``."""
    ff_mult: int | None = None
    """Feed-forward hidden width as a multiple of ``d_model``; unset: 4 (``gelu``), or 8/3
    rounded up to a multiple of 64 (``swiglu``, Llama's), see ``ff_width``."""
    ff_hidden: int | None = None
    """Feed-forward hidden width in units, over ``ff_mult`` (e.g. the width that gives a model
    another's parameter count, ``model.match_parameters``)."""
    norm: str = "layernorm"
    """The skeleton's norms (each block's two and the last): ``layernorm`` or ``rmsnorm``."""
    mlp: str = "gelu"
    """The skeleton's feed-forward: ``gelu`` (down(gelu(up x))) or ``swiglu``
    (down(silu(gate x) ⊙ up x), Llama's). A layer with a feed-forward of its own (``rwkv4``'s
    channel mix, ``slstm``'s post up-projection) or none (``mlstm``) keeps it."""
    bias: bool = True
    """Biases in the feed-forward's maps and the LayerNorms (the projections of attention and
    of the mixers have none either way)."""
    dropout: float = 0.0
    """Dropout on attention probabilities, the feed-forward and the residual branches."""
    rope: str = "all"
    """Rotary position embedding in every layer (``all``), only layer 0 (``first``), or ``none``."""
    tied_kv: bool = False
    """One projection serves as both keys and values (the authors' code)."""
    tie_embeddings: bool = False
    """The output head shares its weight with the token embedding."""
    attn_impl: str = "auto"
    """The attention kernel, named by what runs: ``auto`` (the fastest exact kernel that can run
    each call), ``native`` (the C++ band kernel: CPU, dropout eagerly only; ecp and the local
    baselines),
    ``flash`` (PyTorch's fused SDPA kernels, no mask tensor: for ecp on the CPU two flash
    calls, over each segment and over its previous segment, merged by log-sum-exp (no dropout),
    elsewhere one lower-right causal call per pair of segments; for the others unmasked or
    causal fused SDPA calls, over the whole window or batched over blocks, segments or groups),
    ``mask`` (SDPA with a small static mask, batched over blocks),
    ``flex`` (FlexAttention; no dropout, backward only on CUDA), or ``reference`` (dense masked
    attention built from the mask predicate). Each architecture has some of native/flash/mask;
    an explicit kernel that cannot run a call raises ValueError. The recurrent mixers have their
    own: ``chunked`` (the chunkwise-parallel form in PyTorch, any device), ``fla``
    (flash-linear-attention's Triton kernels, CUDA, the ``fla`` extra; ``auto`` takes it where it
    is installed, for bf16 and fp16 compute and not under torch.compile), ``mamba_ssm``
    (mamba's selective scan from mamba-ssm's CUDA kernel, the ``mamba`` extra, under the same
    rules), ``mlstm_kernels`` (mlstm's cell from mlstm-kernels' Triton kernels, the ``xlstm``
    extra, under the same rules) and ``reference`` (the token-by-token recurrence); a hybrid
    with recurrent layers takes ``auto`` or ``reference``."""
    num_classes: int | None = None
    """If set, a classification head over the mean final hidden state of the predicted positions
    replaces the language-model head; the model then returns (B, num_classes)."""
    layer_pattern: str | None = None
    """``arch: hybrid``'s layers: a repeating unit of architecture names, each ``name`` or
    ``name*k``, tiled over ``n_layers`` and cut at the end: ``sliding_window*5,transformer``
    (Gemma 3), ``block_local*3,transformer`` (Llama 4), ``ecp*3,transformer``,
    ``mamba2*3,transformer`` (Nemotron-H), ``gated_deltanet*3,transformer`` (Qwen3-Next),
    ``mamba2,sliding_window`` (Samba). A layer may be ``transformer`` (a global layer), a local
    one, ``ecp``, ``sliding_window``, ``block_local``, ``s2``, or a recurrent mixer, ``mamba2``,
    ``gated_deltanet``, ``rwkv7``, ``rwkv4``, ``mamba``, ``mlstm``, ``slstm``, each sized by its
    own fields as in the pure architecture. ``arch: xlstm``'s layers: ``mlstm`` and ``slstm``
    only (unset: ``mlstm,slstm,mlstm*6``, xLSTM[7:1]). Unset (every other arch): every layer is
    ``arch``."""
    rope_base: float = 10000.0
    """RoPE's base θ: layer feature pair i turns by ``pos · θ^(-2i/D)``."""
    global_rope: str | None = None
    """A hybrid's global (transformer) layers: rotated (``all``) or not (``none``, as Llama 4's
    global layers); unset: as ``rope`` says for every layer."""
    rope_base_global: float | None = None
    """RoPE's base in a hybrid's global layers (Gemma 3 uses a larger one there); unset:
    ``rope_base``."""

    def __post_init__(self) -> None:
        architecture(self.arch)  # ValueError naming the architectures for an unknown one
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "num_segments",
                     "ff_mult", "ff_hidden"):
            value = getattr(self, name)
            if name in ("ff_mult", "ff_hidden") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, choices in (("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(choices)}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias={self.bias!r} must be true or false")
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"vocab_size={self.vocab_size:,} is more than {MAX_VOCAB:,} token "
                             f"ids, the most a token cache stores")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.rope not in ROPE_MODES:
            raise ValueError(f"rope={self.rope!r} is not one of {', '.join(ROPE_MODES)}")
        if self.rope != "none" and self.head_dim % 2:
            raise ValueError(f"head dimension d_model/n_heads={self.head_dim} is odd; "
                             f"rotary embeddings (rope={self.rope!r}) need an even one")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} is outside [0, 1)")
        if self.attn_impl == "sdpa":
            raise ValueError("attn_impl='sdpa' was split by the kernel that runs: use 'auto' "
                             "(the fastest), or 'native', 'flash' or 'mask'")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r} is not one of {', '.join(ATTN_IMPLS)}")
        if self.num_classes is not None and (isinstance(self.num_classes, bool)
                                             or not isinstance(self.num_classes, int)
                                             or self.num_classes < 2):
            raise ValueError(f"num_classes={self.num_classes!r} must be an integer >= 2 or None")
        if self.num_classes is not None and self.tie_embeddings:
            raise ValueError(f"tie_embeddings=True needs the language-model head, "
                             f"but num_classes={self.num_classes} replaces it")
        for name in ("latent_len", "compressed_len", *OWN_SIZES):
            value = getattr(self, name)
            if name in LAYER_LISTS and isinstance(value, str):
                continue  # a list per layer: checked by the architectures that take one
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}={value!r} must be an integer")
            if name in OWN_SIZES and value is not None and value < 1:
                raise ValueError(f"{name}={value} must be a positive integer")
        own = architecture(self.arch)
        for old, new in own.renamed.items():
            value = getattr(self, old)
            if value is not None:
                raise ValueError(
                    f"{old}={value}: arch={self.arch!r} calls this size {new} ({old} is "
                    f"{' and '.join(_users(old))}'s); set {new}={value} — configs saved by an "
                    f"earlier release are read with the old name")
        self._check_layers()
        self._check_sinks()
        g = self.global_tokens
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"global_tokens={g!r} must be a non-negative integer")
        if g and "global_tokens" not in own.sizes(self):
            raise ValueError(f"global_tokens={g} is set, but arch={self.arch!r} has no "
                             "longformer layer (global tokens are longformer's); leave "
                             "global_tokens at 0")
        if self.tied_kv and not any(architecture(a).has_keys for a in self.layer_archs):
            raise ValueError(f"tied_kv=True ties attention's keys and values; arch={self.arch!r} "
                             f"has no attention (a recurrent mixer in every layer); leave tied_kv "
                             "false")
        for name, choices in OPTIONS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
            if not any(name in architecture(a).options for a in self.layer_archs):
                users = [a for a in ARCHS if name in architecture(a).options]
                raise ValueError(f"{name}={value!r} is set, but arch={self.arch!r} has no "
                                 f"layer that takes it (only {' and '.join(users)} do); leave "
                                 f"it unset (null)")
        for name in OWN_SIZES:
            value = getattr(self, name)
            if value is not None and name not in own.sizes(self):
                users = _users(name)
                raise ValueError(
                    f"{name}={value} is set, but arch={self.arch!r} has no {name} (only "
                    f"{' and '.join(users)} {'uses' if len(users) == 1 else 'use'} one); leave "
                    f"{name} unset (null)")
        own.check(self.resolved())

    def _check_layers(self) -> None:
        """The hybrid's fields: a pattern exactly where ``arch`` is ``hybrid``, and RoPE bases."""
        if self.arch == HYBRID and self.layer_pattern is None:
            raise ValueError("arch='hybrid' needs a layer_pattern, e.g. "
                             "'sliding_window*5,transformer'")
        if self.layer_pattern is not None:
            if not isinstance(self.layer_pattern, str):
                raise ValueError(f"layer_pattern={self.layer_pattern!r} must be a string of "
                                 "architecture names, e.g. 'ecp*3,transformer'")
            if self.arch != HYBRID and self.arch not in STACKS:
                raise ValueError(f"layer_pattern={self.layer_pattern!r} is set, but "
                                 f"arch={self.arch!r}: a model whose layers follow a pattern "
                                 f"is arch='hybrid' (or a stack: {', '.join(STACKS)})")
            tile_pattern(self.layer_pattern, self.n_layers)  # ValueError for a malformed one
        for name in ("rope_base", "rope_base_global"):
            value = getattr(self, name)
            if value is None and name == "rope_base_global":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 1:
                raise ValueError(f"{name}={value!r} must be a number greater than 1")
        if self.global_rope is not None and self.global_rope not in GLOBAL_ROPE_MODES:
            raise ValueError(f"global_rope={self.global_rope!r} is not one of "
                             f"{', '.join(GLOBAL_ROPE_MODES)} (or unset: as rope)")
        if self.layer_pattern is None:
            for name in ("global_rope", "rope_base_global"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} is for the global layers "
                                     "of a hybrid (arch='hybrid' with a layer_pattern); set "
                                     "rope and rope_base for every layer")

    def _check_sinks(self) -> None:
        """``sink_tokens``: a non-negative integer, set only where a layer has a window (whose
        own check bounds it by the window)."""
        k = self.sink_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"sink_tokens={k!r} must be a non-negative integer")
        if k and not any(architecture(a).takes_sink_tokens for a in self.layer_archs):
            users = [a for a in ARCHS if architecture(a).takes_sink_tokens]
            where = (f"arch={self.arch!r}" if self.layer_pattern is None
                     else f"layer_pattern={self.layer_pattern!r} with n_layers={self.n_layers}")
            raise ValueError(f"sink_tokens={k} is set, but {where} has no layer with a window "
                             f"(sink tokens extend the window of {' and '.join(users)}); leave "
                             "sink_tokens at 0")

    @property
    def layer_unit(self) -> list[str]:
        """The repeating unit of ``layer_archs``: ``layer_pattern``'s names, or ``arch``."""
        pattern = self.layer_pattern or STACKS.get(self.arch)
        return [self.arch] if pattern is None else pattern_unit(pattern)

    @property
    def layer_archs(self) -> list[str]:
        """Each layer's architecture: ``layer_pattern`` tiled over the layers, or ``arch``."""
        pattern = self.layer_pattern or STACKS.get(self.arch)
        if pattern is None:
            return [self.arch] * self.n_layers
        return tile_pattern(pattern, self.n_layers)

    def layer_config(self, arch: str) -> ModelConfig:
        """The config of a pure ``arch`` model with this one's shared fields and the sizes
        ``arch`` has (a hybrid's layer of that architecture computes what that model's layer
        does): the pattern, the global layers' RoPE and other patterns' sizes dropped."""
        kind = architecture(arch)
        own = kind.size_fields
        return dataclasses.replace(
            self, arch=arch, layer_pattern=None, global_rope=None, rope_base_global=None,
            sink_tokens=self.sink_tokens if kind.takes_sink_tokens else 0,
            global_tokens=self.global_tokens if "global_tokens" in own else 0,
            tied_kv=self.tied_kv and kind.has_keys,
            **{name: getattr(self, name) if name in kind.options else None
               for name in OPTIONS},
            **{name: None for name in OWN_SIZES if name not in own})

    # Derived sizes -------------------------------------------------------------------------
    def resolved(self) -> ModelConfig:
        """This config with every unset size derived from the others: ``latent_len`` N/2 (the
        perceiver family's latents, and the l of every architecture's default evaluation
        stride, SPEC §6), and the architecture's own (``Architecture.defaults``: sliding_window's
        window, block_local's block_len, s2's group_len, compressed_double's p). A new config
        each call; the config itself is left as the user set it."""
        filled = {} if self.latent_len is not None else {"latent_len": self.default_latent_len}
        filled.update((name, value) for name, value in
                      architecture(self.arch).defaults(self).items()
                      if getattr(self, name) is None)
        return dataclasses.replace(self, **filled) if filled else self

    @property
    def default_latent_len(self) -> int:
        return max(1, self.seq_len // 2)

    @property
    def ff_width(self) -> int:
        """The feed-forward's hidden width: ``ff_hidden`` where set, else ``ff_mult``·d_model
        where set, else 4·d_model (``gelu``) or 8/3·d_model rounded up to a multiple of 64
        (``swiglu``)."""
        if self.ff_hidden is not None:
            return self.ff_hidden
        if self.ff_mult is not None:
            return self.ff_mult * self.d_model
        if self.mlp == "swiglu":
            return 64 * math.ceil(8 * self.d_model / 3 / 64)
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def history_len(self) -> int:
        """h = N - l (meaningful for the perceiver family), with l resolved."""
        latent = self.latent_len if self.latent_len is not None else self.default_latent_len
        return self.seq_len - latent

    @property
    def segment_len(self) -> int:
        """The length of the pattern's segments: m = N / S for ecp (and the architectures
        without segments), G for s2 (its group, the period of its pattern), h / S, the history
        segment, for s-Split."""
        return architecture(self.arch).segment_length(self)

    # Serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """A config as written now (a user's file, the Python API): a size set under a name its
        architecture has since renamed is refused, with the new name (``from_saved`` reads
        what an earlier release saved)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> ModelConfig:
        """The config that a model section saved by this or an earlier release describes
        (a run's or a checkpoint's ``config.yaml``, an export's ``config.json``): the old names
        of renamed sizes are read as the new ones (``saved_fields``)."""
        return cls.from_dict(saved_fields(data))

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_yaml_mapping(path, None, "a mapping of ModelConfig fields"))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``) with field overrides, e.g. ``arch="double"``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


def read_yaml_mapping(path: str | Path, setting: str | None, expected: str) -> dict[str, Any]:
    """The mapping that the YAML file ``path`` holds, else a one-line ValueError naming the file
    (after ``setting``, the option or key that gave it, if any): missing, unreadable, not
    UTF-8, not valid YAML (where), or not a mapping (``expected`` says what it should hold)."""
    path = Path(path)
    name = f"{setting} {path}" if setting else str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{name} is a folder, not a YAML file") from None
    except OSError as err:
        raise ValueError(f"{name}: cannot read it ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not a UTF-8 YAML file (byte {err.start}: "
                         f"{raw[err.start:err.start + 1]!r})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{name} is not valid YAML: {yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected {expected}, got {type(data).__name__}")
    return data


def yaml_problem(err: yaml.YAMLError) -> str:
    """What is wrong in a YAML text and where (line, column), in one line."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(err, "problem", None) or getattr(err, "reason", None) or str(err)
    return " ".join(f"{problem}{where}".split())


def tile_pattern(pattern: str, n_layers: int) -> list[str]:
    """``layer_pattern``'s unit (``pattern_unit``) repeated over ``n_layers``, cut at the end."""
    unit = pattern_unit(pattern)
    return (unit * -(-n_layers // len(unit)))[:n_layers]


MAX_REPEAT = 1024
"""The largest count ``name*k`` a layer pattern takes: far above any depth, and checked before
the unit is built."""


def pattern_unit(pattern: str) -> list[str]:
    """The layers of ``layer_pattern``'s unit, ``a*k,b,...``, one name each (ValueError naming
    what is malformed; a count is ASCII digits, 1 .. ``MAX_REPEAT``). Which names may be layers
    the hybrid architecture checks."""
    unit: list[str] = []
    for part in pattern.split(","):
        name, star, count = (s.strip() for s in part.partition("*"))
        if not name:
            raise ValueError(f"layer_pattern={pattern!r} has an empty entry; write names "
                             "separated by commas, e.g. 'sliding_window*5,transformer'")
        if name not in ARCHS:
            raise ValueError(f"layer_pattern={pattern!r} names {name!r}, which is not an "
                             f"architecture ({', '.join(ARCHS)})")
        if star and not (count.isascii() and count.isdigit() and count.strip("0")):
            raise ValueError(f"layer_pattern={_short(pattern)!r}: {_short(part.strip())!r} "
                             f"repeats its layer by {_short(count)!r}, which is not a positive "
                             f"integer (ASCII digits)")
        # the digits are counted before any number is made of them
        if star and (len(count.lstrip("0")) > len(str(MAX_REPEAT)) or int(count) > MAX_REPEAT):
            raise ValueError(f"layer_pattern={_short(pattern)!r}: {_short(part.strip())!r} "
                             f"repeats its layer {_short(count)} times, more than {MAX_REPEAT}")
        unit += [name] * (int(count) if star else 1)
    return unit


def _short(text: str, most: int = 60) -> str:
    """``text``, or its start and an ellipsis where it is longer than ``most`` characters: a
    message stays one readable line."""
    return text if len(text) <= most else f"{text[:most]}…"


OWN_SIZES: tuple[str, ...] = ("window", "block_len", "group_len", "mixer_width", "state_size",
                               "conv_size", "chunk_size", "num_features", "feature_redraw",
                               "stride", "summary_len", "dilation", "memory_len",
                               "compression_rate", "num_clusters")
"""The sizes that belong to one pattern each: refused for an architecture whose
``size_fields`` do not hold them."""
LAYER_LISTS: tuple[str, ...] = ("window", "dilation")
"""The sizes ``longformer`` also takes as a comma list, one per layer."""


def saved_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A saved model section's fields with the names an earlier release used for them
    rewritten to today's (each architecture's ``renamed``, e.g. block_local's ``window`` is
    its ``block_len``); other fields, and data that is not such a section, as they are. What
    is left is checked by ``ModelConfig.from_dict``: an old name set beside its new one is
    refused there."""
    if not isinstance(data, dict):
        return data
    try:
        own = architecture(data.get("arch", ModelConfig.arch))
    except (ValueError, TypeError):  # an unknown arch: from_dict names it
        return data
    data = dict(data)
    for old, new in own.renamed.items():
        if old in data and data.get(new) is None:
            value = data.pop(old)
            if value is not None:
                data[new] = value
    return data


def _users(name: str) -> list[str]:
    """The architectures whose size fields hold ``name``."""
    return [a for a in ARCHS if name in architecture(a).size_fields]


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds-fast models for tests: N = 64, m = 16, l = 32.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=64, num_segments=4),
    # A byte-level model that trains for a few minutes on a laptop CPU.
    "small": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=256,
                  num_segments=8),
    # The research's scale: ECP d_model 768, 12 layers, 6 heads, N 2048, S 8 (GPT-2 vocabulary);
    # every baseline is built at the same size by overriding ``arch``.
    "paper": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=6, seq_len=2048,
                  num_segments=8),
    # Llama's skeleton at the paper's size: full attention with RoPE, RMSNorm, SwiGLU (8/3·d
    # rounded up to 64), no biases; ``arch`` overrides the attention, the skeleton stays.
    "llama": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=6, seq_len=2048,
                  num_segments=8, arch="transformer", norm="rmsnorm", mlp="swiglu",
                  bias=False),
}


def architecture(name: str) -> type[Architecture]:
    """The class of architecture ``name``, imported (with torch) on first use: this module stays
    plain data, and the architectures' own defaults and checks live with them."""
    from ecp_lm.model.archs import architecture as lookup

    return lookup(name)

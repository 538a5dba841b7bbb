"""What a training run optimises: next-token prediction on a token cache, or classification of
pixel sequences. A task owns its data, its batches (a pure function of the step index), its loss
on the positions each architecture predicts (SPEC §3), and its validation."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ecp_lm.data.batches import EpochSampler, TrainWindows
from ecp_lm.data.cache import open_run_cache
from ecp_lm.data.images import PIXEL_DATASETS, PixelSequences, load_pixel_dataset
from ecp_lm.data.tokenizers import Tokenizer
from ecp_lm.evaluate.scoring import (
    ScoredText,
    check_stride,
    classify,
    default_stride,
    lm_report,
    score_stream,
    scored_text,
)
from ecp_lm.model.archs import architecture
from ecp_lm.run.config import RunConfig
from ecp_lm.training.distributed import Dist


class LanguageModelling:
    kind = "lm"

    def __init__(self, cfg: RunConfig, dist: Dist, progress: bool = True):
        model, train = cfg.model, cfg.train
        self.cache = open_run_cache(cfg.data, cfg.model.vocab_size, dist.is_main, dist.barrier,
                                    progress)
        self.tokenizer: Tokenizer | None = self.cache.tokenizer()
        self.windows = TrainWindows(self.cache.tokens("train"), model.seq_len, train.batch_size,
                                    train.seed, dist.data_rank, dist.data_size)
        self.context, self.shards = dist.context, dist.context_size
        self.seq_len = model.seq_len
        self.num_predicted = architecture(model.arch)(model).num_predicted(model.seq_len)
        self.stride = default_stride(model.seq_len, model.resolved().latent_len)
        check_stride(self.stride, model.seq_len, self.num_predicted, model.arch)
        valid = self.cache.tokens("valid")
        self.valid = valid[:train.eval_max_tokens] if train.eval_max_tokens else valid
        if len(self.valid) < model.seq_len + 1:  # found now, not after the first steps
            limit = f" (train.eval_max_tokens={train.eval_max_tokens})" \
                if train.eval_max_tokens else ""
            raise ValueError(f"the validation split has {len(self.valid)} tokens{limit}, fewer "
                             f"than one evaluation window of seq_len+1={model.seq_len + 1}")
        self.valid_text = scored_text(self.cache, "valid", self.seq_len - self.stride + 1,
                                      len(self.valid))
        self.train_slice = None
        if train.eval_train_tokens:
            self.train_slice = self.cache.tokens("train")[:train.eval_train_tokens]
            if len(self.train_slice) < model.seq_len + 1:
                raise ValueError(f"train.eval_train_tokens={train.eval_train_tokens} is fewer "
                                 f"than one evaluation window of seq_len+1={model.seq_len + 1}")
            self.train_text = scored_text(self.cache, "train", self.seq_len - self.stride + 1,
                                          len(self.train_slice))
        self.eval_batch_size = train.eval_batch_size
        self.tokens_per_batch = train.batch_size * model.seq_len  # input tokens

    def batch(self, index: int) -> Tensor:
        return self.windows.batch(index)

    def targets_per_batch(self, batch: Tensor) -> int:
        """Targets this rank scores: with context parallelism, its shard's."""
        return batch.size(0) * self.num_predicted // self.shards

    def loss_sum(self, net: nn.Module, batch: Tensor) -> Tensor:
        """Summed next-token cross-entropy over the predicted positions (with context
        parallelism, over this rank's shard of each window), through ``net``'s forward (DDP's
        and FSDP's hooks) and without the logits of the whole batch (``LanguageModel.forward``
        with targets)."""
        if self.context is None:
            return net(batch[:, :-1], targets=batch[:, 1:], reduction="sum")
        shard, start_pos = self.context.shard(batch)
        return net(shard[:, :-1], start_pos, self.context, targets=shard[:, 1:],
                   reduction="sum")

    def validate(self, model: nn.Module, dist: Dist, autocast: AbstractContextManager | None,
                 stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        def score(tokens: np.ndarray, text: ScoredText) -> dict[str, Any]:
            nll, count = score_stream(model, tokens, self.seq_len, self.stride,
                                      self.eval_batch_size, dist.device, autocast, dist.rank,
                                      dist.world_size, stop=stop)
            return lm_report(nll, count, text)

        report = score(self.valid, self.valid_text)
        out = {k: report[k] for k in ("loss", "bits_per_byte", "ppl_token", "ppl_word")}
        if self.train_slice is not None:
            train = score(self.train_slice, self.train_text)
            out.update(train_loss=train["loss"], train_bits_per_byte=train["bits_per_byte"])
        return out


class Classification:
    kind = "classification"

    def __init__(self, cfg: RunConfig, dist: Dist, progress: bool = True):
        if dist.context is not None:
            raise ValueError(f"train.context_parallel={dist.context.size} splits the windows of "
                             f"next-token prediction; sequence classification "
                             f"(data.source={cfg.data.source}) has no context-parallel form")
        model, train = cfg.model, cfg.train
        if train.eval_train_tokens:
            raise ValueError(f"train.eval_train_tokens={train.eval_train_tokens} scores a "
                             f"token stream; sequence classification (data.source="
                             f"{cfg.data.source}) has none")
        self.data: PixelSequences = load_pixel_dataset(cfg.data.source, cfg.data.path,
                                                       seed=train.seed)
        if model.num_classes != self.data.num_classes:
            raise ValueError(f"data.source={cfg.data.source} has {self.data.num_classes} "
                             f"classes: set model.num_classes={self.data.num_classes}")
        if model.seq_len != self.data.seq_len or model.vocab_size < self.data.vocab_size:
            raise ValueError(f"{cfg.data.source} sequences are {self.data.seq_len} tokens of "
                             f"{self.data.vocab_size} levels: set model.seq_len="
                             f"{self.data.seq_len} and model.vocab_size >= "
                             f"{self.data.vocab_size}")
        self.tokenizer = None
        self.x, self.y = self.data.splits["train"]
        self.sampler = EpochSampler(len(self.y), train.batch_size, train.seed, dist.rank,
                                    dist.world_size)
        self.eval_batch_size = train.eval_batch_size
        self.tokens_per_batch = train.batch_size * model.seq_len

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        _, items = self.sampler.indices(index)
        return (torch.from_numpy(self.x[items].astype(np.int64)),
                torch.from_numpy(self.y[items].astype(np.int64)))

    def targets_per_batch(self, batch: tuple[Tensor, Tensor]) -> int:
        return batch[1].numel()

    def loss_sum(self, net: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(net(batch[0]).float(), batch[1], reduction="sum")

    def validate(self, model: nn.Module, dist: Dist, autocast: AbstractContextManager | None,
                 stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        x, y = self.data.splits["valid"]  # a few seconds: not abandoned midway
        return classify(model, x, y, self.eval_batch_size, dist.device, autocast)


def make_task(cfg: RunConfig, dist: Dist, progress: bool = True):
    if cfg.model.num_classes is not None and cfg.data.source not in PIXEL_DATASETS:
        raise ValueError(f"model.num_classes={cfg.model.num_classes} sets a classification head, "
                         f"but data.source={cfg.data.source} is a text source (classification: "
                         f"{', '.join(PIXEL_DATASETS)}); leave model.num_classes unset (null) "
                         f"to model text")
    task = Classification if cfg.data.source in PIXEL_DATASETS else LanguageModelling
    return task(cfg, dist, progress)

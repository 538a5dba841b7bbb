"""Context parallelism against one process: a window split across K gloo ranks, each exchanging a
one-period halo of keys and values with its neighbours per layer, gives each rank the matching
slice of the one-process logits, the same loss, and (averaged over the ranks) every parameter's
gradient; two data-parallel by two context-parallel ranks equal one process on the combined
batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from ecp_lm.model.context_parallel import ContextGroup, average_gradients
from ecp_lm.model.loss import next_token_loss
from ecp_lm.run.checkpoint import read_checkpoint
from ecp_lm.training.loop import train
from helpers import free_port, random_tokens, sharp_model, tiny_run_config

BATCH, STEPS = 2, 3
# name: (arch, ModelConfig overrides, T). TINY: N = 32, m = 8; sliding_window w = 13 (a halo
# of 12, so shards of at least 12 positions); block_local b = 16; s2 groups of 8.
CASES = {
    "ecp": ("ecp", {}, 32),
    "ecp-longer-than-seq_len": ("ecp", {}, 64),
    "ecp-tied_kv": ("ecp", {"tied_kv": True}, 32),
    "ecp-rope-first": ("ecp", {"rope": "first"}, 32),
    "ecp-rope-none-tied_kv": ("ecp", {"rope": "none", "tied_kv": True}, 32),
    "ecp-reference": ("ecp", {"attn_impl": "reference"}, 32),
    "ecp-mask": ("ecp", {"attn_impl": "mask"}, 32),
    "ecp-flash": ("ecp", {"attn_impl": "flash"}, 32),
    "sliding_window": ("sliding_window", {}, 64),
    "block_local": ("block_local", {}, 64),
    "s2": ("s2", {}, 32),
    # Each layer exchanges its own halo (12, 8, 8, 0); the shards start every layer's period.
    "hybrid-local": ("hybrid", {"layer_pattern": "sliding_window,ecp,s2,block_local",
                                "n_layers": 4}, 64),
}
GRAD_TOL = dict(atol=1e-5, rtol=1e-5)


def run_case(name: str, context: ContextGroup, data_index: int = 0, data_size: int = 1):
    """This rank's logits, the window's loss and the averaged gradients of one case; with data
    parallelism each context group takes its own rows of the batch."""
    arch, overrides, t = CASES[name]
    model = sharp_model(arch, **overrides)
    tokens = random_tokens(BATCH * data_size, t + 1).chunk(data_size)[data_index]
    shard, start = context.shard(tokens)
    logits = model(shard[:, :-1], start, context)
    loss = next_token_loss(logits, shard)
    loss.backward()
    average_gradients(model)  # over every rank: the context group, and the data groups if any
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"logits": logits.detach(), "loss": total / dist.get_world_size(),
            "grads": {k: p.grad for k, p in model.named_parameters()}}


def train_config(tmp_path, batch_size: int, context_parallel: int = 1):
    return tiny_run_config(tmp_path, "ecp", ["train.device=cpu",
                                             f"train.context_parallel={context_parallel}"],
                           steps=STEPS, batch_size=batch_size, eval_max_tokens=600)


def worker(rank: int, world: int, port: int, tmp_path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Training: context groups of two ranks; with four ranks, two data-parallel groups.
    result = train(train_config(tmp_path, BATCH, context_parallel=2), tmp_path / "run",
                   progress=False)
    trained = {k: v.clone() for k, v in result.model.state_dict().items()}
    context = ContextGroup.of()
    report = {name: run_case(name, context) for name in CASES}
    if world == 4:  # a 2-D mesh: data x context, two by two
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "context"))
        context = ContextGroup.of(mesh.get_group("context"))
        data_index = mesh.get_local_rank("data")
        report["data-2x-context-2"] = run_case("ecp", context, data_index, data_size=2)
        report["data-2x-context-2"]["context"] = (context.ranks, context.index)
    report["trained"] = trained
    torch.save(report, tmp_path / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["K=2", "K=4"])
def ranks(request, tmp_path_factory):
    world = request.param
    tmp_path = tmp_path_factory.mktemp(f"context{world}")
    tiny_run_config(tmp_path)  # writes the corpus once, before the workers start
    mp.spawn(worker, args=(world, free_port(), tmp_path), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for report in ranks:
        report["tmp_path"] = tmp_path
    return ranks


def single_process(name: str, batch: int = BATCH):
    arch, overrides, t = CASES[name]
    model = sharp_model(arch, **overrides)
    tokens = random_tokens(batch, t + 1)
    logits = model(tokens[:, :-1])
    loss = next_token_loss(logits, tokens)
    loss.backward()
    return logits.detach(), loss.detach(), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", CASES)
def test_shards_equal_one_process(ranks, name):
    logits, loss, grads = single_process(name)
    shards = logits.chunk(len(ranks), dim=1)
    for rank, report in enumerate(ranks):
        got = report[name]
        torch.testing.assert_close(got["logits"], shards[rank], **GRAD_TOL)
        torch.testing.assert_close(got["loss"], loss, **GRAD_TOL)
        for key, grad in grads.items():
            torch.testing.assert_close(got["grads"][key], grad, **GRAD_TOL, msg=key)


def test_data_and_context_parallel_equal_one_process_on_the_combined_batch(ranks):
    if len(ranks) != 4:
        pytest.skip("the 2 x 2 mesh runs on four ranks")
    logits, loss, grads = single_process("ecp", batch=2 * BATCH)
    for rank, report in enumerate(ranks):
        got = report["data-2x-context-2"]
        group, index = got["context"]
        assert len(group) == 2 and index == group.index(rank)
        data_index = rank // 2  # the mesh is row-major: ranks 0, 1 share data row 0
        expected = logits.chunk(2)[data_index].chunk(2, dim=1)[index]
        torch.testing.assert_close(got["logits"], expected, **GRAD_TOL)
        torch.testing.assert_close(got["loss"], loss, **GRAD_TOL)
        for key, grad in grads.items():
            torch.testing.assert_close(got["grads"][key], grad, **GRAD_TOL, msg=key)


def test_training_equals_one_process_on_the_combined_batch(ranks):
    """torchrun with train.context_parallel=2: two ranks share each window; with four, two
    data-parallel groups of two take a batch each. The weights after a few steps equal one
    process's on the combined batch, and the checkpoint (rank 0's) loads without context
    parallelism."""
    tmp_path, data_size = ranks[0]["tmp_path"], len(ranks) // 2
    single = train(train_config(tmp_path, BATCH * data_size), tmp_path / "single",
                   progress=False)
    # AdamW divides by the gradient's running norm: where a gradient is near zero, rounding
    # (sums in another order across four ranks) moves a weight by up to ~1e-5 in three steps;
    # a wrong shard or halo moves nearly every weight by about lr = 1e-3.
    for report in ranks:
        for key, tensor in single.model.state_dict().items():
            torch.testing.assert_close(report["trained"][key], tensor, atol=5e-5, rtol=1e-5,
                                       msg=key)
    saved = read_checkpoint(tmp_path / "run" / "latest")
    assert saved.meta["step"] == STEPS and saved.meta["tokens_seen"] == single.tokens_seen
    for key, tensor in saved.load_model().state_dict().items():
        assert torch.equal(tensor, ranks[0]["trained"][key]), key


def test_training_refuses_what_it_cannot_split(tmp_path):
    with pytest.raises(ValueError, match="context_parallel=2 does not divide the world size 1"):
        train(train_config(tmp_path, BATCH, context_parallel=2), tmp_path / "run")
    cfg = tiny_run_config(tmp_path, "transformer",
                          ["train.device=cpu", "train.context_parallel=2"])
    with pytest.raises(ValueError, match="arch='transformer' has no context-parallel form"):
        train(cfg, tmp_path / "transformer")
    with pytest.raises(ValueError, match="train.context_parallel=0 must be >= 1"):
        tiny_run_config(tmp_path, "ecp", ["train.context_parallel=0"])


# Errors: found before any message is sent, so one process can see them --------------------------

def test_window_not_a_multiple_of_k_segments_is_refused():
    model = sharp_model("ecp")
    context = ContextGroup(ranks=(0, 1), index=0)
    tokens = random_tokens(1, 41)  # T = 40, K = 2, m = 8: shards of 20, not whole segments
    with pytest.raises(ValueError, match=r"T=40 .*K\*segment_len=16.*K=2.*segment_len=8"):
        model.loss(tokens, context)


def test_architecture_without_a_halo_is_refused():
    model = sharp_model("transformer")
    for index in (0, 1):
        with pytest.raises(ValueError, match="arch='transformer' has no context-parallel form"):
            model.loss(random_tokens(1, 33), ContextGroup(ranks=(0, 1), index=index))


def test_hybrid_with_a_global_layer_is_refused():
    model = sharp_model("hybrid", layer_pattern="ecp,transformer")
    with pytest.raises(ValueError, match=r"layer_pattern='ecp,transformer', its transformer "
                                         r"layers: arch='transformer' has no context-parallel"):
        model.loss(random_tokens(1, 33), ContextGroup(ranks=(0, 1), index=0))


def test_shard_shorter_than_the_halo_is_refused():
    model = sharp_model("sliding_window")  # w = 13: a halo of 12 positions
    with pytest.raises(ValueError, match="needs the last 12 positions before a shard"):
        model.loss(random_tokens(1, 33), ContextGroup(ranks=(0, 1, 2, 3), index=0))


def test_halo_lengths():
    assert sharp_model("ecp").arch.halo_len == 8  # one segment
    assert sharp_model("sliding_window").arch.halo_len == 12  # w - 1
    assert sharp_model("block_local").arch.halo_len == 0  # nothing crosses a block
    assert sharp_model("s2").arch.halo_len == 8  # half a group, rounded up to whole groups
    assert sharp_model("transformer").arch.halo_len is None
    hybrid = sharp_model("hybrid", layer_pattern="sliding_window,ecp,block_local", n_layers=3)
    assert [block.attn.arch.halo_len for block in hybrid.blocks] == [12, 8, 0]

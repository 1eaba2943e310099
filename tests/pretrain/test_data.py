"""ShardDataset and ShardLoader on real Arrow shard sets: zero-copy rows, checks, exact and elastic resume.

    .venv/bin/python -m pytest tests/pretrain/test_data.py -q
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.common import UserError, atomic_write_json
from pipeline.shard_format import MANIFEST_NAME
from pipeline.synthetic_shards import write_shard_set
from pretrain.data.dataset import ShardDataset
from pretrain.data.loader import make_loader

SHARD_ROWS = [13, 7, 20]  # 40 examples, uneven shards
GLOBAL_BATCH, MICRO_BATCH, SEED = 8, 2, 11
ACCUM = GLOBAL_BATCH // MICRO_BATCH  # micro-batches per global batch at world size 1
PER_EPOCH = sum(SHARD_ROWS) // GLOBAL_BATCH  # 5 global batches per epoch
TOTAL = 12  # global batches in the reference run (2.4 epochs)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "set"
    write_shard_set(out, shard_rows=SHARD_ROWS, input_length=8, target_length=4, seed=0, batches_per_shard=2)
    return out


@pytest.fixture(scope="module")
def dataset(shard_dir) -> ShardDataset:
    return ShardDataset(shard_dir)


def ids(batch) -> list[int]:
    """The global row ids of a micro-batch (write_shard_set puts them in column 0), checked against the labels."""
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 0], batch["labels"][:, 0])
    return batch["input_ids"][:, 0].tolist()


def consume(loader, micro_batches: int) -> list[list[int]]:
    iterator = iter(loader)
    return [ids(next(iterator)) for _ in range(micro_batches)]


@pytest.fixture(scope="module")
def reference(dataset) -> list[list[int]]:
    """Micro-batches of an uninterrupted run of TOTAL global batches (no workers)."""
    return consume(make_loader(dataset, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seed=SEED),
                   TOTAL * ACCUM)


# -- ShardDataset ---------------------------------------------------------------------------------------------

def test_rows_are_zero_copy_views_of_the_mapped_shards(dataset, shard_dir):
    assert len(dataset) == 40 and (dataset.input_length, dataset.target_length) == (8, 4)
    assert [int(dataset[i]["input_ids"][0]) for i in range(40)] == list(range(40))
    row0, row1 = dataset[0]["input_ids"], dataset[1]["input_ids"]
    assert row0.dtype == np.int32 and not row0.flags.owndata and not row0.flags.writeable
    # consecutive rows of one record batch are adjacent in the one mapped buffer
    assert row1.__array_interface__["data"][0] - row0.__array_interface__["data"][0] == 8 * 4
    with pytest.raises(IndexError):
        dataset[40]


def test_rows_match_what_huggingface_datasets_reads(dataset, shard_dir):
    import datasets

    hf = datasets.concatenate_datasets([datasets.Dataset.from_file(str(p))
                                        for p in sorted((shard_dir / "data").glob("*.arrow"))])
    hf_inputs = np.array(hf.with_format("numpy")["input_ids"])
    hf_labels = np.array(hf.with_format("numpy")["labels"])
    inputs, labels = dataset.get_batch(np.arange(40))
    assert np.array_equal(inputs, hf_inputs) and np.array_equal(labels, hf_labels)


def test_get_batch_equals_row_by_row_in_the_given_order(dataset):
    order = np.random.default_rng(0).permutation(40)[:17]
    inputs, labels = dataset.get_batch(order, dtype=np.int64)
    assert inputs.dtype == np.int64 and inputs.shape == (17, 8) and labels.shape == (17, 4)
    assert np.array_equal(inputs, np.stack([dataset[i]["input_ids"] for i in order]))
    assert np.array_equal(labels, np.stack([dataset[i]["labels"] for i in order]))
    empty_inputs, empty_labels = dataset.get_batch([])
    assert empty_inputs.shape == (0, 8) and empty_labels.shape == (0, 4)
    with pytest.raises(IndexError):
        dataset.get_batch([0, 40])


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # read-only map views; stack copies
def test_a_plain_dataloader_reads_it_too(dataset):
    first = next(iter(torch.utils.data.DataLoader(dataset, batch_size=6, shuffle=False)))
    assert first["input_ids"][:, 0].tolist() == list(range(6)) and first["labels"].shape == (6, 4)


def test_pickles_without_its_maps_and_reopens_them(dataset):
    dataset[0]
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._mapped == {}
    assert np.array_equal(clone.get_batch([5, 30])[0], dataset.get_batch([5, 30])[0])


def test_checks_what_the_caller_expects(shard_dir):
    ShardDataset(shard_dir, input_length=8, target_length=4)
    with pytest.raises(UserError, match=r"input_length 8, the run expects 512.*--input-length 512"):
        ShardDataset(shard_dir, input_length=512)
    with pytest.raises(UserError, match="target_length 4, the run expects 114"):
        ShardDataset(shard_dir, target_length=114)


def rewrite_manifest(out_dir: Path, manifest: dict) -> None:
    """Replace a set's manifest as it is, unchecked (the damage tests corrupt one field)."""
    atomic_write_json(out_dir / MANIFEST_NAME, manifest)


def damage_missing(path: Path, manifest: dict):
    path.unlink()


def damage_truncated(path: Path, manifest: dict):
    path.write_bytes(path.read_bytes()[:-10])


def damage_rows(path: Path, manifest: dict):
    manifest["shards"][1]["rows"] += 1


def damage_version(path: Path, manifest: dict):
    manifest["format_version"] = 99


def damage_entry(path: Path, manifest: dict):
    del manifest["shards"][1]["rows"]  # was a KeyError in `pretrain --data`


@pytest.mark.parametrize("damage, message", [
    (damage_missing, "part-00000-0001.arrow: shard listed in .* is missing"),
    (damage_truncated, "part-00000-0001.arrow: .* bytes, the manifest says"),
    (damage_rows, "part-00000-0001.arrow: 7 rows, the manifest says 8"),
    (damage_version, "shard format version 99"),
    (damage_entry, r"manifest.json: shard entry 1 lacks 'rows' .*; rebuild the shard set with `prep corpus"),
])
def test_a_damaged_set_fails_with_one_clear_message(tmp_path, damage, message):
    out = tmp_path / "set"
    manifest = write_shard_set(out, shard_rows=[5, 7, 3])
    damage(out / "data" / "part-00000-0001.arrow", manifest)
    rewrite_manifest(out, manifest)
    with pytest.raises(UserError, match=message):
        ShardDataset(out)[0]


def test_verify_recomputes_checksums(tmp_path):
    out = tmp_path / "set"
    write_shard_set(out, shard_rows=[5, 7])
    shard = out / "data" / "part-00000-0000.arrow"
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 0xFF  # same size, different bytes: only a checksum sees it
    shard.write_bytes(bytes(raw))
    ShardDataset(out)
    with pytest.raises(UserError, match="part-00000-0000.arrow: sha256 does not match"):
        ShardDataset(out, verify=True)


def test_missing_manifest_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="no manifest; run `prep corpus"):
        ShardDataset(tmp_path)


# -- ShardLoader --------------------------------------------------------------------------------------------

def test_workers_do_not_change_the_batches_nor_touch_global_rng(dataset, reference):
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    with make_loader(dataset, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seed=SEED,
                     num_workers=2, prefetch_factor=2, persistent_workers=True) as loader:
        assert consume(loader, TOTAL * ACCUM) == reference
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.random.get_state()[1].tolist() == numpy_state[1].tolist()
    for epoch in range(2):  # every epoch serves each kept sample exactly once
        served = sum(reference[epoch * PER_EPOCH * ACCUM:(epoch + 1) * PER_EPOCH * ACCUM], [])
        assert len(served) == len(set(served)) == PER_EPOCH * GLOBAL_BATCH


@pytest.mark.filterwarnings("ignore:.*pin_memory.*")  # CPU-only machine: torch warns and leaves tensors unpinned
def test_pinned_memory_batches(dataset, reference):
    loader = make_loader(dataset, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seed=SEED,
                         pin_memory=True)
    batch = next(iter(loader))
    assert ids(batch) == reference[0]
    assert batch["input_ids"].is_pinned() == torch.cuda.is_available()


def expected_state(global_batches_done: int) -> dict:
    """The loader stays in an epoch until the consumer asks for the next one's first batch."""
    if global_batches_done == 0:
        return {"seed": SEED, "epoch": 0, "consumed_samples": 0}
    epoch, in_epoch = divmod(global_batches_done - 1, PER_EPOCH)
    return {"seed": SEED, "epoch": epoch, "consumed_samples": (in_epoch + 1) * GLOBAL_BATCH}


@pytest.mark.parametrize("group_rows", [None, 6], ids=["fetch-epoch", "fetch-3-micro"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("first_stop", [0, 1, 2, PER_EPOCH, PER_EPOCH + 1],
                         ids=["at-0", "after-1", "after-k", "after-last-of-epoch", "after-first-of-next"])
def test_resume_twice_equals_the_uninterrupted_run(dataset, reference, workers, first_stop, group_rows,
                                                   monkeypatch):
    """Interrupt after `first_stop` global batches, resume, interrupt 2 batches later, resume to the end.

    Tasks fetch the rest of the epoch at once (these rows are tiny) or 3 micro-batches, which do not line
    up with the 4 micro-batches of a global batch.
    """
    if group_rows:
        monkeypatch.setattr("pretrain.data.loader.FETCH_BYTES", group_rows * 12 * 8)
    second_stop = first_stop + 2
    pieces, state = [], None
    for start, stop in ((0, first_stop), (first_stop, second_stop), (second_stop, TOTAL)):
        loader = make_loader(dataset, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seed=SEED,
                             num_workers=workers, prefetch_factor=2)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as stored in a checkpoint
        pieces += consume(loader, (stop - start) * ACCUM)
        state = loader.state_dict()
        assert state == expected_state(stop)
        loader.close()
    assert pieces == reference  # nothing repeated, nothing skipped


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [3, 11, 21])
def test_mid_batch_resume_at_the_same_world_size(dataset, reference, workers, stop, monkeypatch):
    """Micro-batches of 1 are fetched in groups of 8 (test-sized FETCH_BYTES); a stop inside a group resumes."""
    monkeypatch.setattr("pretrain.data.loader.FETCH_BYTES", 8 * 12 * 8)  # 8 rows of 8 + 4 int64 per task
    flat_reference = sum(reference, [])
    first = make_loader(dataset, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, seed=SEED,
                        num_workers=workers)
    assert first.fetch_group == 8
    head = sum(consume(first, stop), [])
    state = first.state_dict()
    first.close()
    second = make_loader(dataset, micro_batch_size=1, global_batch_size=GLOBAL_BATCH, seed=SEED,
                         num_workers=workers)
    second.load_state_dict(state)
    assert head + sum(consume(second, len(flat_reference) - stop), []) == flat_reference
    second.close()


@pytest.mark.parametrize("new_world_size, new_micro", [(1, 4), (2, 2), (4, 1), (4, 2)])
def test_elastic_resume_gives_the_same_global_batches(dataset, reference, new_world_size, new_micro):
    """State saved by 2 ranks after 3 global batches, resumed by `new_world_size` ranks (simulated here)."""
    def run_ranks(world_size, micro, steps, state=None):
        loaders = [make_loader(dataset, micro_batch_size=micro, global_batch_size=GLOBAL_BATCH, seed=SEED,
                               rank=rank, world_size=world_size) for rank in range(world_size)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        accum = loaders[0].grad_accum
        per_rank = [consume(loader, steps * accum) for loader in loaders]
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states)  # every rank saves the same state
        batches = [sum((sum(per_rank[r][step * accum:(step + 1) * accum], []) for r in range(world_size)), [])
                   for step in range(steps)]
        return batches, states[0]

    head, state = run_ranks(2, 2, 3)
    tail, _ = run_ranks(new_world_size, new_micro, TOTAL - 3, state)
    expected = [sum(reference[step * ACCUM:(step + 1) * ACCUM], []) for step in range(TOTAL)]
    assert head + tail == expected


def test_loader_refuses_bad_shapes_and_late_state(dataset):
    with pytest.raises(UserError, match="micro batch 3 does not divide the per-rank batch 4"):
        make_loader(dataset, micro_batch_size=3, global_batch_size=8, seed=0, world_size=2)
    with pytest.raises(UserError, match="not divisible by world size 3"):
        make_loader(dataset, micro_batch_size=1, global_batch_size=8, seed=0, world_size=3)
    loader = make_loader(dataset, micro_batch_size=2, global_batch_size=8, seed=0)
    consume(loader, 1)
    with pytest.raises(RuntimeError, match="before iterating"):
        loader.load_state_dict({"seed": 0, "epoch": 0, "consumed_samples": 0})
    fresh = make_loader(dataset, micro_batch_size=4, global_batch_size=8, seed=0)
    with pytest.raises(UserError, match="inside a micro-batch"):
        fresh.load_state_dict({"seed": 0, "epoch": 0, "consumed_samples": 2})



def test_reads_a_set_written_by_prep_corpus(tiny_shards):
    """The session's real `prep corpus` output (Ray, tokenizers): checked, verified and streamed."""
    real = ShardDataset(tiny_shards, input_length=128, target_length=29, verify=True)
    assert len(real) == real.manifest["totals"]["examples"] > 0
    with make_loader(real, micro_batch_size=4, global_batch_size=16, seed=0, num_workers=2) as loader:
        batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 128) and batch["labels"].shape == (4, 29)
    eos_id = real.manifest["tokenizer"]["eos_id"]
    assert (batch["input_ids"][:, -1] == eos_id).all() and (batch["labels"][:, -1] == eos_id).all()
    inputs, labels = real.get_batch(loader.sampler.global_batch(0, 0)[:4])
    assert np.array_equal(inputs, batch["input_ids"].numpy()) and np.array_equal(labels, batch["labels"].numpy())


def test_a_flipped_byte_is_named_by_the_batch_check(tmp_path):
    """Issue 14.12: a shard with one changed byte (size intact) passes the size check on open; with the model's
    vocabulary as `token_limit` the first batch that reads the bad id names the shard and the fix, also when a
    DataLoader worker read it (one line, no worker traceback)."""
    out = tmp_path / "set"
    write_shard_set(out, shard_rows=[5, 7], input_length=8, target_length=4, vocab_size=1024)
    shard = out / "data" / "part-00000-0001.arrow"
    data = bytearray(shard.read_bytes())
    row = ShardDataset(out)[7]["input_ids"]                  # global row 7 = row 2 of the second shard
    at = bytes(data).find(row.tobytes())
    data[at + 3 * 4 + 3] ^= 0x40                            # token 3's high byte: id + 2**30
    shard.write_bytes(bytes(data))
    dataset = ShardDataset(out)
    assert dataset.get_batch(np.arange(12))[0].max() >= 1 << 30     # unchecked, it would be trained on
    dataset.token_limit = 1024
    dataset.get_batch(np.arange(5))                          # the intact shard reads fine
    with pytest.raises(UserError, match=r"part-00000-0001.arrow: token id \d+ outside the model's vocabulary"):
        dataset.get_batch(np.arange(12))
    for workers in (0, 1):
        with make_loader(dataset, micro_batch_size=4, global_batch_size=12, seed=0, num_workers=workers) as loader:
            with pytest.raises(UserError, match="prep verify") as err:
                next(iter(loader))
        assert "\n" not in str(err.value) and "Traceback" not in str(err.value)

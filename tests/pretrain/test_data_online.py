"""`--loader online`: prep's reader, tokenizer and span corruption inside the DataLoader workers.

    .venv/bin/python -m pytest tests/pretrain/test_data_online.py -q

Real tokenizer, real sample corpus, real torch DataLoader workers; the shard set to compare with is the session's
`tiny_shards` (made by `prep corpus` on Ray from the same corpus and settings).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.common import UserError
from pipeline.shard_format import read_shard_arrays
from pipeline.span_corruption import reconstruct
from pretrain.data.online import OnlineLoader, online_source
from tests.conftest import TINY_INPUT_LENGTH, TINY_UNIT_BYTES


def take(loader, n):
    batches = iter(loader)
    out = [next(batches) for _ in range(n)]
    return torch.cat([b["input_ids"] for b in out]), torch.cat([b["labels"] for b in out])


@pytest.fixture(scope="module")
def corpus_source(sample_corpus, tiny_tokenizer):
    return online_source(str(sample_corpus), tokenizer=str(tiny_tokenizer), input_length=TINY_INPUT_LENGTH,
                         unit_bytes=TINY_UNIT_BYTES, seed=0)


def test_online_examples_are_the_shard_sets_examples(tiny_shards, corpus_source):
    """Given the shard set, online mode reuses its corpus and settings and makes exactly its rows (as a multiset per
    epoch); given the corpus files and the same settings, the same source."""
    source = online_source(str(tiny_shards))
    assert source.fingerprint == corpus_source.fingerprint and len(source.units) == 4
    manifest = json.loads((tiny_shards / "manifest.json").read_text())
    shard_rows = [np.concatenate(read_shard_arrays(tiny_shards / s["path"]), axis=1) for s in manifest["shards"]]
    expected = np.concatenate(shard_rows)
    n = len(expected)
    loader = OnlineLoader(source, micro_batch_size=1, global_batch_size=1, seed=3)
    inputs, labels = take(loader, n)
    got = torch.cat([inputs, labels], 1).numpy()
    assert sorted(map(bytes, got.astype(np.int32))) == sorted(map(bytes, expected))
    loader.close()


def test_online_examples_obey_span_corruption(corpus_source):
    info = corpus_source.tokenizer
    with OnlineLoader(corpus_source, micro_batch_size=8, global_batch_size=16, seed=0) as loader:
        inputs, labels = take(loader, 6)
    assert inputs.shape == (48, TINY_INPUT_LENGTH) and labels.shape == (48, corpus_source.target_length)
    assert inputs.dtype == torch.int64
    windows = reconstruct(inputs.numpy(), labels.numpy(), sentinel_first_id=info["sentinel_first_id"],
                          eos_id=info["eos_id"])
    assert all(len(w) == corpus_source.spec.raw_length for w in windows)
    sentinels = (labels >= info["sentinel_last_id"]).sum(1)
    assert (sentinels == corpus_source.spec.num_noise_spans).all()
    assert int(labels.max()) < info["vocab_size"] and int(inputs.min()) >= 0


def test_a_mean_span_longer_than_the_noise_makes_batches_of_the_derived_lengths(sample_corpus, tiny_tokenizer):
    """`pretrain --loader online --input-length 128 --mean-span-length 100` (and a density that rounds to no noise):
    one span per window, of the lengths SpanSpec derives; the lengths came from unclamped counts before, and the
    workers died with an IndexError or a broadcast error."""
    for density, mean_span in ((0.15, 100.0), (0.001, 3.0)):
        source = online_source(str(sample_corpus), tokenizer=str(tiny_tokenizer), input_length=TINY_INPUT_LENGTH,
                               noise_density=density, mean_span_length=mean_span, unit_bytes=TINY_UNIT_BYTES)
        with OnlineLoader(source, micro_batch_size=4, global_batch_size=4, seed=0) as loader:
            inputs, labels = take(loader, 2)
        assert inputs.shape == (8, TINY_INPUT_LENGTH) and labels.shape == (8, source.target_length)
        assert (labels >= source.tokenizer["sentinel_last_id"]).sum(1).tolist() == [1] * 8


def test_micro_batches_inside_a_unit_are_views_not_copies(corpus_source):
    """The training process copies nothing for a micro-batch inside one unit: contiguous int64 row slices of the
    unit's tensors (which the DataLoader pins on GPUs). Joining two units' rows is the only copy, once per unit.
    Before, every micro-batch was joined and converted in the training process: 12-20 ms per 64 x 626 batch on
    this 2-core machine, 0.03 s per step of data wait for mt5-base on an H200 (docs/study/h200/)."""
    with OnlineLoader(corpus_source, micro_batch_size=2, global_batch_size=2, seed=0) as loader:
        batches = iter(loader)
        seen = [next(batches) for _ in range(40)]
    storages = [b["input_ids"].untyped_storage().data_ptr() for b in seen]
    assert all(b["input_ids"].is_contiguous() and b["labels"].is_contiguous() for b in seen)
    shared = sum(a == b for a, b in zip(storages, storages[1:]))
    assert shared >= len(seen) // 2          # most neighbours share their unit's storage: views of it


@pytest.mark.parametrize("world_size", [1, 2])
def test_stream_is_the_same_for_any_worker_count_and_resumes_exactly(corpus_source, world_size):
    """Workers 0 / 1 / 3 give one stream per rank; stopping after k micro-batches (inside a unit and across a unit
    boundary) and resuming from the JSON round-tripped state, at another worker count, continues it exactly."""
    micro, total = 4, 70        # ~60 examples of 4 units per epoch at 2 ranks: the stream crosses units and epochs
    args = dict(micro_batch_size=micro, global_batch_size=micro * world_size, seed=1, world_size=world_size)
    for rank in range(world_size):
        with OnlineLoader(corpus_source, rank=rank, **args) as loader:
            reference = take(loader, total)
        with OnlineLoader(corpus_source, rank=rank, num_workers=3, **args) as loader:
            assert all(torch.equal(a, b) for a, b in zip(take(loader, total), reference))
        for stop in (1, 37):
            with OnlineLoader(corpus_source, rank=rank, num_workers=1, **args) as first:
                head = take(first, stop)
                state = json.loads(json.dumps(first.state_dict()))
            with OnlineLoader(corpus_source, rank=rank, num_workers=2 if stop == 1 else 0, **args) as resumed:
                resumed.load_state_dict({"per_rank": [state] * world_size} if rank == 0 else state)
                tail = take(resumed, total - stop)
            for part, (h, t) in enumerate(zip(head, tail)):
                assert torch.equal(torch.cat([h, t]), reference[part]), (rank, stop)
    if world_size == 2:   # the two ranks read different units
        with OnlineLoader(corpus_source, rank=0, **args) as a, OnlineLoader(corpus_source, rank=1, **args) as b:
            assert not torch.equal(take(a, 3)[0], take(b, 3)[0])


def test_online_refusals(tmp_path, sample_corpus, tiny_tokenizer, tiny_shards, corpus_source):
    with pytest.raises(UserError, match="need --tokenizer"):
        online_source(str(sample_corpus))
    with pytest.raises(UserError, match="made with --input-length 128"):
        online_source(str(tiny_shards), input_length=64)
    with pytest.raises(UserError, match="fewer than the 8 ranks"):
        OnlineLoader(corpus_source, micro_batch_size=1, global_batch_size=8, seed=0, world_size=8)
    loader = OnlineLoader(corpus_source, micro_batch_size=1, global_batch_size=2, seed=0, world_size=2)
    state = loader.state_dict()
    with pytest.raises(UserError, match="resumes at the world size"):
        loader.load_state_dict({"per_rank": [state]})
    other = online_source(str(sample_corpus), tokenizer=str(tiny_tokenizer), input_length=64, seed=0,
                          unit_bytes=TINY_UNIT_BYTES)
    with pytest.raises(UserError, match="another corpus or settings"):
        OnlineLoader(other, micro_batch_size=1, global_batch_size=2, seed=0, world_size=2).load_state_dict(state)
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "a few words"}\n')
    tiny = online_source(str(short), tokenizer=str(tiny_tokenizer), input_length=TINY_INPUT_LENGTH)
    with OnlineLoader(tiny, micro_batch_size=1, global_batch_size=1, seed=0, num_workers=1) as loader:
        with pytest.raises(UserError, match="gave no example") as err:
            next(iter(loader))
    assert "\n" not in str(err.value)

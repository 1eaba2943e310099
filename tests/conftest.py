"""Session fixtures shared by every test package, built with the real code path (Ray, tokenizers, Arrow).

    def test_x(tiny_shards): ds = ShardDataset(tiny_shards)

- `sample_corpus`: Path of a ~400 KB jsonl cut from the built-in sample corpus (`prep sample-corpus`).
- `tiny_tokenizer`: Path of a tokenizer.json (Unigram, vocab 1024 incl. the 100 sentinels) trained on it.
- `tiny_shards`: Path of a shard set built by `prep corpus` code on a 2-worker local Ray cluster:
  input_length 128 (target_length 29, raw_length 141), 4 work units, 100-row shards, ~960 examples.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray maps a loopback --address (127.0.0.1:port) to this host's outward IP unless told that the "cluster" is
# loopback-only (the same switch Ray uses on laptops); our multi-node test clusters live on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

SAMPLE_CORPUS_BYTES = 400_000
TINY_VOCAB_SIZE = 1024
TINY_INPUT_LENGTH = 128
TINY_UNIT_BYTES = 100_000
TINY_SHARD_ROWS = 100


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory) -> Path:
    from pipeline.sample_corpus import write_sample_corpus

    path, _, _ = write_sample_corpus(tmp_path_factory.mktemp("sample_corpus"), max_bytes=SAMPLE_CORPUS_BYTES)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(sample_corpus, tmp_path_factory) -> Path:
    from pipeline.readers import iter_corpus_texts
    from tokenizer.t5 import train_tokenizer

    return train_tokenizer(iter_corpus_texts([str(sample_corpus)]), TINY_VOCAB_SIZE,
                           tmp_path_factory.mktemp("tiny_tokenizer"), show_progress=False)


def tiny_prep_config(inputs, tokenizer, out, **overrides):
    """The CorpusConfig of `tiny_shards` (tests that rebuild the set compare against the fixture with it)."""
    from pipeline.config import CorpusConfig

    settings = dict(input=[str(p) for p in inputs], tokenizer=str(tokenizer), out=str(out),
                    input_length=TINY_INPUT_LENGTH, unit_bytes=TINY_UNIT_BYTES, shard_rows=TINY_SHARD_ROWS,
                    workers=2, quiet=True)
    settings.update(overrides)
    return CorpusConfig(**settings)


@pytest.fixture(scope="session")
def tiny_shards(sample_corpus, tiny_tokenizer, tmp_path_factory) -> Path:
    from pipeline.corpus import build_shards

    out = tmp_path_factory.mktemp("tiny_shards") / "set"
    build_shards(tiny_prep_config([sample_corpus], tiny_tokenizer, out))
    return out


@pytest.fixture(scope="session")
def tiny_prep(sample_corpus, tiny_tokenizer):
    """A factory: tiny_prep(out, **overrides) -> the CorpusConfig of `tiny_shards` aimed at `out`."""
    return lambda out, **overrides: tiny_prep_config(**{"inputs": [sample_corpus], "tokenizer": tiny_tokenizer,
                                                        "out": out, **overrides})

"""Session fixtures shared by every test package, built with the real code path (Ray, tokenizers, Arrow).

    def test_x(tiny_shards): ds = ShardDataset(tiny_shards)

- `sample_corpus`: Path of a ~400 KB jsonl cut from the built-in sample corpus (`prep sample-corpus`).
- `tiny_tokenizer`: Path of a tokenizer.json (Unigram, vocab 1024 incl. the 100 sentinels) trained on it.
- `tiny_shards`: Path of a shard set built by `prep corpus` code on a 2-worker local Ray cluster:
  input_length 128 (target_length 29, raw_length 141), 4 work units, 100-row shards, ~960 examples.
- `tmpfs`: a factory of small tmpfs mounts (full or read-only outputs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray maps a loopback --address (127.0.0.1:port) to this host's outward IP unless told that the "cluster" is
# loopback-only (the same switch Ray uses on laptops); our multi-node test clusters live on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Without a GPU, Triton kernels (pretrain/model/relative_attention.py) run in Triton's interpreter. Triton reads the
# variable when it defines a kernel, its own library's included, so it is set before anything imports triton.
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(name, options="size=2m")` -> a fresh tmpfs mount point, unmounted after the test;
    `tmpfs.read_only(point)` remounts it read-only. Skips the test where mounting is refused (not root, no
    CAP_SYS_ADMIN). For the outputs-on-a-full-or-read-only-filesystem tests of every command."""
    mounted: list[Path] = []

    def run(*argv: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"`{' '.join(argv[:4])}` refused here ({done.stderr.strip() or done.returncode})")

    def mount(name: str, options: str = "size=2m") -> Path:
        point = tmp_path / name
        point.mkdir()
        run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point))
        mounted.append(point)
        return point

    def read_only(point: Path) -> Path:
        run("mount", "-o", "remount,ro", str(point))
        return point

    mount.read_only = read_only
    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


_EXIT_STATUS = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown once pytest has reported, with pytest's exit status. The suite
    runs a gloo group (test_grad_norm), a Ray instance and Inductor's compile workers in this process; as in
    `pretrain.cli.main`'s ranks, tearing those down while Python finalises can kill the process after every test
    passed (exit 139 once in three full runs on 2026-12-05, the summary already printed: 522 passed)."""
    if "status" in _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS["status"])

"""`prep corpus` on real Ray: determinism across worker counts and cluster shapes, resume, formats, bad records, errors."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common import UserError
from pipeline.corpus import build_shards
from pipeline.shard_format import read_manifest, read_shard_arrays
from pipeline.span_corruption import reconstruct


def shard_bytes(shard_dir: Path) -> dict[str, bytes]:
    manifest = read_manifest(shard_dir)
    return {s["path"]: (shard_dir / s["path"]).read_bytes() for s in manifest["shards"]}


def assert_same_set(a: Path, b: Path) -> None:
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["fingerprint"] == mb["fingerprint"]
    assert ma["shards"] == mb["shards"] and ma["totals"] == mb["totals"]
    assert shard_bytes(a) == shard_bytes(b)


@pytest.fixture
def shared_ray():
    """One local Ray instance for a test that runs several jobs (the executor uses it instead of starting its own)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def test_fixture_set_reconstructs_the_token_stream(tiny_shards, tiny_tokenizer):
    """Every example un-corrupts to a raw window of real tokens; windows of a unit are consecutive text."""
    manifest = read_manifest(tiny_shards)
    tok = manifest["tokenizer"]
    inputs, labels = read_shard_arrays(tiny_shards / manifest["shards"][0]["path"])
    windows = reconstruct(inputs, labels, sentinel_first_id=tok["sentinel_first_id"], eos_id=tok["eos_id"])
    assert all(len(w) == manifest["config"]["raw_length"] for w in windows)
    stream = np.concatenate(windows)
    assert stream.max() < tok["sentinel_last_id"] and (stream == tok["eos_id"]).sum() >= 1
    from tokenizer.t5 import load_tokenizer

    text = load_tokenizer(tiny_tokenizer).decode(stream[: 200].tolist())
    assert len(text) > 200  # real text, e.g. the first pydoc topic


def test_one_worker_equals_two_workers(tiny_shards, tiny_prep, tmp_path):
    build_shards(tiny_prep(tmp_path / "w1", workers=1))
    assert_same_set(tmp_path / "w1", tiny_shards)


def test_two_node_cluster_equals_local(tiny_shards, tiny_prep, tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                             "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        # Through --ray-address, as a user with an existing cluster would run it.
        build_shards(tiny_prep(tmp_path / "cluster", ray_address=cluster.address, workers=2))
        assert not ray.is_initialized()
    finally:
        cluster.shutdown()
    assert_same_set(tmp_path / "cluster", tiny_shards)


def test_rerun_is_a_noop_and_repairs_damage(tiny_shards, tiny_prep, tmp_path, shared_ray):
    out = tmp_path / "copy"
    build_shards(tiny_prep(out))
    again = build_shards(tiny_prep(out))
    assert again.already_complete and again.units_run == 0
    # Damage: a unit record lost, a shard truncated, a stale temp file, no manifest -> only those units rerun.
    manifest = read_manifest(out)
    (out / "units" / "00001.json").unlink()
    victim = out / manifest["shards"][-1]["path"]
    victim.write_bytes(victim.read_bytes()[:100])
    (out / "data" / ".part-00000-0000.arrow.999.tmp").write_bytes(b"partial")
    (out / "manifest.json").unlink()
    repaired = build_shards(tiny_prep(out))
    assert repaired.units_run == 2 and repaired.units_total == 4
    assert not list((out / "data").glob(".*.tmp"))
    assert_same_set(out, tiny_shards)


def test_kill_minus_9_then_rerun_is_byte_identical(sample_corpus, tiny_tokenizer, tmp_path):
    """A real `prep corpus` process group is SIGKILLed mid-run; the rerun finishes only what is missing."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(sample_corpus.read_bytes() * 3)  # ~1.2 MB -> 12 units
    args = ["--input", str(corpus), "--tokenizer", str(tiny_tokenizer), "--input-length", "128",
            "--unit-bytes", "100000", "--shard-rows", "100", "--workers", "2", "--quiet"]
    out = tmp_path / "killed"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "corpus", *args, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while len(list((out / "units").glob("*.json"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: driver, raylet, workers
        _, stderr = proc.communicate()
    done_before = len(list((out / "units").glob("*.json")))
    assert 2 <= done_before < 12, stderr.decode()[-2000:]
    assert not (out / "manifest.json").exists()
    from pipeline.cli import main

    assert main(["corpus", *args, "--out", str(out)]) == 0
    reference = tmp_path / "reference"
    assert main(["corpus", *args, "--out", str(reference)]) == 0
    assert_same_set(out, reference)
    assert read_manifest(out)["totals"]["units"] == 12


def _docs(sample_corpus, count=40):
    lines = sample_corpus.read_text().splitlines()[:count]
    return [json.loads(line)["text"].replace("\n", " ") for line in lines]


def test_every_input_format_gives_the_same_shards(sample_corpus, tiny_tokenizer, tiny_prep, tmp_path, shared_ray):
    """The same documents as jsonl, jsonl.gz, jsonl.zst, txt, parquet and a datasets dir -> identical shard bytes."""
    import datasets
    import zstandard

    docs = _docs(sample_corpus)
    jsonl = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    inputs = {"c.jsonl": None, "c.jsonl.gz": None, "c.jsonl.zst": None, "c.txt": None, "c.parquet": None, "hf": None}
    (tmp_path / "c.jsonl").write_bytes(jsonl)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    (tmp_path / "c.txt").write_text("".join(d + "\n\n" for d in docs))  # blank lines are skipped
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    results = {}
    for name in inputs:
        out = tmp_path / f"out_{name.replace('.', '_')}"
        result = build_shards(tiny_prep(out, inputs=[str(tmp_path / name)], unit_bytes=1 << 30, workers=1))
        results[name] = (shard_bytes(out), result.totals["documents"])
    reference = results["c.jsonl"]
    assert reference[1] == len(docs) and len(reference[0]) >= 1
    for name, got in results.items():
        assert got == reference, name


def test_bad_records_are_counted_and_skipped(sample_corpus, tiny_prep, tmp_path, shared_ray):
    docs = _docs(sample_corpus, 20)
    max_doc_chars = max(map(len, docs)) + 10
    good = [json.dumps({"text": d}).encode() for d in docs]
    bad = [
        b'{"text": "caf\xe9 in latin-1"}',  # invalid_utf8
        b'{"text": "unterminated',  # malformed_json
        b'["a list, not an object"]',  # malformed_json
        b'{"body": "no text field"}',  # missing_text
        b'{"text": 42}',  # not_text
        b'{"text": "   \\t  "}',  # empty
        b'{"text": "' + b"x" * (max_doc_chars + 1) + b'"}',  # too_long
        b'{"text": "nul \\u0000 inside"}',  # nul_bytes
        b'{"text": "lone \\ud800 surrogate"}',  # lone_surrogate
    ]
    lines = good[:10] + bad + good[10:]
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "bad.txt").write_bytes(b"fine line of text\n\xff\xfe broken\nnul\x00here\n")
    result = build_shards(tiny_prep(tmp_path / "out", inputs=[str(tmp_path / "bad.jsonl"), str(tmp_path / "bad.txt")],
                                    max_doc_chars=max_doc_chars, workers=1))
    rejected = result.manifest["rejected"]
    assert rejected == {"invalid_utf8": 2, "malformed_json": 2, "missing_text": 1, "not_text": 1, "empty": 1,
                        "too_long": 1, "nul_bytes": 2, "lone_surrogate": 1}
    assert result.totals["documents"] == 21
    assert result.totals["examples"] > 0


def test_error_paths(tiny_shards, tiny_prep, tiny_tokenizer, sample_corpus, tmp_path):
    with pytest.raises(UserError, match="nope.jsonl: input not found"):
        build_shards(tiny_prep(tmp_path / "a", inputs=[str(tmp_path / "nope.jsonl")]))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(UserError, match="broken.json: not a readable"):
        build_shards(tiny_prep(tmp_path / "a", tokenizer=str(tmp_path / "broken.json")))
    spec = json.loads(Path(tiny_tokenizer).read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<extra_id_")]
    (tmp_path / "nosentinels.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="sentinels"):
        build_shards(tiny_prep(tmp_path / "a", tokenizer=str(tmp_path / "nosentinels.json")))
    (tmp_path / "words.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported input format"):
        build_shards(tiny_prep(tmp_path / "a", inputs=[str(tmp_path / "words.csv")]))
    # An output directory holding another shard set (here: other seed) is refused without --overwrite.
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_shards, other)
    with pytest.raises(UserError, match="holds a different shard set.*--overwrite"):
        build_shards(tiny_prep(other, seed=1))
    assert read_manifest(other)["fingerprint"] == read_manifest(tiny_shards)["fingerprint"]  # untouched

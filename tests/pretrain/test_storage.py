"""s3:// shard sets against a real S3-compatible server (moto, on loopback): cache, checks, offline reuse.

    .venv/bin/python -m pytest tests/pretrain/test_storage.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.common import UserError
from pipeline.synthetic_shards import write_shard_set
from pretrain.data.dataset import ShardDataset
from pretrain.data.loader import make_loader
from pretrain.data.storage import cache_path_for, is_url, open_filesystem, resolve_shard_dir
from pretrain.metrics import read_metrics

BUCKET = "t5zero-test"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (free port), with AWS_ENDPOINT_URL pointing at it for this module."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {key: os.environ.get(key) for key in [*AWS_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(AWS_ENV, AWS_ENDPOINT_URL=endpoint)
    fs = open_filesystem(f"s3://{BUCKET}", {"skip_instance_cache": True})
    fs.mkdir(BUCKET)
    try:
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def upload(local_dir: Path, url: str) -> None:
    fs = open_filesystem(url, {"skip_instance_cache": True})
    for path in sorted(local_dir.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{url}/{path.relative_to(local_dir).as_posix()}")
    fs.invalidate_cache()


@pytest.fixture(scope="module")
def remote_set(s3_endpoint, tmp_path_factory):
    local = tmp_path_factory.mktemp("local") / "set"
    write_shard_set(local, shard_rows=[6, 9, 5], input_length=8, target_length=4)
    url = f"s3://{BUCKET}/shards/demo"
    upload(local, url)
    return local, url


def test_url_helpers(tmp_path):
    assert is_url("s3://b/k") and not is_url("shards/demo") and not is_url("file:///tmp/x")
    assert cache_path_for("s3://b/shards/demo/", tmp_path) == tmp_path / "s3" / "b" / "shards" / "demo"
    with pytest.raises(UserError, match="not a usable shard-set URL"):
        cache_path_for("s3://b/../etc", tmp_path)
    assert resolve_shard_dir("shards/demo") == Path("shards/demo")


def test_s3_set_is_cached_then_read_without_network(remote_set, tmp_path, monkeypatch):
    local, url = remote_set
    cache = tmp_path / "cache"
    remote = ShardDataset(url, cache_dir=cache, input_length=8, target_length=4)
    assert remote.root == cache / "s3" / BUCKET / "shards" / "demo"
    assert sorted(p.name for p in (remote.root / "data").iterdir()) == sorted(
        p.name for p in (local / "data").iterdir())  # no temp files left behind
    expected = ShardDataset(local).get_batch(np.arange(20))
    got = remote.get_batch(np.arange(20))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))

    # second open: an unreachable endpoint proves it reads the disk only
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast below
    again = ShardDataset(url, cache_dir=cache)
    loader = make_loader(again, micro_batch_size=2, global_batch_size=4, seed=0, num_workers=0)
    assert next(iter(loader))["input_ids"].shape == (2, 8)

    # a cache that lost a shard is refetched, but then the network is needed: point back at the server
    (again.root / "data" / "part-00000-0001.arrow").unlink()
    with pytest.raises(UserError, match="cannot read"):
        ShardDataset(url, cache_dir=cache)
    monkeypatch.undo()
    healed = ShardDataset(url, cache_dir=cache, verify=True)
    assert np.array_equal(healed.get_batch(np.arange(20))[1], expected[1])


def test_ranks_sharing_a_cache_download_once_and_all_open_it(remote_set, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    _, url = remote_set
    cache = tmp_path / "shared-cache"
    with ThreadPoolExecutor(max_workers=3) as pool:  # flock also excludes threads (separate open files)
        opened = list(pool.map(lambda _: ShardDataset(url, cache_dir=cache), range(3)))
    first = opened[0].get_batch(np.arange(20))[0]
    assert all(np.array_equal(d.get_batch(np.arange(20))[0], first) for d in opened[1:])


def test_verify_refetches_a_corrupted_cached_shard(remote_set, tmp_path):
    local, url = remote_set
    cache = tmp_path / "cache"
    root = ShardDataset(url, cache_dir=cache).root
    shard = root / "data" / "part-00000-0000.arrow"
    expected = ShardDataset(local).get_batch(np.arange(6))[0]
    raw = bytearray(shard.read_bytes())
    raw[raw.find(expected[0, 1:4].tobytes())] ^= 0xFF  # a token of row 0, same size: only a checksum notices
    shard.write_bytes(bytes(raw))
    assert not np.array_equal(ShardDataset(url, cache_dir=cache).get_batch(np.arange(6))[0], expected)
    assert np.array_equal(ShardDataset(url, cache_dir=cache, verify=True).get_batch(np.arange(6))[0], expected)


def test_cache_dir_from_environment(remote_set, tmp_path, monkeypatch):
    _, url = remote_set
    monkeypatch.setenv("T5ZERO_CACHE", str(tmp_path / "envcache"))
    assert ShardDataset(url).root == tmp_path / "envcache" / "s3" / BUCKET / "shards" / "demo"


def test_bad_remote_shard_is_refused_and_not_cached(remote_set, tmp_path):
    local, _ = remote_set
    url = f"s3://{BUCKET}/shards/corrupt"
    manifest = json.loads((local / "manifest.json").read_text())
    manifest["shards"][2]["sha256"] = "0" * 64
    upload(local, url)
    fs = open_filesystem(url, {"skip_instance_cache": True})
    fs.pipe_file(f"{url}/manifest.json", json.dumps(manifest).encode())
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="part-00000-0002.arrow: sha256 .* does not match the manifest"):
        ShardDataset(url, cache_dir=cache)
    root = cache_path_for(url, cache)
    assert not (root / "manifest.json").exists()
    assert not any(p.name.endswith(".tmp") for p in root.rglob("*"))


def test_missing_remote_set_names_the_url(s3_endpoint, tmp_path):
    with pytest.raises(UserError, match=f"s3://{BUCKET}/shards/nothing/manifest.json: no manifest"):
        ShardDataset(f"s3://{BUCKET}/shards/nothing", cache_dir=tmp_path)


def test_refresh_fetches_a_changed_set(s3_endpoint, tmp_path):
    url = f"s3://{BUCKET}/shards/changing"
    first, second = tmp_path / "v1", tmp_path / "v2"
    write_shard_set(first, shard_rows=[4, 4], seed=1)
    write_shard_set(second, shard_rows=[4, 4], seed=2)
    upload(first, url)
    cache = tmp_path / "cache"
    v1 = ShardDataset(url, cache_dir=cache).get_batch(np.arange(8))[0].copy()
    upload(second, url)
    assert np.array_equal(ShardDataset(url, cache_dir=cache).get_batch(np.arange(8))[0], v1)  # cache kept
    root = resolve_shard_dir(url, cache_dir=cache, refresh=True)
    v2 = ShardDataset(root).get_batch(np.arange(8))[0]
    assert np.array_equal(v2, ShardDataset(second).get_batch(np.arange(8))[0]) and not np.array_equal(v1, v2)


@pytest.mark.parametrize("workers", [0, 2])
def test_remote_mode_streams_from_cold_through_a_cache_smaller_than_the_set(s3_endpoint, tmp_path, workers):
    """`--loader remote`: a cold cache of 3 shards' bytes for a 6-shard set; shards are fetched in the order the
    ShardOrderSampler reads them (prefetch 1 ahead), consumed ones are evicted, the cache never holds the set nor a
    manifest, and the batches equal those of the same sampler over the local set, across an epoch."""
    from pretrain.data.loader import ShardLoader
    from pretrain.data.sampler import ShardOrderSampler
    from pretrain.data.storage import ShardStreamer

    local = tmp_path / "local"
    manifest = write_shard_set(local, shard_rows=[8] * 6, input_length=8, target_length=4)
    url = f"s3://{BUCKET}/shards/stream-{workers}"
    upload(local, url)
    shard_bytes = max(s["bytes"] for s in manifest["shards"])
    streamer = ShardStreamer(url, cache_dir=tmp_path / "cache", prefetch=1, max_bytes=3 * shard_bytes)
    remote = ShardDataset(url, streamer=streamer, input_length=8, target_length=4)
    assert not any(streamer.present(i) for i in range(6))                         # cold
    steps = 16                                                                     # 64 samples: 1.33 epochs
    with make_loader(remote, micro_batch_size=2, global_batch_size=4, seed=5, num_workers=workers) as loader:
        assert isinstance(loader.sampler, ShardOrderSampler)
        batches = iter(loader)
        got = [next(batches)["input_ids"][:, 0].clone() for _ in range(2 * steps)]
        assert loader.first_batch_s is not None and loader.first_batch_s > 0
        fetched = list(streamer.fetched)
    local_ds = ShardDataset(local)
    sampler = ShardOrderSampler(local_ds.shard_rows, 4, seed=5)
    with ShardLoader(local_ds, sampler, 2) as reference:
        expected = [b["input_ids"][:, 0].clone() for b, _ in zip(reference, range(2 * steps))]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    order = [int(s) for s in sampler.shard_sequence(0)]
    assert fetched[:4] == order[:4] or workers                                 # prefetch follows the read order
    assert streamer.peak_cached_bytes <= 3 * shard_bytes
    assert streamer.evicted and not (streamer.local_dir / "manifest.json").exists()
    assert sum(streamer.present(i) for i in range(6)) < 6


def test_remote_mode_refuses_a_cache_too_small_for_its_prefetch(s3_endpoint, remote_set, tmp_path):
    from pretrain.data.storage import ShardStreamer

    _, url = remote_set
    with pytest.raises(UserError, match="raise --cache-max-gib or lower --remote-prefetch-shards"):
        ShardStreamer(url, cache_dir=tmp_path, prefetch=4, max_bytes=1000)


@pytest.mark.slow   # ./scripts/test.sh -m slow (the default suite stays under CI's 20 minutes)
def test_pretrain_remote_mode_end_to_end_from_cold_and_resumes(s3_endpoint, tiny_shards, tmp_path):
    """`pretrain --loader remote` on the real tiny shard set uploaded to the S3 server: from a cold cache smaller
    than the set, with the first batch's wait reported; a run stopped and resumed reads exactly the batches of a
    whole run (the remote mode's order is shard after shard, not the shards mode's global order)."""
    from launching import ok, pretrain

    url = f"s3://{BUCKET}/shards/tiny-e2e"
    upload(tiny_shards, url)
    manifest = json.loads((tiny_shards / "manifest.json").read_text())
    assert len(manifest["shards"]) > 3                       # the cache below holds 3 of them
    largest_mib = max(s["bytes"] for s in manifest["shards"]) / 2**20
    common = ["--model", "t5-tiny", "--steps", "6", "--micro-batch", "4", "--global-batch", "8", "--seed", "0",
              "--zero", "2", "--nproc", "1", "--loader", "remote", "--data", url, "--loader-workers", "1",
              "--remote-prefetch-shards", "1", "--cache-max-gib", f"{3 * largest_mib / 1024:.6f}"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    ok(pretrain(*common, "--cache-dir", str(tmp_path / "cache-whole"), "--out", str(whole)))
    records = read_metrics(whole / "metrics.jsonl")
    assert len(records) == 6 and {r["loader"] for r in records} == {"remote"}
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["loader"] == "remote" and summary["time_to_first_batch_s"] > 0
    cache = tmp_path / "cache-split"
    ok(pretrain(*common, "--cache-dir", str(cache), "--out", str(split), "--stop-after", "3"))
    ok(pretrain(*common, "--cache-dir", str(cache), "--out", str(split), "--resume"))
    resumed = read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["batch_checksum"] for r in resumed] == [r["batch_checksum"] for r in records]
    cached = sum(p.stat().st_size for p in cache.rglob("*.arrow"))
    assert cached <= 3 * largest_mib * 2**20 and not list(cache.rglob("manifest.json"))

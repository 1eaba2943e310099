"""Shard sets on object storage: resolve an `s3://` (or other fsspec) URL to a checked local cache directory.

    local_dir = resolve_shard_dir("s3://bucket/shards/demo")   # downloads once, later opens read the disk

A local path is returned as it is. For a URL, the cache holds `<cache_dir>/<protocol>/<bucket>/<key...>/`
with the same layout as the remote shard set. The remote manifest is read first; each shard is downloaded to
a temp name beside its final path, checked (size and sha256 against the manifest) and renamed into place;
the manifest is written last, so its presence in the cache means "complete". Processes sharing a cache
(the ranks of one node) take a file lock around the download: one fetches, the others then reuse it.
A later open of the same URL finds the cached manifest and its shards (sizes checked) and touches no
network. Pass `refresh=True` to re-read the remote manifest and fetch any shard that changed.

Endpoint: `storage_options` (passed to `fsspec.filesystem`), else `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`
from the environment for s3. Cache root: `cache_dir`, else `$T5ZERO_CACHE`, else `~/.cache/t5zero`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.common import UserError, atomic_write_bytes, sha256_file
from pipeline.shard_format import MANIFEST_NAME, parse_manifest, shard_file_problem

DEFAULT_CACHE_DIR = "~/.cache/t5zero"
DOWNLOAD_THREADS = 4


def is_url(path_or_url: str | os.PathLike) -> bool:
    """True for `scheme://...` (s3, gs, http, memory, ...); False for a local path or `file://`."""
    text = os.fspath(path_or_url)
    return "://" in text and not text.startswith("file://")


def default_cache_dir() -> Path:
    """`$T5ZERO_CACHE`, else `~/.cache/t5zero`."""
    return Path(os.environ.get("T5ZERO_CACHE") or DEFAULT_CACHE_DIR).expanduser()


def cache_path_for(url: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local directory that caches the shard set at `url`: <cache>/<protocol>/<bucket>/<key...>."""
    protocol, _, rest = url.partition("://")
    parts = [p for p in rest.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise UserError(f"{url}: not a usable shard-set URL; give e.g. s3://bucket/shards/NAME")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root.joinpath(protocol, *parts)


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """An fsspec filesystem for `url`; for s3 the endpoint comes from `storage_options` or AWS_ENDPOINT_URL."""
    import fsspec

    protocol = url.partition("://")[0]
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        client_kwargs = dict(options.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in options and "endpoint_url" not in client_kwargs:
            client_kwargs["endpoint_url"] = endpoint
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
    try:
        return fsspec.filesystem(protocol, **options)
    except (ImportError, ValueError) as err:
        raise UserError(f"{url}: cannot open protocol {protocol!r} ({err}); install its fsspec backend "
                        f"(s3fs for s3://) or give a local path")


def resolve_shard_dir(path_or_url: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                      storage_options: dict[str, Any] | None = None, refresh: bool = False,
                      verify: bool = False) -> Path:
    """A local directory holding the shard set: the path itself, or the (filled) cache directory of a URL.

    `verify=True` re-hashes cached shards that are reused without download (downloads are always hashed).
    """
    text = os.fspath(path_or_url)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    if not is_url(text):
        return Path(text)
    local_dir = cache_path_for(text, cache_dir)
    if not refresh and _cache_complete(local_dir, verify=verify):
        return local_dir
    with _cache_lock(local_dir):  # ranks of one node sharing a cache: one downloads, the others then reuse it
        if refresh or not _cache_complete(local_dir, verify=verify):
            _download_shard_set(text, local_dir, storage_options)
    return local_dir


@contextlib.contextmanager
def _cache_lock(local_dir: Path):
    """An exclusive advisory lock on `<local_dir>.lock` (POSIX flock; released when the holder exits)."""
    import fcntl

    lock_path = local_dir.with_name(local_dir.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _cache_complete(local_dir: Path, *, verify: bool) -> bool:
    """True when the cached manifest exists and every shard it lists is present with its recorded size."""
    manifest_path = local_dir / MANIFEST_NAME
    try:
        manifest = parse_manifest(manifest_path.read_bytes(), manifest_path)
    except (OSError, UserError):
        return False
    return all(shard_file_problem(local_dir, s, check_sha=verify) is None for s in manifest["shards"])


def _download_shard_set(url: str, local_dir: Path, storage_options: dict[str, Any] | None) -> None:
    """Fetch the manifest, then every shard not already cached intact (hashed), then write the manifest."""
    fs = open_filesystem(url, storage_options)
    remote_root = url.rstrip("/")
    manifest_url = f"{remote_root}/{MANIFEST_NAME}"
    try:
        manifest_bytes = fs.cat_file(manifest_url)
    except FileNotFoundError:
        raise UserError(f"{manifest_url}: no manifest; check the URL or upload the whole shard set "
                        f"(run `prep corpus` and copy its output directory)") from None
    except Exception as err:  # network, credentials, endpoint: the backend's own exception types vary
        raise UserError(f"{manifest_url}: cannot read ({type(err).__name__}: {err}); check the endpoint "
                        f"(AWS_ENDPOINT_URL) and credentials") from None
    shards = parse_manifest(manifest_bytes, manifest_url)["shards"]
    for shard in shards:
        rel = Path(shard["path"])
        if rel.is_absolute() or ".." in rel.parts:
            raise UserError(f"{manifest_url}: shard path {shard['path']!r} leaves the shard set; fix the manifest")

    local_dir.mkdir(parents=True, exist_ok=True)
    (local_dir / MANIFEST_NAME).unlink(missing_ok=True)  # the cache is incomplete until the manifest is back
    todo = [s for s in shards if shard_file_problem(local_dir, s) is not None]
    total_bytes = sum(int(s["bytes"]) for s in todo)

    from tqdm import tqdm

    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"fetch {remote_root}", disable=None) as bar:
        def fetch(shard: dict[str, Any]) -> None:
            _download_shard(fs, f"{remote_root}/{shard['path']}", local_dir / shard["path"], shard)
            bar.update(int(shard["bytes"]))

        with ThreadPoolExecutor(max_workers=DOWNLOAD_THREADS) as pool:
            list(pool.map(fetch, todo))
    atomic_write_bytes(local_dir / MANIFEST_NAME, manifest_bytes)


def _download_shard(fs, remote: str, local: Path, shard: dict[str, Any]) -> None:
    """Download one shard to a temp name beside `local`, check size and sha256, rename it into place."""
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            fs.get_file(remote, tmp)
        except FileNotFoundError:
            raise UserError(f"{remote}: listed in the manifest but missing; re-upload the shard set") from None
        size = os.path.getsize(tmp)
        if size != shard["bytes"]:
            raise UserError(f"{remote}: {size} bytes, the manifest says {shard['bytes']}; the upload is "
                            f"truncated or stale: re-upload the shard set")
        digest = sha256_file(tmp)
        if digest != shard["sha256"]:
            raise UserError(f"{remote}: sha256 {digest[:12]}.. does not match the manifest "
                            f"({shard['sha256'][:12]}..); re-upload the shard set")
        os.replace(tmp, local)
    finally:
        Path(tmp).unlink(missing_ok=True)

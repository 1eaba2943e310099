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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.common import UserError, atomic_write_bytes, sha256_file
from pipeline.shard_format import MANIFEST_NAME, parse_manifest, shard_file_problem

DEFAULT_CACHE_DIR = "~/.cache/t5zero"
DOWNLOAD_THREADS = 4
ROOM_WAIT_S = 5.0          # how long a reader waits for the prefetch thread to make room in a bounded cache


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


# -- streaming: the `remote` loader mode -------------------------------------------------------------------------

def read_remote_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checked manifest of the shard set at `url`, read from the store (nothing cached)."""
    fs = open_filesystem(url, storage_options)
    manifest_url = f"{url.rstrip('/')}/{MANIFEST_NAME}"
    try:
        return parse_manifest(fs.cat_file(manifest_url), manifest_url)
    except FileNotFoundError:
        raise UserError(f"{manifest_url}: no manifest; check the URL or upload the whole shard set "
                        f"(run `prep corpus` and copy its output directory)") from None
    except UserError:
        raise
    except Exception as err:  # network, credentials, endpoint: the backend's own exception types vary
        raise UserError(f"{manifest_url}: cannot read ({type(err).__name__}: {err}); check the endpoint "
                        f"(AWS_ENDPOINT_URL) and credentials") from None


def read_shard_set_manifest(location: str) -> dict[str, Any]:
    """The checked manifest of a shard set, local or at a URL; for a URL only the manifest is read (no shard)."""
    from pipeline.shard_format import read_manifest

    return read_remote_manifest(location) if is_url(location) else read_manifest(location)


class ShardStreamer:
    """A remote shard set read shard by shard through a bounded local cache (`pretrain --loader remote`).

        streamer = ShardStreamer("s3://b/shards/demo", prefetch=2, max_bytes=1 << 30)
        dataset = ShardDataset(url, streamer=streamer); streamer.start(sampler)   # in the rank, before iterating

    The manifest is read from the store (no download of the set). `fetch(i)` puts shard i into the cache (temp
    name, size and sha256 checked, renamed; a per-shard flock so the ranks and loader workers of a node fetch it
    once) and is what a reader calls before mapping a shard. `start(sampler)` runs a thread in the rank process
    that follows the sampler (a `ShardOrderSampler`): it fetches the shard being read and `prefetch` shards after
    it, in the order the sampler reads them, and evicts shards the consumer has finished so that the cache holds
    at most `max_bytes` of shards. The cache never gets a manifest in this mode (it is never a complete copy).
    Picklable: loader workers get a copy without the thread and filesystem.
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike | None = None,
                 storage_options: dict[str, Any] | None = None, prefetch: int = 2, max_bytes: int | None = None):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.manifest = read_remote_manifest(self.url, storage_options)
        self.shards = self.manifest["shards"]
        for shard in self.shards:
            rel = Path(shard["path"])
            if rel.is_absolute() or ".." in rel.parts:
                raise UserError(f"{self.url}/{MANIFEST_NAME}: shard path {shard['path']!r} leaves the shard set; "
                                f"fix the manifest")
        self.local_dir = cache_path_for(self.url, cache_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.prefetch = int(prefetch)
        self.max_bytes = max_bytes
        largest = max((int(s["bytes"]) for s in self.shards), default=0)
        if max_bytes is not None and largest * (self.prefetch + 1) > max_bytes:
            raise UserError(f"--cache-max-gib {max_bytes / (1 << 30):.3g} holds fewer than the {self.prefetch + 1} "
                            f"shards (largest {largest / (1 << 20):.1f} MiB) that reading one and prefetching "
                            f"{self.prefetch} needs; raise --cache-max-gib or lower --remote-prefetch-shards")
        self.fetched: list[int] = []       # shard indices this process downloaded, in order (tests, the report)
        self.evicted: list[int] = []
        self.peak_cached_bytes = 0
        self._fs = None
        self._thread = None
        self._stop = None
        self._error: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fs=None, _thread=None, _stop=None, fetched=[], evicted=[])
        return state

    def _filesystem(self):
        """This process's own filesystem object (fsspec's async ones are not fork-safe: a forked loader worker
        makes its own, outside fsspec's instance cache)."""
        if self._fs is None or self._fs[0] != os.getpid():
            options = {**(self.storage_options or {}), "skip_instance_cache": True}
            self._fs = (os.getpid(), open_filesystem(self.url, options))
        return self._fs[1]

    def present(self, index: int) -> bool:
        return shard_file_problem(self.local_dir, self.shards[index], check_sha=False) is None

    def cached_bytes(self) -> int:
        return sum(int(s["bytes"]) for i, s in enumerate(self.shards) if self.present(i))

    def fetch(self, index: int, *, wait_for_room: bool = True) -> None:
        """Shard `index` in the cache, checked (downloads it unless present; one process per node does). A reader
        first waits a little for room (`_wait_for_room`); the prefetch thread, which made room itself, does not."""
        if self._error is not None:
            raise self._error
        if self.present(index):
            return
        shard = self.shards[index]
        if wait_for_room:
            self._wait_for_room(int(shard["bytes"]), index)
        local = self.local_dir / shard["path"]
        local.parent.mkdir(parents=True, exist_ok=True)
        with _cache_lock(local):
            if not self.present(index):
                _download_shard(self._filesystem(), f"{self.url}/{shard['path']}", local, shard)
                self.fetched.append(index)

    def _wait_for_room(self, size: int, index: int) -> None:
        """A reader (a loader worker, or the rank when it has none) that needs a shard the prefetch thread has not
        fetched yet waits up to ROOM_WAIT_S for the thread to evict a finished shard, so that the cache stays within
        `max_bytes` when the thread runs late (a busy host: the ranks' Python threads share one interpreter lock).
        Then it downloads anyway: a read the cache cannot hold beside the others goes ahead, past the limit."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while (self.max_bytes is not None and self.cached_bytes() + size > self.max_bytes
               and not self.present(index) and time.monotonic() < deadline):
            time.sleep(0.02)

    def evict(self, index: int) -> None:
        path = self.local_dir / self.shards[index]["path"]
        if path.exists():
            path.unlink(missing_ok=True)
            self.evicted.append(index)

    # -- the prefetch thread (rank process only) -------------------------------------------------------------

    def start(self, sampler) -> None:
        """Follow `sampler` (a ShardOrderSampler) from now on: fetch ahead, evict behind."""
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, args=(sampler,), name="shard-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None

    def _wanted(self, sampler) -> tuple[list[int], list[int]]:
        state = sampler.state_dict()
        epoch, consumed = int(state["epoch"]), int(state["consumed_samples"])
        done, ahead = sampler.shards_ahead(epoch, consumed)
        while len(ahead) < self.prefetch + 1:            # the next epoch's first shards follow
            epoch += 1
            ahead = ahead + [int(s) for s in sampler.shard_sequence(epoch) if int(s) not in ahead]
            if len(ahead) >= len(self.shards):
                break
        return done, ahead[:self.prefetch + 1]

    def _follow(self, sampler) -> None:
        try:
            while not self._stop.is_set():
                done, wanted = self._wanted(sampler)
                for index in done:
                    if index not in wanted:
                        self.evict(index)
                work = False
                for index in wanted:
                    if self.present(index):
                        continue
                    size = int(self.shards[index]["bytes"])
                    if self.max_bytes is not None and self.cached_bytes() + size > self.max_bytes:
                        break                                 # wait for the consumer to finish a shard
                    self.fetch(index, wait_for_room=False)
                    work = True
                    break                                     # re-read the position after every download
                self.peak_cached_bytes = max(self.peak_cached_bytes, self.cached_bytes())
                if not work:
                    self._stop.wait(0.02)
        except BaseException as err:       # the reader that needs the shard re-raises it
            self._error = err

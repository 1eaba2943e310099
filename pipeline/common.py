"""Small pieces every part shares: the user-error type, the CLI wrapper, atomic writes and checksums.

    from pipeline.common import UserError, atomic_write_json, sha256_file
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from tokenizer.errors import TokenizerError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS_DIR = REPO_ROOT / "configs"
_UMASK = os.umask(0)
os.umask(_UMASK)


class UserError(Exception):
    """An error the user can fix: printed as one line (no traceback) and the command exits with status 2."""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what Slurm's --cpus-per-task, taskset or a container
    grant), not the host's count, which `os.cpu_count()` gives even inside a 4-core allocation of a 128-core node."""
    return len(os.sched_getaffinity(0))


def need(ok: bool, message: str) -> None:
    """Raise UserError(message) unless ok: a settings check, one line each."""
    if not ok:
        raise UserError(message)


def run_cli(main: Callable[[], int | None], prog: str) -> int:
    """Run the CLI entry point of command `prog`, turning a `UserError` (or the tokenizer's own `TokenizerError`)
    into one line on stderr, "prog: error: ...", and exit status 2 (named by the command, not by sys.argv[0],
    which reads "cli.py" under `python -m`)."""
    try:
        return int(main() or 0)
    except (UserError, TokenizerError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


WRITE_FIX = "free some space or choose a writable output directory"


def describe_os_error(err: OSError) -> str:
    """'Read-only file system', 'No space left on device, the filesystem is full', ...: the OS's words, no errno
    number."""
    reason = err.strerror or (str(err).splitlines() or [type(err).__name__])[0]
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason += ", the filesystem is full"
    elif err.errno == errno.ENOTDIR:
        reason += ": a part of the path is a file"
    return reason


def write_error(path: str | os.PathLike, err: OSError, fix: str = WRITE_FIX) -> UserError:
    """An OSError met while writing (read-only, full, a file where a directory belongs) as one user-error line."""
    return UserError(f"{err.filename or path}: cannot write ({describe_os_error(err)}); {fix}")


@contextlib.contextmanager
def writing(path: str | os.PathLike, fix: str = WRITE_FIX):
    """Turn an OSError inside the block into `write_error(path, ...)`: `with writing(out_dir): ...`."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err, fix) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, and rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a shard set is meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON, atomically (temp file + rename)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical (sorted, compact) JSON of `obj`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

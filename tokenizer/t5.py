"""T5-layout tokenizers: train a Unigram model, adopt an existing tokenizer.json, load and describe one.

    tok = load_tokenizer("tok/tokenizer.json")   # checks <pad>=0, </s>=1, <unk>=2, <extra_id_0>=V-1 .. <extra_id_99>=V-100

Layout (docs/design.md "Tokenizer"): `<pad>`=0, `</s>`=1, `<unk>`=2, sentinels `<extra_id_0>` .. `<extra_id_99>` at the
top of the vocabulary, `<extra_id_0>` = vocab_size-1, descending. No post-processor adds `</s>`: prep appends
`</s>` once per document itself. This package stands alone (it imports nothing from `pipeline` or `pretrain`):
a problem the user can fix raises `TokenizerError`, one line naming the file and the fix.

An existing DIR/tokenizer.json is never replaced silently: every shard set records its sha256 and retraining gives
other ids. With `overwrite=True` the old file stays beside the new one as tokenizer.json.bak-<sha12>.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import Unigram
from tokenizers.trainers import UnigramTrainer

from tokenizer.errors import TokenizerError

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
NUM_SENTINELS = 100
MIN_VOCAB_SIZE = NUM_SENTINELS + 3 + 16  # the specials, the sentinels and a few pieces
TOKENIZER_FILE = "tokenizer.json"


def sentinel_token(k: int) -> str:
    return f"<extra_id_{k}>"


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def _read(path: Path) -> Tokenizer:
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer file not found; "
                             f"train one with `prep tokenizer --input CORPUS --out DIR`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for unreadable JSON
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(f"{path}: not a readable HF tokenizers JSON file ({first_line}); "
                             f"train one with `prep tokenizer` or pass a tokenizer.json") from None


def layout_problems(tokenizer: Tokenizer) -> list[str]:
    """What keeps `tokenizer` from the T5 layout (empty when it fits)."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    problems = [f"{name} is id {tokenizer.token_to_id(name)}, expected {want}"
                for name, want in ((PAD, PAD_ID), (EOS, EOS_ID), (UNK, UNK_ID)) if tokenizer.token_to_id(name) != want]
    wrong = [k for k in range(NUM_SENTINELS) if tokenizer.token_to_id(sentinel_token(k)) != vocab_size - 1 - k]
    if wrong:
        problems.append(f"{len(wrong)} of the {NUM_SENTINELS} sentinels are missing or misplaced (e.g. "
                        f"{sentinel_token(wrong[0])} is id {tokenizer.token_to_id(sentinel_token(wrong[0]))}, "
                        f"expected {vocab_size - 1 - wrong[0]})")
    return problems


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json (or a directory holding one) and check the T5 layout; `TokenizerError` otherwise.

    Special-token strings inside documents (a literal "<extra_id_0>" in the text) are tokenised as plain text.
    """
    path = _resolve(path)
    tokenizer = _read(path)
    problems = layout_problems(tokenizer)
    if problems:
        raise TokenizerError(f"{path}: not a T5-layout tokenizer ({'; '.join(problems)}); "
                             f"fix it with `prep tokenizer --from {path} --out DIR`")
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_info(path: str | Path) -> dict:
    """The manifest's "tokenizer" section: path, sha256 of the file's bytes, vocab size and special ids."""
    path = _resolve(path)
    tokenizer = load_tokenizer(path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    return {"path": str(path.resolve()), "sha256": tokenizer_sha256(path), "vocab_size": vocab_size,
            "pad_id": PAD_ID, "eos_id": EOS_ID, "unk_id": UNK_ID, "sentinel_first_id": vocab_size - 1,
            "sentinel_last_id": vocab_size - NUM_SENTINELS, "num_sentinels": NUM_SENTINELS}


def _add_sentinels(tokenizer: Tokenizer) -> None:
    """Append `<extra_id_99>` .. `<extra_id_0>` so that `<extra_id_0>` lands on the last id."""
    tokenizer.add_special_tokens([sentinel_token(k) for k in reversed(range(NUM_SENTINELS))])


def tokenizer_sha256(path: str | Path) -> str:
    """Hex sha256 of a tokenizer file's bytes (what every shard set records)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def backup_path(path: str | Path) -> Path:
    """Where `overwrite` keeps an existing tokenizer file: tokenizer.json.bak-<first 12 hex of its sha256>."""
    path = Path(path)
    return path.with_name(f"{path.name}.bak-{tokenizer_sha256(path)[:12]}")


def check_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path | None:
    """Before any training, and without making --out yet: refuse an --out that is a file, is not writable, or holds
    a tokenizer.json (unless `overwrite`). Returns where the existing file will be kept (`backup_path`), or None
    when there is none."""
    out_dir = Path(out_dir)
    path = out_dir / TOKENIZER_FILE
    if out_dir.exists() and not out_dir.is_dir():
        raise TokenizerError(f"{out_dir}: a file, not a directory; --out names the directory for {TOKENIZER_FILE}")
    if path.is_dir():
        raise TokenizerError(f"{path}: a directory where the tokenizer file belongs; choose another --out")
    existing = path.is_file()
    if existing and not overwrite:
        raise TokenizerError(
            f"{path}: a tokenizer is already there (sha256 {tokenizer_sha256(path)[:12]}...); every shard set made "
            f"with it needs this exact file and a new one gives other ids; choose another --out, or pass "
            f"--overwrite to replace it (the old file is kept as {backup_path(path).name})")
    # probed where it exists: a run that fails before saving leaves no empty --out
    nearest = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if not nearest.is_dir():
        raise TokenizerError(f"{nearest}: a file, not a directory; --out {out_dir} cannot be made under it")
    try:
        probe = nearest / f".{TOKENIZER_FILE}.{os.getpid()}.probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise TokenizerError(f"{err.filename or out_dir}: cannot write ({err.strerror or err}); choose a writable "
                             f"--out") from None
    return backup_path(path) if existing else None


def _save(tokenizer: Tokenizer, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write DIR/tokenizer.json under a temp name, fsync it and rename it into place; check it as we hand it out.
    An existing, different file there is refused, or with `overwrite` kept as `backup_path` first."""
    backup = check_out_dir(out_dir, overwrite)
    path = Path(out_dir) / TOKENIZER_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tokenizer.save(str(tmp), pretty=True)
        except Exception as err:  # tokenizers raises a bare Exception: "No space left on device (os error 28)"
            if type(err) is not Exception:
                raise
            raise OSError(str(err)) from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if backup is not None and tokenizer_sha256(tmp) != tokenizer_sha256(path) and not backup.exists():
            shutil.copy2(path, backup)  # the old bytes stay under their sha256's name; the rename below is atomic
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise TokenizerError(f"{err.filename or path}: cannot write ({err.strerror or err}); free some space or "
                             f"choose a writable --out") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    load_tokenizer(path)  # the file we hand out must pass our own check
    return path


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, *, length: int | None = None,
                    show_progress: bool = True, overwrite: bool = False) -> Path:
    """Train a Unigram tokenizer on a stream of documents and save DIR/tokenizer.json in the T5 layout.

    `texts` is consumed lazily (the trainer keeps word counts, not the corpus). `vocab_size` includes the
    three specials and the 100 sentinels. A corpus too small to fill the vocabulary is a `TokenizerError`, and so
    is an existing DIR/tokenizer.json unless `overwrite` (checked before training; the old file is kept).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small; it must hold 3 specials, {NUM_SENTINELS} "
                             f"sentinels and some pieces (use >= {MIN_VOCAB_SIZE}; T5 uses 32000)")
    check_out_dir(out_dir, overwrite)
    tokenizer = Tokenizer(Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = UnigramTrainer(vocab_size=vocab_size - NUM_SENTINELS, special_tokens=[PAD, EOS, UNK],
                             unk_token=UNK, show_progress=show_progress, shrinking_factor=0.75, max_piece_length=16)
    try:
        tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    except Exception as err:  # the trainer's own errors are a bare Exception; the readers' pass through as they are
        if "not large enough to contain all chars" not in str(err):
            raise
        raise TokenizerError(f"--vocab-size {vocab_size} is too small for this text: the Unigram trainer needs a "
                             f"piece for every character it saw, more than the {vocab_size - NUM_SENTINELS - 3} left "
                             f"after the specials and sentinels; use a larger --vocab-size") from None
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    if learned != vocab_size - NUM_SENTINELS:
        fillable = learned + NUM_SENTINELS  # advised only where it is a size train_tokenizer accepts
        raise TokenizerError(f"the training corpus yields only {learned} pieces, fewer than the "
                             f"{vocab_size - NUM_SENTINELS} needed for --vocab-size {vocab_size}; give more text" +
                             (f" or lower --vocab-size to {fillable}" if fillable >= MIN_VOCAB_SIZE else
                              f" (even the smallest --vocab-size, {MIN_VOCAB_SIZE}, needs "
                              f"{MIN_VOCAB_SIZE - NUM_SENTINELS} pieces)"))
    _add_sentinels(tokenizer)
    return _save(tokenizer, out_dir, overwrite)


def adopt_tokenizer(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Copy an existing tokenizer.json into DIR, adding the 100 sentinels on top when none are present.

    `<pad>`, `</s>` and `<unk>` must already be ids 0, 1, 2 (ids cannot move without retraining a model).
    A post-processor that would append `</s>` is dropped (prep appends `</s>` per document).
    """
    source = _resolve(source)
    tokenizer = _read(source)
    present = [k for k in range(NUM_SENTINELS) if tokenizer.token_to_id(sentinel_token(k)) is not None]
    if not present:
        _add_sentinels(tokenizer)
    problems = layout_problems(tokenizer)
    if problems:
        raise TokenizerError(f"{source}: cannot adopt this tokenizer into the T5 layout ({'; '.join(problems)}); "
                             f"train a new one with `prep tokenizer --input CORPUS`")
    spec = json.loads(tokenizer.to_str())
    spec["post_processor"] = None
    return _save(Tokenizer.from_str(json.dumps(spec)), out_dir, overwrite)

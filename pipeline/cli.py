"""The `prep` command: tokenizer, corpus (on Ray), inspect, verify, sample-corpus.

    prep sample-corpus --out corpus/ && prep tokenizer --input corpus/ --vocab-size 8000 --out tok/ \
        && prep corpus --input corpus/ --tokenizer tok/tokenizer.json --out shards/demo && prep inspect shards/demo

The word `sample` as an --input stands for the built-in sample corpus (written once to the user cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from pipeline.common import UserError, run_cli, writing
from pipeline.config import CorpusConfig, TokenizerConfig, require_at_least
from pipeline.settings import add_flags, build_settings, field_names, flag_name, merged_settings

SAMPLE_WORD = "sample"
MIN_SAMPLE_BYTES = 10_000  # a few documents; less is nothing a tokenizer or prep corpus can use


def _sample_corpus_path() -> str:
    from pipeline.sample_corpus import SAMPLE_FILE, write_sample_corpus

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t5zero" / "sample_corpus"
    path = cache / SAMPLE_FILE
    if not path.is_file():
        with writing(cache, fix="set XDG_CACHE_HOME to a writable directory, or pass corpus files to --input"):
            write_sample_corpus(cache)
    return str(path)


def _inputs(values: list[str]) -> list[str]:
    return [_sample_corpus_path() if v == SAMPLE_WORD and not os.path.exists(v) else v for v in values]


def cmd_sample_corpus(args: argparse.Namespace) -> int:
    """Write the built-in sample corpus (Python's own documentation text, no download) as DIR/sample.jsonl."""
    from pipeline.sample_corpus import SAMPLE_FILE, write_sample_corpus

    if args.max_bytes is not None:  # 0 wrote an empty corpus after reading the whole standard library
        require_at_least("--max-bytes", args.max_bytes, MIN_SAMPLE_BYTES)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: a file, not a directory; --out names the directory for {SAMPLE_FILE}")
    existed = (out / SAMPLE_FILE).is_file()  # kept only when it holds these very bytes
    with writing(out / SAMPLE_FILE, fix="free some space or choose a writable --out"):
        path, documents, size = write_sample_corpus(out, max_bytes=args.max_bytes)
    print(f"{'unchanged' if existed else 'wrote'} {path}: {documents:,} documents, {size:,} bytes")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """Train a T5-layout Unigram tokenizer on a corpus (streamed), or adopt an existing tokenizer.json (--from).

    Layout: <pad>=0, </s>=1, <unk>=2, <extra_id_0>=vocab_size-1 .. <extra_id_99>=vocab_size-100.
    """
    from pipeline.readers import RejectCounter, iter_corpus_texts
    from tokenizer.t5 import adopt_tokenizer, check_out_dir, tokenizer_info, train_tokenizer

    config = config_from_args(TokenizerConfig, args)
    started = time.perf_counter()
    backup = check_out_dir(config.out, config.overwrite)  # before minutes of training
    if config.from_file:
        path = adopt_tokenizer(config.from_file, config.out, overwrite=config.overwrite)
    else:
        rejected = RejectCounter()
        texts = iter_corpus_texts(_inputs(config.input), config.text_field, config.max_doc_chars, rejected)
        path = train_tokenizer(_capped(texts, config.max_bytes), config.vocab_size, config.out, show_progress=True,
                               overwrite=config.overwrite)
        skipped = {k: v for k, v in rejected.items() if v}
        if skipped:
            print(f"skipped records: {skipped}")
    info = tokenizer_info(path)
    if backup is not None and backup.is_file():
        print(f"kept the previous {path.name} as {backup} (shard sets made with it need that file)")
    print(f"wrote {path}: vocab {info['vocab_size']:,}, <extra_id_0>={info['sentinel_first_id']}, "
          f"sha256 {info['sha256'][:12]}... ({time.perf_counter() - started:.1f}s)")
    return 0


def _capped(texts, max_bytes: int | None):
    """The texts until `max_bytes` of UTF-8 have been yielded (bytes, as the flag says; it counted characters)."""
    if max_bytes is None:
        yield from texts
        return
    total = 0
    for text in texts:
        if total >= max_bytes:
            return
        total += len(text.encode("utf-8"))
        yield text


def cmd_corpus(args: argparse.Namespace) -> int:
    """Tokenise a corpus on Ray into T5 span-corruption Arrow shards + manifest (resumable, deterministic).

    Inputs: .jsonl/.jsonl.gz/.jsonl.zst (one JSON object per line), .txt (one document per line; blank lines
    skipped), .parquet, datasets save_to_disk directories; paths, directories and globs.
    Settings: flags over `--config FILE` (a YAML mapping of these flags' names, e.g. configs/prep/sample.yaml)
    over the defaults shown here.
    """
    from pipeline.corpus import build_shards
    from pipeline.shardset import summary_lines

    config = config_from_args(CorpusConfig, args)
    result = build_shards(dataclasses.replace(config, input=_inputs(config.input)))
    if result.already_complete:
        print(f"{result.out}: already complete (fingerprint {result.manifest['fingerprint'][:12]}..., "
              f"{result.totals['shards']} shards verified); nothing to do")
        return 0
    print("\n".join(summary_lines(result.manifest)))
    tokens_per_s = result.totals["tokens"] / max(result.seconds, 1e-9)
    print(f"units         {result.units_run} run, {result.units_total - result.units_run} already done")
    print(f"time          {result.seconds:.1f}s, {tokens_per_s:,.0f} tokens/s")
    print(f"wrote {result.out / 'manifest.json'}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print a shard set's manifest summary and decode a few examples (inputs and targets side by side)."""
    from pipeline.shard_format import read_manifest
    from pipeline.shardset import decoded_examples, summary_lines

    require_at_least("--examples", args.examples, 0)  # a negative count decoded every example
    manifest = read_manifest(args.shard_dir)
    print("\n".join(summary_lines(manifest)))
    for k, (inputs, labels) in enumerate(decoded_examples(args.shard_dir, args.examples, args.tokenizer)):
        print(f"\n--- example {k}\ninputs : {inputs}\ntargets: {labels}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Recompute every shard's checksum, size, schema and row count; exit 1 naming the first bad or missing shard."""
    from pipeline.shardset import verify_shard_set

    shard_dir = Path(args.shard_dir)
    checked = 0
    for path, problem in verify_shard_set(shard_dir, progress=not args.quiet):
        if problem:
            print(f"prep verify: {shard_dir / path}: {problem}; rerun `prep corpus` with the same arguments "
                  f"to rebuild it", file=sys.stderr)
            return 1
        checked += 1
    print(f"{shard_dir}: ok, {checked} shards verified")
    return 0


def config_from_args(cls: type, args: argparse.Namespace):
    """The settings of one command: its flags over `--config FILE` over the defaults. A required setting given
    nowhere is argparse's own error (usage + exit 2); a bad value in the file is a `UserError` naming it."""
    names = field_names(cls)
    given = {name: value for name, value in vars(args).items() if name in names or name == "config"}
    command = f"prep {args.command}"
    values = merged_settings(cls, given, command=command)
    missing = [flag_name(f.name) for f in dataclasses.fields(cls) if f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        args.parser.error(f"the following arguments are required: {', '.join(missing)}")
    return build_settings(cls, values, where=args.config or command)


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a YAML mapping of the settings below, keyed by flag name (with - or _); "
                             "flags given here win over it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, func):
        p = sub.add_parser(name, help=func.__doc__.splitlines()[0], description=func.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func, parser=p)
        return p

    p = add("tokenizer", cmd_tokenizer)
    _add_config_flag(p)
    add_flags(p, TokenizerConfig)
    from_file = next(f for f in dataclasses.fields(TokenizerConfig) if f.name == "from_file")
    p.add_argument("--from", dest="from_file", default=argparse.SUPPRESS, help=from_file.metadata["help"])

    p = add("corpus", cmd_corpus)
    _add_config_flag(p)
    add_flags(p, CorpusConfig)

    p = add("inspect", cmd_inspect)
    p.add_argument("shard_dir", help="a shard set directory (holding manifest.json)")
    p.add_argument("--examples", type=int, default=3, help="how many examples to decode, 0 for the summary only "
                                                           "(default %(default)s)")
    p.add_argument("--tokenizer", default=None, help="decode with this file (default: the manifest's)")

    p = add("verify", cmd_verify)
    p.add_argument("shard_dir", help="a shard set directory (holding manifest.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = add("sample-corpus", cmd_sample_corpus)
    p.add_argument("--out", required=True, help="directory for sample.jsonl")
    p.add_argument("--max-bytes", type=int, default=None, help="stop before the file grows past this many bytes "
                   f"(at least {MIN_SAMPLE_BYTES:,}; default: the whole corpus)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.func(args), "prep")


if __name__ == "__main__":
    sys.exit(main())

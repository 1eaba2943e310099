"""The `prep` command: tokenizer, corpus (on Ray), inspect, verify, sample-corpus.

    prep sample-corpus --out corpus/ && prep tokenizer --input corpus/ --vocab-size 8000 --out tok/ \
        && prep corpus --input corpus/ --tokenizer tok/tokenizer.json --out shards/demo && prep inspect shards/demo

The word `sample` as an --input stands for the built-in sample corpus (written once to the user cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipeline.common import UserError, run_cli
from pipeline.corpus import DEFAULT_UNIT_BYTES

SAMPLE_WORD = "sample"


def _sample_corpus_path() -> str:
    from pipeline.sample_corpus import SAMPLE_FILE, write_sample_corpus

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "t5zero" / "sample_corpus"
    path = cache / SAMPLE_FILE
    if not path.is_file():
        write_sample_corpus(cache)
    return str(path)


def _inputs(values: list[str]) -> list[str]:
    return [_sample_corpus_path() if v == SAMPLE_WORD and not os.path.exists(v) else v for v in values]


def cmd_sample_corpus(args: argparse.Namespace) -> int:
    """Write the built-in sample corpus (Python's own documentation text, no download) as DIR/sample.jsonl."""
    from pipeline.sample_corpus import write_sample_corpus

    path, documents, size = write_sample_corpus(args.out, max_bytes=args.max_bytes)
    print(f"wrote {path}: {documents:,} documents, {size:,} bytes")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """Train a T5-layout Unigram tokenizer on a corpus (streamed), or adopt an existing tokenizer.json (--from).

    Layout: <pad>=0, </s>=1, <unk>=2, <extra_id_0>=vocab_size-1 .. <extra_id_99>=vocab_size-100.
    """
    from pipeline.readers import RejectCounter, iter_corpus_texts
    from tokenizer.t5 import adopt_tokenizer, tokenizer_info, train_tokenizer

    started = time.perf_counter()
    if args.from_file:
        if args.input:
            raise UserError("pass either --from FILE (adopt a tokenizer) or --input PATH (train one), not both")
        path = adopt_tokenizer(args.from_file, args.out)
    else:
        if not args.input:
            raise UserError("nothing to train on: pass --input PATH (or `--input sample`), or --from FILE")
        rejected = RejectCounter()
        texts = iter_corpus_texts(_inputs(args.input), args.text_field, args.max_doc_chars, rejected)
        path = train_tokenizer(_capped(texts, args.max_bytes), args.vocab_size, args.out, show_progress=True)
        skipped = {k: v for k, v in rejected.items() if v}
        if skipped:
            print(f"skipped records: {skipped}")
    info = tokenizer_info(path)
    print(f"wrote {path}: vocab {info['vocab_size']:,}, <extra_id_0>={info['sentinel_first_id']}, "
          f"sha256 {info['sha256'][:12]}... ({time.perf_counter() - started:.1f}s)")
    return 0


def _capped(texts, max_bytes: int | None):
    total = 0
    for text in texts:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(text)
        yield text


def cmd_corpus(args: argparse.Namespace) -> int:
    """Tokenise a corpus on Ray into T5 span-corruption Arrow shards + manifest (resumable, deterministic).

    Inputs: .jsonl/.jsonl.gz/.jsonl.zst (one JSON object per line), .txt (one document per line; blank lines
    skipped), .parquet, datasets save_to_disk directories; paths, directories and globs.
    """
    from pipeline.corpus import PrepConfig, build_shards
    from pipeline.shardset import summary_lines

    config = PrepConfig(inputs=_inputs(args.input), tokenizer=args.tokenizer, out=args.out,
                        input_length=args.input_length, noise_density=args.noise_density,
                        mean_noise_span_length=args.mean_span_length, seed=args.seed, shard_rows=args.shard_rows,
                        text_field=args.text_field, max_doc_chars=args.max_doc_chars, unit_bytes=args.unit_bytes,
                        workers=args.workers, ray_address=args.ray_address, overwrite=args.overwrite,
                        progress=not args.quiet)
    result = build_shards(config)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, func):
        p = sub.add_parser(name, help=func.__doc__.splitlines()[0], description=func.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = add("tokenizer", cmd_tokenizer)
    p.add_argument("--input", nargs="+", help="corpus files/dirs/globs (or `sample`)")
    p.add_argument("--from", dest="from_file", help="adopt this tokenizer.json instead of training")
    p.add_argument("--vocab-size", type=int, default=32000, help="total vocabulary incl. specials and sentinels")
    p.add_argument("--out", required=True, help="directory for tokenizer.json")
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-doc-chars", type=int, default=1_000_000)
    p.add_argument("--max-bytes", type=int, default=None, help="train on at most this many characters")

    p = add("corpus", cmd_corpus)
    p.add_argument("--input", nargs="+", required=True, help="corpus files/dirs/globs (or `sample`)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json in the T5 layout")
    p.add_argument("--out", required=True, help="shard set directory")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Ray workers (CPUs of the local cluster)")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--input-length", type=int, default=512)
    p.add_argument("--noise-density", type=float, default=0.15)
    p.add_argument("--mean-span-length", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-rows", type=int, default=None, help="rows per shard (default: about 64 MiB)")
    p.add_argument("--unit-bytes", type=int, default=DEFAULT_UNIT_BYTES,
                   help="input bytes per work unit (part of the fingerprint; independent of --workers)")
    p.add_argument("--max-doc-chars", type=int, default=1_000_000, help="longer documents are skipped (too_long)")
    p.add_argument("--overwrite", action="store_true", help="replace a different shard set in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = add("inspect", cmd_inspect)
    p.add_argument("shard_dir")
    p.add_argument("--examples", type=int, default=3)
    p.add_argument("--tokenizer", default=None, help="decode with this file (default: the manifest's)")

    p = add("verify", cmd_verify)
    p.add_argument("shard_dir")
    p.add_argument("--quiet", action="store_true")

    p = add("sample-corpus", cmd_sample_corpus)
    p.add_argument("--out", required=True, help="directory for sample.jsonl")
    p.add_argument("--max-bytes", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""Look at and check a finished shard set: `prep inspect` (summary + decoded examples) and `prep verify` (checksums).

    problems = [p for _, p in verify_shard_set("shards/demo") if p]     # [] when every shard is intact
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from pipeline.common import UserError, sha256_file
from pipeline.shard_format import ShardProblem, map_shard, read_manifest, read_shard_arrays, shard_file_problem


def verify_shard_set(shard_dir: str | Path, progress: bool = False) -> Iterator[tuple[str, str | None]]:
    """Yield (shard path, problem or None) for every shard of the manifest: presence, size, sha256, schema, rows."""
    from tqdm import tqdm

    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    config = manifest["config"]
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prep verify", disable=not progress) as bar:
        for shard in manifest["shards"]:
            yield shard["path"], _shard_problem(shard_dir, shard, config)
            bar.update(shard["bytes"])


def _shard_problem(shard_dir: Path, shard: dict, config: dict) -> str | None:
    problem = shard_file_problem(shard_dir, shard)
    if problem:
        return problem
    try:
        map_shard(shard_dir / shard["path"], config["input_length"], config["target_length"], rows=shard["rows"])
    except ShardProblem as err:
        return err.problem
    return None


def summary_lines(manifest: dict) -> list[str]:
    """Human-readable summary of a manifest (also printed at the end of `prep corpus`)."""
    config, totals, tok = manifest["config"], manifest["totals"], manifest["tokenizer"]
    rejected = {k: v for k, v in manifest["rejected"].items() if v}
    return [
        f"fingerprint   {manifest['fingerprint']}",
        f"lengths       input_length {config['input_length']}, target_length {config['target_length']}, "
        f"raw_length {config['raw_length']} (noise_density {config['noise_density']}, "
        f"mean_noise_span_length {config['mean_noise_span_length']}, seed {config['seed']})",
        f"tokenizer     {tok['path']} (vocab {tok['vocab_size']}, sha256 {tok['sha256'][:12]}...)",
        f"inputs        {len(manifest['inputs'])} file(s), {sum(i['bytes'] for i in manifest['inputs']):,} bytes",
        f"documents     {totals['documents']:,}",
        f"tokens        {totals['tokens']:,} (dropped tails {totals['dropped_tail_tokens']:,})",
        f"examples      {totals['examples']:,}",
        f"shards        {totals['shards']:,} ({totals['bytes'] / 2**20:,.1f} MiB)",
        f"rejected      {sum(rejected.values()):,}" + (f" ({', '.join(f'{k} {v:,}' for k, v in sorted(rejected.items()))})"
                                                     if rejected else ""),
    ]


def decoded_examples(shard_dir: str | Path, count: int, tokenizer_path: str | None = None) -> list[tuple[str, str]]:
    """(inputs, labels) text of the first `count` examples, sentinels shown as <extra_id_k>."""
    from tokenizer.t5 import load_tokenizer

    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    path = tokenizer_path or manifest["tokenizer"]["path"]
    if not Path(path).is_file():
        raise UserError(f"{path}: the manifest's tokenizer is gone; pass --tokenizer FILE to decode examples")
    if sha256_file(path) != manifest["tokenizer"]["sha256"]:
        raise UserError(f"{path}: not the tokenizer these shards were built with (sha256 differs); "
                        f"pass the right one with --tokenizer")
    tokenizer = load_tokenizer(path)
    pad_id = manifest["tokenizer"]["pad_id"]
    pairs = []
    for shard in manifest["shards"]:
        inputs, labels = read_shard_arrays(shard_dir / shard["path"])
        for inp, lab in zip(inputs, labels):
            if len(pairs) == count:
                return pairs
            pairs.append((tokenizer.decode(inp[inp != pad_id].tolist(), skip_special_tokens=False),
                          tokenizer.decode(lab[lab != pad_id].tolist(), skip_special_tokens=False)))
    return pairs


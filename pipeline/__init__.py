"""Corpus -> span-corruption Arrow shards, executed on Ray (`prep`); callers import from the submodules.

    prep corpus --input corpus/*.jsonl.zst --tokenizer tok/tokenizer.json --out shards/c4 --config configs/prep/sample.yaml
"""

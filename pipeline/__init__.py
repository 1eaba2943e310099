"""Corpus -> span-corruption Arrow shards, executed on Ray.

    prep corpus --input corpus/*.jsonl.zst --tokenizer tok/tokenizer.json --out shards/c4
"""

__version__ = "0.1.0"

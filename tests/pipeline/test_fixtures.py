"""The shared session fixtures hold what other packages' tests rely on."""

from pipeline.shard_format import read_manifest, read_shard_arrays
from tokenizer.t5 import load_tokenizer


def test_tiny_shards_fit_the_tiny_tokenizer(tiny_shards, tiny_tokenizer, sample_corpus):
    assert sample_corpus.stat().st_size > 200_000
    tokenizer = load_tokenizer(tiny_tokenizer)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 1024
    manifest = read_manifest(tiny_shards)
    assert manifest["config"]["input_length"] == 128 and manifest["config"]["target_length"] == 29
    assert manifest["totals"]["examples"] >= 400
    assert manifest["tokenizer"]["vocab_size"] == 1024
    rows = 0
    for shard in manifest["shards"]:
        inputs, labels = read_shard_arrays(tiny_shards / shard["path"])
        assert inputs.shape[1] == 128 and labels.shape[1] == 29
        assert inputs.max() < 1024 and labels.min() >= 1
        rows += len(inputs)
    assert rows == manifest["totals"]["examples"]

"""T5-layout tokenizers: training, adoption (--from), loading and its error messages."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tokenizer.t5 import TokenizerError, adopt_tokenizer, load_tokenizer, tokenizer_info, train_tokenizer


def test_trained_tokenizer_has_the_t5_layout(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer)
    assert [tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert tok.token_to_id("<extra_id_0>") == 1023 and tok.token_to_id("<extra_id_99>") == 924
    info = tokenizer_info(tiny_tokenizer)
    assert info["vocab_size"] == 1024 and info["sentinel_first_id"] == 1023 and info["sentinel_last_id"] == 924
    assert len(info["sha256"]) == 64


def test_no_eos_added_and_literal_sentinels_are_text(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer)
    ids = tok.encode("Return the value <extra_id_0> here.").ids
    assert ids and ids[-1] != 1 and max(ids) < 924  # no </s> appended, no sentinel from plain text
    assert tok.decode(tok.encode("Return the value.").ids) == "Return the value."


def test_too_small_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="fewer than"):
        train_tokenizer(iter(["tiny corpus"] * 3), 4000, tmp_path, show_progress=False)


def test_too_small_corpus_never_advises_a_vocab_size_below_the_smallest(tmp_path):
    """6 pieces fill a vocabulary of 106, which train_tokenizer refuses: the advice was to lower --vocab-size to it."""
    with pytest.raises(TokenizerError, match=r"more text \(even the smallest --vocab-size, 119, needs 19 pieces\)"):
        train_tokenizer(iter(["ab ab ab"]), 1024, tmp_path, show_progress=False)
    with pytest.raises(TokenizerError, match="or lower --vocab-size to 130"):
        train_tokenizer(iter(["the quick brown fox jumps over the lazy dog"] * 3), 1024, tmp_path, show_progress=False)


def test_more_characters_than_the_vocab_size_holds_is_a_clear_error(tmp_path):
    """The Unigram trainer's bare Exception ("not large enough to contain all chars") was a traceback."""
    text = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 300))  # 300 distinct characters
    with pytest.raises(TokenizerError, match="--vocab-size 200 is too small for this text.*use a larger --vocab-size"):
        train_tokenizer(iter([text] * 3), 200, tmp_path, show_progress=False)
    assert not (tmp_path / "tokenizer.json").exists()


def _plain_tokenizer(path, with_post_processor=True):
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(path))
    return path


def test_adopt_adds_sentinels_and_drops_eos_post_processor(tmp_path):
    source = _plain_tokenizer(tmp_path / "plain.json")
    with pytest.raises(TokenizerError, match="sentinels"):
        load_tokenizer(source)
    adopted = adopt_tokenizer(source, tmp_path / "out")
    tok = load_tokenizer(adopted)
    assert tok.get_vocab_size(with_added_tokens=True) == 105
    assert tok.token_to_id("<extra_id_0>") == 104 and tok.token_to_id("<extra_id_99>") == 5
    assert tok.encode("hello world").ids == [3, 4]
    # adopting an already adopted tokenizer changes nothing
    again = adopt_tokenizer(adopted, tmp_path / "again")
    assert json.loads(again.read_text())["model"] == json.loads(adopted.read_text())["model"]


def test_adopt_refuses_specials_at_other_ids(tmp_path):
    tok = Tokenizer(models.WordLevel({"hello": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.save(str(tmp_path / "bad.json"))
    with pytest.raises(TokenizerError, match="cannot adopt"):
        adopt_tokenizer(tmp_path / "bad.json", tmp_path / "out")


def test_unreadable_and_missing_files(tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="garbage.json: not a readable"):
        load_tokenizer(tmp_path / "garbage.json")
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")


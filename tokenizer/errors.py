"""The tokenizer's one error type, in a module of its own so that a CLI can catch it without loading `tokenizers`.

    raise TokenizerError(f"{path}: tokenizer file not found; pass the tokenizer.json written by `prep tokenizer`")
"""


class TokenizerError(ValueError):
    """A tokenizer problem the user can fix (missing or unreadable file, wrong layout, too small a corpus)."""

"""Train, adopt and load T5-layout tokenizers (Unigram, `<pad>`=0, `</s>`=1, `<unk>`=2, 100 sentinels on top).

    prep tokenizer --input corpus.jsonl --vocab-size 32000 --out tok/
"""

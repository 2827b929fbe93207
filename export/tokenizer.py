"""A byte-level tokenizer for checkpoints that come without one (the random presets).

Ids 0-3 are <pad>, <bos>, <eos>, <mask>; ids 4-259 are the 256 bytes (no
merges), so any text round-trips. Written as a Hugging Face `tokenizer.json`.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>", "<mask>")
N_IDS = len(SPECIALS) + 256


def write_byte_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path))

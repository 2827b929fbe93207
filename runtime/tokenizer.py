"""Text <-> token ids for `mg-run --prompt` and JSONL `prompt` requests.

Wraps a Hugging Face `tokenizer.json` from the artifact. The BOS rule is the
checkpoint's: when the manifest declares a `bos_id`, encoded text starts with
it (token-id requests are used verbatim and never get one). Knows nothing
about models or caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


class TextCodec:
    def __init__(self, path: Path, bos_id: Optional[int]):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ValueError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0]})") from None
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

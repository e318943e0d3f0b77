"""Incremental detokenization: the text each new token adds, without re-decoding everything.

Decoding one token alone is wrong for byte-level BPE (a multi-byte character spans tokens, and
some tokenizers drop a leading space when a token is decoded on its own), so, as vLLM does, we
decode a short window that starts a few tokens back and emit only what goes beyond the text of
the window's already-emitted part. A window ending in U+FFFD is an incomplete character: wait.
"""

from __future__ import annotations

from typing import Any

# Tokens of context kept in front of the unread ones; enough for any merge that affects spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = len(token_ids)               # tokens already turned into text
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: list[int]) -> str:
        """Consumes token_ids[read_offset:] (the tokens appended since the last call); returns the
        new text, which has also been added to `self.text`."""
        window = token_ids[self.prefix_offset:]
        known = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(window)
        if len(full) <= len(known) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(known):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        self.text += new_text
        return new_text


def final_text(tokenizer: Any, seq: Any) -> str:
    """The completion text of a finished sequence.

    A stop string already cut the incrementally built text; otherwise decode the output once
    (cheaper than detokenizing every step when nothing needs the text early). A stop token
    (EOS or stop_token_ids) stays in token_ids but not in the text, unless asked for."""
    if tokenizer is None:
        return ""
    if isinstance(seq.stop_reason, str):
        return seq.text
    params = seq.params
    ids = seq.output_token_ids
    if seq.finish_reason == "stop" and not params.include_stop_str_in_output and ids and (
            ids[-1] == seq.stop_reason or ids[-1] in seq.group.eos_token_ids):
        ids = ids[:-1]   # not after a completed grammar: its last token is text
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

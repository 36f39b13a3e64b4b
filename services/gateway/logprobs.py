"""Log-probabilities in the OpenAI shapes: chat's `logprobs.content[]` (token, logprob, bytes,
top_logprobs) and completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token's `bytes` are exactly what it adds to the output (a byte-level BPE token's bytes, a
SentencePiece `<0xE2>` byte token's one byte), so a client can join a character split over tokens;
its `token` is those bytes as text, a partial UTF-8 character replaced by U+FFFD, as OpenAI's is.
"""

from __future__ import annotations

import functools
import json
import re

from common.protocol import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the characters byte-level BPE writes bytes as."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Each token id's bytes and text under one tokenizer, computed once per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        self.byte_level = _is_byte_level(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(token text, its UTF-8 bytes as a list of ints)."""
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special:
            return piece.encode()
        if self.byte_level:
            table = _byte_level_inverse()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", []) or [])


def chat_content(text_of: TokenText, ids: list[int], logprobs: list[TokenLogprob | None]) -> list[dict]:
    """`choices[].logprobs.content` entries for these tokens (those whose logprobs are known)."""
    out = []
    for token, lp in zip(ids, logprobs, strict=True):
        if lp is None:
            continue
        text, raw = text_of(token)
        top = []
        for other, value in lp.top:
            other_text, other_raw = text_of(other)
            top.append({"token": other_text, "logprob": value, "bytes": other_raw})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(
    text_of: TokenText, ids: list[int], logprobs: list[TokenLogprob | None], offset: int
) -> dict:
    """A completion choice's `logprobs` for these tokens, whose text starts at character `offset`
    of the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in zip(ids, logprobs, strict=True):
        text, _ = text_of(token)
        tokens.append(text)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else {text_of(t)[0]: v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

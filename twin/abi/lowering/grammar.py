"""Grammar masks (serving-contract.md §5.8): 808-token segments in 1024 bits of int16 words.

Token t lives in segment t // 808 at bit t mod 808, little-endian bit order inside the words;
bits 808..1023 of each segment are padding set to 1.  The last word of segment 0 (bits
1008..1023, outside the vocabulary bits) is the row-mode header: -1 plain argmax, 0 apply the
mask.  Unconstrained rows are all -1 (the device-resident default); `valid_draft_counts`
defaults to 7.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import constants as C
from .context import DispatchError

SEG_TOKENS = C.GRAMMAR_SEGMENT_TOKENS
SEG_BITS = C.GRAMMAR_SEGMENT_BITS
WORDS = C.GRAMMAR_WORDS_PER_SEGMENT
HEADER_WORD = WORDS - 1
PLAIN, MASKED = -1, 0


@dataclass(frozen=True)
class Constraint:
    """A constrained request's mask rows and (decode) grammar-valid draft prefix.

    `masks`: bool [rows, vocab] of allowed tokens, or XGrammar's int32 bitmask [rows, ceil(vocab/32)].
    Prefill stages row 0; fused decode stages rows 0..valid_drafts (the valid prefix plus the bonus)."""

    masks: np.ndarray
    valid_drafts: int = C.DSPARK_QUERY_WIDTH

    def allowed(self, vocab: int) -> np.ndarray:
        m = np.asarray(self.masks)
        if m.ndim == 1:
            m = m[None]
        if m.dtype == np.bool_:
            if m.shape[-1] != vocab:
                raise DispatchError("grammar", "masks", "shape", m.shape, f"[rows, vocab={vocab}]")
            return m
        words = -(-vocab // 32)
        if m.shape[-1] != words:
            raise DispatchError("grammar", "masks", "shape", m.shape, f"bool [rows, {vocab}] or int32 [rows, {words}]")
        bits = np.unpackbits(np.ascontiguousarray(m.astype("<i4")).view(np.uint8), axis=-1, bitorder="little")
        return bits[:, :vocab].astype(bool)

    def rows(self, model) -> np.ndarray:
        return pack_rows(self.allowed(model.vocab_size), model.grammar_segments)


def pack_rows(allowed: np.ndarray, segments: int) -> np.ndarray:
    """bool [n, vocab] -> int16 [n, segments, 64] with padding bits 1 and the header set to 0."""
    a = np.asarray(allowed, dtype=bool)
    n, vocab = a.shape
    if vocab > segments * SEG_TOKENS:
        raise DispatchError("grammar", "masks", "shape", vocab, f"<= {segments} x {SEG_TOKENS} tokens")
    empty = ~a.any(axis=1)
    if empty.any():
        raise DispatchError("grammar", "grammar_mask", "grammar_empty", f"row {int(np.argmax(empty))}",
                            "at least one allowed token per constrained row (the staged rows roll back to -1)")
    bits = np.zeros((n, segments, SEG_BITS), np.uint8)
    flat = np.zeros((n, segments * SEG_TOKENS), np.uint8)
    flat[:, :vocab] = a
    bits[:, :, :SEG_TOKENS] = flat.reshape(n, segments, SEG_TOKENS)
    bits[:, :, SEG_TOKENS:] = 1
    words = np.packbits(bits, axis=-1, bitorder="little").view("<i2").astype(np.int16)
    words[:, 0, HEADER_WORD] = MASKED
    return words


def unpack_allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """int16 [..., segments, 64] -> bool [..., vocab] (the vocabulary bits only)."""
    w = np.ascontiguousarray(np.asarray(words, dtype=np.int16)).astype("<i2")
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    seg = bits.reshape(w.shape[:-1] + (SEG_BITS,))[..., :SEG_TOKENS]
    return seg.reshape(w.shape[:-2] + (-1,))[..., :vocab].astype(bool)


def row_mode(words: np.ndarray) -> np.ndarray:
    return np.asarray(words)[..., 0, HEADER_WORD]


def stage_rows(mask: np.ndarray, targets: dict, program: str) -> None:
    """Write packed rows at {(rank, row): int16 [k, segments, 64]} (k consecutive rows)."""
    for (rank, row), packed in targets.items():
        k = packed.shape[0]
        if row + k > mask.shape[1]:
            raise DispatchError(program, "grammar_mask", "grammar_row", f"rows {row}..{row + k - 1}",
                                f"logit rows < {mask.shape[1]}")
        mask[rank, row:row + k] = packed


def padding_ok(mask: np.ndarray) -> np.ndarray:
    """Per row [..., segments, 64] -> bool [...]: every padding bit 808..1023 of every segment set
    (the header word of segment 0 aside).  Works on words, so a FLASH mask is cheap to check."""
    w = np.asarray(mask).view(np.uint16)
    first_word, first_bit = divmod(SEG_TOKENS, 16)
    part = np.uint16((0xFFFF << first_bit) & 0xFFFF)
    ok = (w[..., first_word] & part) == part
    full = w[..., first_word + 1:] == 0xFFFF
    full[..., 0, -1] = True
    return ok.all(axis=-1) & full.all(axis=(-1, -2))

"""Long text tokenized in pieces, so one huge prompt costs an API server its ids, not a gigabyte.

`tokenizers.Tokenizer.encode_batch_fast` of one text holds ~450 bytes per token while it works: an 8 MB
/tokenize of plain words (1.8 million tokens) took an API server from 120 MB to 910 MB, three at once to
1.8 GB, and its allocator kept most of it. Cut before spaces that follow a printable ASCII character
(split_regex.CUT, where the tokenizer's split regex always begins a word), a text's pieces encoded one at a
time give the whole text's ids with a piece's working memory (110 MB for the same 8 MB, its ids included).
Text is first split at the added tokens, as the tokenizer does itself: a chat of 250,000 short messages renders
to text with no such spaces, and took an API server from 130 MB to 900 MB.

The cut is exact only for some tokenizers (`cuttable`): a split regex and normalizer that allow it
(split_regex.cuttable), added tokens matched literally with no space inside (a cut falls in none, and none
strips the spaces next to it), and a post-processor that only puts ids around the text (added once here).
Text between added tokens without such spaces (one long word, most CJK text) stays one piece.
"""
from __future__ import annotations

import json
from typing import Callable

from apiserver import split_regex

PIECE_CHARS = 65536


def cuttable(tokenizer) -> bool:
    """Whether `tokenizer` (a `tokenizers.Tokenizer`) encodes text cut at split_regex.CUT piece by piece exactly."""
    spec = json.loads(tokenizer.to_str())
    pattern = split_regex.split_pattern(spec)
    if pattern is None or not split_regex.cuttable(spec, pattern) or tokenizer.encode_special_tokens:
        return False
    return all(" " not in t.content and not (t.lstrip or t.rstrip or t.single_word)
               for t in tokenizer.get_added_tokens_decoder().values())


def pieces(text: str) -> list[str]:
    """`text` cut at the first cut after every PIECE_CHARS characters (one piece when it has none)."""
    parts = []
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = split_regex.CUT.search(text, start + PIECE_CHARS)
        if cut is None:
            break
        parts.append(text[start:cut.start()])
        start = cut.start()
    parts.append(text[start:])
    return parts


def encode(tokenizer, texts: list[str], split: Callable[[str], list[str | int]] | None, add_special_tokens: bool,
           affixes: tuple[list[int], list[int]] | None) -> list[list[int]]:
    """Each text's ids, as `encode_batch_fast` gives them, by batches of about PIECE_CHARS characters (a batch holds
    several texts when they are short, for the tokenizer's threads). `split`: for a `cuttable` tokenizer, the text
    between its added tokens and their ids (renderer._SegmentCache.split), when long texts may be cut: at the
    added tokens, then into `pieces` (with `add_special_tokens`, only where the post-processor's `affixes` are
    known)."""
    cut = split is not None and (affixes is not None or not add_special_tokens)
    # A cut text's pieces are encoded without special tokens, and the post-processor's ids put around them here.
    prefix, suffix = (affixes or ([], [])) if cut and add_special_tokens else ([], [])
    work: list[tuple[int, str | int]] = []
    for i, text in enumerate(texts):
        if not cut or split is None:
            work.append((i, text))
            continue
        for part in split(text):
            work.extend([(i, part)] if isinstance(part, int) else [(i, piece) for piece in pieces(part)])
    ids: list[list[int]] = [list(prefix) for _ in texts]
    for batch in _batches(work):
        encodings = iter(tokenizer.encode_batch_fast([p for _, p in batch if isinstance(p, str)],
                                                     add_special_tokens=add_special_tokens and not cut))
        for i, part in batch:
            if isinstance(part, int):
                ids[i].append(part)
            else:
                ids[i] += next(encodings).ids
    for text_ids in ids:
        text_ids += suffix
    return ids


def _batches(work: list[tuple[int, str | int]]):
    """`work` in runs of about PIECE_CHARS characters (an added token's id counts as one), at least one item each."""
    batch: list[tuple[int, str | int]] = []
    size = 0
    for item in work:
        length = 1 if isinstance(item[1], int) else len(item[1])
        if batch and size + length > PIECE_CHARS:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += length
    if batch:
        yield batch

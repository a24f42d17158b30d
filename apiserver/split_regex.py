"""The split regex of a byte-level BPE tokenizer (tokenizer.json's pre-tokenizer), for Python's `re` on ASCII.

tokenizers runs the regex with onig, with Unicode classes; apiserver.word_cache runs it with `re` on text of
printable ASCII, tab, newline and carriage return only, where each class holds exactly its ASCII characters.
Only what means the same in both engines is translated; anything else leaves the tokenizer to the Rust one.
"""
from __future__ import annotations

import re

# tokenizers' ByteLevel pre-tokenizer's own regex (use_regex=true), GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's and OpenAI's cl100k; Qwen 2's; OpenAI's o200k.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Split regexes under which a space right after a printable ASCII character always begins a word: no
# alternative matches such a character followed by a space, none looks behind, and together they match every
# character. Text with other characters can then be cut before such spaces and its parts encoded apart: the
# plain ASCII parts by the word cache, the others by the tokenizer.
CUTTABLE = {GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, O200K_PATTERN}
CUT = re.compile(r"(?<=[!-~]) ")
# The groups a split regex may open: plain, case-insensitive, lookarounds, atomic.
_GROUP_PREFIX = re.compile(r"\(\?(?::|i:|=|!|<=|<!|>)")
# The Unicode classes a split regex may use, as the ASCII characters they hold.
_ASCII_CLASSES = {
    "L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "",
    "N": "0-9", "Nd": "0-9", "Nl": "", "No": "", "M": "", "Mn": "", "Mc": "", "Me": "",
}
# Normalizers that leave such text as it is.
_IDENTITY_ON_ASCII = {"NFC", "NFD", "NFKC", "NFKD"}


def split_pattern(spec: dict) -> str | None:
    """The split regex of a tokenizer.json's pipeline when this module reproduces it, else None."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return None
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") not in _IDENTITY_ON_ASCII:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers") or ()) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or not isinstance(regex, str) or split.get("behavior") != "Isolated"
            or split.get("invert")):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    return regex


def python_pattern(pattern: str) -> str | None:
    """`pattern` for Python's `re` on ASCII text: each \\p{X} as its ASCII characters; None when it uses what
    this cannot translate (\\P{X}, other classes, nested sets) or does not compile."""
    out: list[str] = []
    in_set = False
    set_start = 0  # index in `out` where the open set's content begins
    set_first = 0  # index in `pattern` of the open set's first character (a "]" there is literal)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            match = re.match(r"\\p\{(\w+)\}", pattern[i:])
            if match:
                chars = _ASCII_CLASSES.get(match.group(1))
                if chars is None:
                    return None
                out.append(chars if in_set else (f"[{chars}]" if chars else "(?!)"))
                i += match.end()
                continue
            if pattern[i + 1:i + 2] in ("P", "X", "R", "K", "h", "H", "G", "y", "Y", "O", "Z"):
                return None  # onig escapes Python lacks, or has with another meaning
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":
            if in_set:
                return None  # a nested set: onig's set operations
            in_set = True
            out.append("[^" if pattern[i + 1:i + 2] == "^" else "[")
            i += len(out[-1])
            set_start, set_first = len(out), i
            continue
        if c == "]" and in_set and i == set_first:
            out.append(r"\]")
            i += 1
            continue
        if c in "^$" and not in_set:
            return None  # onig's ^ and $ are line anchors, Python's are not
        if c == "(" and not in_set and pattern[i + 1:i + 2] == "?" and not _GROUP_PREFIX.match(pattern, i):
            return None  # inline flags: onig's (?m) is Python's (?s), and Python takes global ones only first
        if c == "]" and in_set:
            in_set = False
            if not "".join(out[set_start:]):  # every class in it was empty in ASCII
                negated = out[set_start - 1] == "[^"
                del out[set_start - 1:]
                out.append(r"[\s\S]" if negated else "(?!)")
            else:
                out.append(c)
            i += 1
            continue
        out.append(c)
        i += 1
    if in_set:
        return None
    translated = "".join(out)
    try:
        re.compile(translated, re.ASCII)
    except re.error:
        return None
    return translated


def cuttable(spec: dict, pattern: str) -> bool:
    """Whether text with other characters may be cut at CUT for this tokenizer: a known split regex, and a
    normalizer that cannot change text across a cut (NFC never joins characters across a space; NFKC and the
    decompositions are left out)."""
    return pattern in CUTTABLE and (spec.get("normalizer") or {}).get("type", "NFC") == "NFC"

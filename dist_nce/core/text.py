"""Token ids for mentions and entities, with BLINK's conventions (Wu et al., 2020).

- mention: ``[CLS] left [unused0] mention [unused1] right [SEP]``. The mention is
  centred: after the mention (truncated if it alone does not fit) the remaining quota
  is split, the left side getting the floor half as in BLINK's
  ``get_context_representation``, and quota one side cannot use goes to the other.
  Left context is cut from its far left, right context from its far right.
- entity: ``[CLS] title [unused2] description [SEP]``. Zeshel descriptions begin with
  the title, so by default the title appears twice (as in the paper's code);
  ``strip_title=True`` drops a leading copy of it from the description.

The markers are the vocabulary's own ``[unused0..2]`` (ids 1, 2, 3 in BERT uncased),
registered as special tokens so they are never split. Text from the data is encoded
with ``split_special_tokens=True``: a literal ``[SEP]`` in a Wikipedia article is
text, not structure.

Two paths produce the same ids. The per-record functions tokenize each piece whole
and are the reference. The batch functions use the tokenizer's Rust batch path and,
for whitespace-splitting tokenizers (BERT's), tokenize only a window of each long
text next to where tokens are kept (see :func:`_windowed_ids`); they are tested to
equal the per-record functions.
"""
from __future__ import annotations

import hashlib
import os
from typing import NamedTuple, Sequence

import numpy as np

from dist_nce.core.records import EntityRecord, MentionRecord

MENTION_START = "[unused0]"
MENTION_END = "[unused1]"
TITLE_SEP = "[unused2]"
MARKERS = (MENTION_START, MENTION_END, TITLE_SEP)

# Records per tokenizer call in the batch functions: large enough to amortise the
# call, small enough that the Python lists of ids stay a few MB.
_CHUNK = 2048
# A window of this many characters per wanted token almost always holds enough tokens
# (English prose averages ~5 characters per WordPiece); when it does not, the whole text
# is tokenized instead, so the window size only affects speed, never the result.
_CHARS_PER_TOKEN = 8


class SpecialIds(NamedTuple):
    cls: int
    sep: int
    pad: int
    mention_start: int
    mention_end: int
    title_sep: int


def _local_dir(model_dir: str | os.PathLike | None) -> str:
    if model_dir is None:
        from dist_nce.core.models import default_model_dir

        model_dir = default_model_dir()
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: tokenizer directory not found (dist-nce loads tokenizers from a local "
                                "Hugging Face model directory only and never downloads a hub id: fetch the model "
                                "where the network is reachable and give its directory)")
    return model_dir


def _register_markers(tok, model_dir: str, add) -> None:
    """Make the markers never-split special tokens through ``add``; they must already be in
    the vocabulary, or the encoder's embedding matrix would not cover new ids."""
    vocab = tok.get_vocab()
    missing = [m for m in MARKERS if m not in vocab]
    if missing:
        raise ValueError(f"{model_dir}: vocabulary lacks {missing}; BLINK's markers must be existing "
                         "[unusedN] entries of the vocabulary")
    size = len(tok)
    add(list(MARKERS))
    if len(tok) != size or [tok.convert_tokens_to_ids(m) for m in MARKERS] != [vocab[m] for m in MARKERS]:
        raise RuntimeError(f"{model_dir}: registering {list(MARKERS)} changed the vocabulary")


def load_tokenizer(model_dir: str | os.PathLike | None = None):
    """A Hugging Face fast tokenizer from the local directory ``model_dir`` (default: the
    shipped MiniLM) with ``[unused0..2]`` registered as never-split special tokens.

    Offline only, like the encoders: a hub id is refused rather than fetched, so a config
    can never make a run depend on the network (or on what the hub serves that day).
    The markers must already be in the vocabulary: registering them must not append
    new ids, or the encoder's embedding matrix would not cover them.
    """
    from transformers import AutoTokenizer

    model_dir = _local_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{model_dir}: need a fast (Rust) tokenizer, got {type(tok).__name__}")
    _register_markers(tok, model_dir, lambda markers: tok.add_special_tokens(
        {"additional_special_tokens": markers}, replace_extra_special_tokens=False))
    return tok


def load_ingest_tokenizer(model_dir: str | os.PathLike | None = None):
    """:func:`load_tokenizer`'s ids for the batch encoders below, without importing
    transformers or torch when the directory's ``tokenizer.json`` allows it
    (:mod:`dist_nce.core.rust_tokenizer`): prepare's and a KB delta's workers only tokenize.
    Any other directory gets :func:`load_tokenizer` itself."""
    from dist_nce.core import rust_tokenizer

    model_dir = _local_dir(model_dir)
    tok = rust_tokenizer.load(model_dir)
    if tok is None:
        return load_tokenizer(model_dir)
    _register_markers(tok, model_dir, tok.add_special_tokens)
    return tok


def special_ids(tok) -> SpecialIds:
    """Ids of [CLS], [SEP], [PAD] and the three markers in ``tok``."""
    ids = tok.convert_tokens_to_ids(list(MARKERS))
    if tok.unk_token_id in ids:
        raise ValueError(f"tokenizer {tok.name_or_path!r} has no {list(MARKERS)} tokens")
    return SpecialIds(tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, *ids)


def tokenizer_fingerprint(tok) -> dict:
    """``{"name", "vocab_size", "sha256"}`` for manifests. The hash covers every
    (id, token) pair, so two tokenizers agree only if every id means the same piece;
    ``name`` is where it was loaded from, for people (compare the hash, not the name)."""
    pairs = sorted((i, t) for t, i in tok.get_vocab().items())
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for i, t in pairs).encode("utf-8")).hexdigest()
    return {"name": str(tok.name_or_path), "vocab_size": len(tok), "sha256": digest}


# ---------------------------------------------------------------- pure layout


def assemble_mention_ids(left: Sequence[int], mention: Sequence[int], right: Sequence[int],
                         max_len: int, sp: SpecialIds) -> list[int]:
    """``[CLS] left [unused0] mention [unused1] right [SEP]`` in at most ``max_len`` ids.

    The mention keeps its first ``max_len - 4`` tokens. Of the R ids left over, the
    left context is offered floor(R/2) and the right ceil(R/2); what one side cannot
    use goes to the other. Left keeps its last tokens, right its first.
    """
    if max_len < 5:
        raise ValueError(f"mention max_len must be >= 5 (4 special tokens + 1), got {max_len}")
    mention = list(mention[:max_len - 4])
    room = max_len - 4 - len(mention)
    n_left = min(len(left), max(room // 2, room - len(right)))
    n_right = min(len(right), room - n_left)
    kept_left = list(left[len(left) - n_left:])
    return [sp.cls, *kept_left, sp.mention_start, *mention, sp.mention_end, *right[:n_right], sp.sep]


def assemble_entity_ids(title: Sequence[int], description: Sequence[int], max_len: int,
                        sp: SpecialIds) -> list[int]:
    """``[CLS] title [unused2] description [SEP]`` in at most ``max_len`` ids.

    The title keeps its first ``max_len - 3`` tokens, so the marker survives even for
    absurd titles (BLINK truncates the joined sequence instead; the two agree whenever
    the title fits); the description fills what remains from its start.
    """
    if max_len < 4:
        raise ValueError(f"entity max_len must be >= 4 (3 special tokens + 1), got {max_len}")
    title = list(title[:max_len - 3])
    room = max_len - 3 - len(title)
    return [sp.cls, *title, sp.title_sep, *description[:room], sp.sep]


def strip_leading_title(title: Sequence[int], description: Sequence[int],
                        description_words: Sequence[int | None]) -> Sequence[int]:
    """``description`` without a leading copy of ``title``, compared as token ids (so
    case and spacing around punctuation do not matter). Only a whole-word copy is
    stripped: ``Warner`` is not stripped from ``Warnerville``, which shares its first
    piece; ``description_words[i]`` is the word index of token i."""
    k = len(title)
    if k == 0 or len(description) < k or list(description[:k]) != list(title):
        return description
    if len(description) > k and description_words[k] == description_words[k - 1]:
        return description
    return description[k:]


# ---------------------------------------------------------------- tokenization


def _tokenize(tok, texts: Sequence[str], words: bool = False):
    """Token ids (and word indices if ``words``) of each text, no special tokens added."""
    if not texts:
        return [], ([] if words else None)
    enc = tok(list(texts), add_special_tokens=False, split_special_tokens=True,
              return_attention_mask=False, return_token_type_ids=False, verbose=False)
    ids = enc["input_ids"]
    return ids, ([enc.word_ids(i) for i in range(len(ids))] if words else None)


def _splits_on_spaces(tok) -> bool:
    """True when tokens never cross a space and normalization is per character, so
    the tokens of ``text[:i]`` (``text[i]`` a space) are a prefix of those of ``text``."""
    from tokenizers import normalizers, pre_tokenizers

    backend = tok.backend_tokenizer
    pre_ok = isinstance(backend.pre_tokenizer, (pre_tokenizers.BertPreTokenizer,
                                                pre_tokenizers.WhitespaceSplit, pre_tokenizers.Whitespace))
    norm_ok = backend.normalizer is None or isinstance(backend.normalizer, normalizers.BertNormalizer)
    return pre_ok and norm_ok


def _window(text: str, chars: int, tail: bool) -> tuple[str, bool]:
    """(piece of ``text`` cut at a space within ``chars`` characters of its start, or of
    its end if ``tail``; whether the piece is the whole text)."""
    if len(text) <= chars:
        return text, True
    if tail:
        cut = text.find(" ", len(text) - chars)
        return (text, True) if cut < 0 else (text[cut + 1:], False)
    cut = text.rfind(" ", 0, chars)
    return (text, True) if cut <= 0 else (text[:cut], False)


def _windowed_ids(tok, texts: Sequence[str], need: Sequence[int], tail: bool, words: bool,
                  windows: bool):
    """Ids (and word indices) of each text, exact in the ``need[i]`` tokens nearest its
    start (its end if ``tail``): either the whole text's tokens, or at least ``need[i]``
    tokens of a window cut at a space, whose tokens are then exactly a prefix (suffix)
    of the whole text's. Windows too short to hold ``need[i]`` tokens are redone whole.
    """
    if not windows:
        return _tokenize(tok, texts, words)
    cut = [_window(t, _CHARS_PER_TOKEN * n + 64, tail) for t, n in zip(texts, need)]
    ids, wids = _tokenize(tok, [c[0] for c in cut], words)
    redo = [i for i, (c, n) in enumerate(zip(cut, need)) if not c[1] and len(ids[i]) < n]
    if redo:
        full_ids, full_wids = _tokenize(tok, [texts[i] for i in redo], words)
        for j, i in enumerate(redo):
            ids[i] = full_ids[j]
            if words:
                wids[i] = full_wids[j]
    return ids, wids


# ---------------------------------------------------------------- per record (reference)


def encode_mention(tok, left: str, mention: str, right: str, max_len: int) -> list[int]:
    """Unpadded ids ``[CLS] left [unused0] mention [unused1] right [SEP]``, len <= max_len."""
    (left_ids, mention_ids, right_ids), _ = _tokenize(tok, [left, mention, right])
    return assemble_mention_ids(left_ids, mention_ids, right_ids, max_len, special_ids(tok))


def encode_entity(tok, title: str, description: str, max_len: int, strip_title: bool = False) -> list[int]:
    """Unpadded ids ``[CLS] title [unused2] description [SEP]``, len <= max_len."""
    (title_ids, desc_ids), words = _tokenize(tok, [title, description], words=True)
    if strip_title:
        desc_ids = strip_leading_title(title_ids, desc_ids, words[1])
    return assemble_entity_ids(title_ids, desc_ids, max_len, special_ids(tok))


# ---------------------------------------------------------------- batch


def encode_mentions(tok, records: Sequence[MentionRecord], max_len: int) -> np.ndarray:
    """[N, max_len] int32 ids, rows padded with the pad id; row i equals
    ``encode_mention(tok, r.left, r.mention, r.right, max_len)`` for r = records[i]."""
    sp = special_ids(tok)
    windows = _splits_on_spaces(tok)
    out = np.full((len(records), max_len), sp.pad, dtype=np.int32)
    for a in range(0, len(records), _CHUNK):
        chunk = records[a:a + _CHUNK]
        n = len(chunk)
        need = [max_len] * n
        lefts, _ = _windowed_ids(tok, [r.left for r in chunk], need, True, False, windows)
        heads, _ = _windowed_ids(tok, [r.mention for r in chunk] + [r.right for r in chunk],
                                 need * 2, False, False, windows)
        for i in range(n):
            row = assemble_mention_ids(lefts[i], heads[i], heads[n + i], max_len, sp)
            out[a + i, :len(row)] = row
    return out


def encode_entities(tok, records: Sequence[EntityRecord], max_len: int, strip_title: bool = False) -> np.ndarray:
    """[N, max_len] int32 ids, rows padded with the pad id; row i equals
    ``encode_entity(tok, r.title, r.description, max_len, strip_title)``."""
    sp = special_ids(tok)
    windows = _splits_on_spaces(tok)
    out = np.full((len(records), max_len), sp.pad, dtype=np.int32)
    for a in range(0, len(records), _CHUNK):
        chunk = records[a:a + _CHUNK]
        # Titles are short and, with strip_title, compared whole: never windowed.
        titles, _ = _tokenize(tok, [r.title for r in chunk])
        # Stripping looks at the title's length of tokens plus one beyond it.
        need = [max_len + (len(t) + 1 if strip_title else 0) for t in titles]
        descs, words = _windowed_ids(tok, [r.description for r in chunk], need, False, strip_title, windows)
        for i, title_ids in enumerate(titles):
            desc_ids = strip_leading_title(title_ids, descs[i], words[i]) if strip_title else descs[i]
            row = assemble_entity_ids(title_ids, desc_ids, max_len, sp)
            out[a + i, :len(row)] = row
    return out

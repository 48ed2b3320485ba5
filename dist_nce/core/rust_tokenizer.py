"""The ingest tokenizer read straight from ``tokenizer.json`` with the ``tokenizers`` library.

``kb.prepare`` and ``kb.delta`` only need token ids. Loading the tokenizer through
``transformers.AutoTokenizer`` imports torch (its config module pulls in the RoPE
utilities), which is most of a KB delta's start-up: a delta of 10 rows would wait
seconds and take a hundred MiB for a library it never calls. :func:`load` builds the same
Rust tokenizer from the model directory's own files, and :class:`RustTokenizer` answers
the part of the Hugging Face interface that :mod:`dist_nce.core.text` uses.

Same ids, by construction: transformers 5 rebuilds a BERT tokenizer from
``tokenizer.json``'s vocabulary but takes the normalizer from ``tokenizer_config.json``
(transformers 4 took everything from ``tokenizer.json``). :func:`load` is used only when
both files describe the same BERT WordPiece tokenizer (normalizer, pre-tokenizer,
WordPiece settings, special tokens), so whichever file transformers trusts, the two
paths build one tokenizer; any other directory (only ``vocab.txt``, another family,
files that disagree) returns None and the caller falls back to transformers.
``tests/core/test_rust_tokenizer.py`` checks ids and fingerprint against the transformers
path on the shipped model directories.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

# The WordPiece settings transformers' BertTokenizer rebuilds the model with: a
# tokenizer.json with others would be read differently by the two paths.
_WORDPIECE = {"continuing_subword_prefix": "##", "max_input_chars_per_word": 100}
_BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")
_SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]"}


class Encoded:
    """What ``tok(texts, ...)`` returns, as far as dist_nce.core.text reads it."""

    def __init__(self, encodings):
        self._encodings = encodings
        self._ids = [e.ids for e in encodings]

    def __getitem__(self, key: str):
        if key != "input_ids":
            raise KeyError(key)
        return self._ids

    def word_ids(self, i: int) -> list[int | None]:
        return self._encodings[i].word_ids


class RustTokenizer:
    """A ``tokenizers.Tokenizer`` with the Hugging Face calls dist_nce.core.text makes. Encodes
    without special tokens, truncation or padding, and splits special-token text (the
    options text.py always passes), so those are fixed here rather than per call."""

    is_fast = True

    def __init__(self, backend, name_or_path: str, special: dict[str, str]):
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = True  # a literal "[SEP]" in an article is text
        self.backend_tokenizer, self.name_or_path = backend, name_or_path
        for key, token in special.items():
            setattr(self, key, token)
            setattr(self, f"{key}_id", backend.token_to_id(token))

    def __call__(self, texts: Sequence[str], add_special_tokens: bool = False, split_special_tokens: bool = True,
                 **_ignored) -> Encoded:
        if add_special_tokens or not split_special_tokens:
            raise ValueError("RustTokenizer encodes text only: add_special_tokens=False, split_special_tokens=True")
        if isinstance(texts, str):  # a batch of its characters would be silently wrong
            raise TypeError("RustTokenizer takes a list of texts")
        return Encoded(self.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def add_special_tokens(self, tokens: Sequence[str]) -> None:
        from tokenizers import AddedToken

        self.backend_tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _special_tokens(config: dict, special_map: dict) -> dict[str, str] | None:
    """Each special token, or None when tokenizer_config.json and special_tokens_map.json disagree."""
    out = {}
    for key, default in _SPECIAL.items():
        named = {_token(d[key]) for d in (config, special_map) if d.get(key) is not None}
        if len(named) > 1:
            return None
        out[key] = named.pop() if named else default
    return out


def _same_bert(spec: dict, config: dict, special: dict[str, str]) -> bool:
    """``tokenizer.json`` (``spec``) is the BERT tokenizer ``tokenizer_config.json`` describes."""
    if config.get("tokenizer_class") not in _BERT_CLASSES:
        return False
    model = spec.get("model") or {}
    if model.get("type") != "WordPiece" or model.get("unk_token") != special["unk_token"]:
        return False
    if any(model.get(k) != v for k, v in _WORDPIECE.items()):
        return False
    want = {"type": "BertNormalizer", "clean_text": True,
            "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
            "strip_accents": config.get("strip_accents"), "lowercase": config.get("do_lower_case", True)}
    if spec.get("normalizer") != want or spec.get("pre_tokenizer") != {"type": "BertPreTokenizer"}:
        return False
    # transformers drops tokenizer.json's added tokens and adds the config's special ones back;
    # with every one special (split as text here) the two agree whatever their order.
    added = spec.get("added_tokens") or []
    decoder = config.get("added_tokens_decoder") or {}
    if not all(t.get("special") for t in [*added, *decoder.values()]):
        return False
    if not {t["content"] for t in added} <= set(special.values()) | {_token(t) for t in decoder.values()}:
        return False
    # ...and the config's tokens are the file's own ids, so both vocabularies are one.
    ids = {**model.get("vocab", {}), **{t["content"]: t["id"] for t in added}}
    return all(ids.get(_token(t)) == int(i) for i, t in decoder.items())


def load(model_dir: str | os.PathLike) -> RustTokenizer | None:
    """The tokenizer of ``model_dir`` without transformers, or None when this path cannot
    promise the transformers path's ids (module docstring). Markers are registered by the caller."""
    from tokenizers import Tokenizer

    root = Path(model_dir)
    spec, config = _read_json(root / "tokenizer.json"), _read_json(root / "tokenizer_config.json")
    if spec is None or config is None:
        return None
    special = _special_tokens(config, _read_json(root / "special_tokens_map.json") or {})
    if special is None or not _same_bert(spec, config, special):
        return None
    tok = RustTokenizer(Tokenizer.from_file(str(root / "tokenizer.json")), os.fspath(model_dir), special)
    if any(getattr(tok, f"{key}_id") is None for key in special):
        return None
    return tok

"""dist_nce.core.text.load_tokenizer loads from a local directory only, never from the hub."""
from __future__ import annotations

import pytest

from dist_nce.core.text import load_tokenizer


def test_a_hub_id_is_refused_without_any_download(monkeypatch):
    import transformers

    def no_network(*args, **kwargs):
        raise AssertionError("from_pretrained must not be reached with a hub id")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_network)
    with pytest.raises(FileNotFoundError, match=r"^bert-base-uncased: tokenizer directory not found .*never downloads"):
        load_tokenizer("bert-base-uncased")


def test_a_local_directory_loads_with_local_files_only(monkeypatch, minilm_dir):
    import transformers

    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        calls.append(kwargs)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    tok = load_tokenizer(minilm_dir)
    assert tok.convert_tokens_to_ids("[unused0]") == 1
    assert calls == [{"local_files_only": True}]

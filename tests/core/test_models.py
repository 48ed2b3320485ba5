"""The jobs build the project's tiny model (data/models/tiny_bert) when a config names it and it is missing."""
from __future__ import annotations

import os

import pytest

from dist_nce.core.models import TINY_BERT_DIR, ensure_tiny_bert, ensure_tiny_models, is_tiny_bert_path


def test_only_the_projects_tiny_path_is_built(tmp_path):
    assert is_tiny_bert_path(TINY_BERT_DIR, tmp_path)
    assert is_tiny_bert_path(tmp_path / "data" / "models" / "tiny_bert", tmp_path)
    assert is_tiny_bert_path(str(tmp_path / "data" / "models" / ".." / "models" / "tiny_bert"), tmp_path)
    assert not is_tiny_bert_path("data/models/tiny_bert2", tmp_path)
    assert not is_tiny_bert_path(tmp_path / "elsewhere" / "tiny_bert", tmp_path)
    # A typo in a model path stays a missing-input error; nothing is built there.
    assert ensure_tiny_models({"model.x": str(tmp_path / "data" / "models" / "tiny_bertt"), "model.y": None},
                              tmp_path, log=lambda _: None) == []
    assert not (tmp_path / "data").exists()


def test_built_once_deterministic_and_loads_offline(tmp_path, monkeypatch):
    from transformers import AutoModel, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs: list[str] = []
    out = tmp_path / TINY_BERT_DIR
    assert ensure_tiny_models({"model.retriever.mention_model": str(out)}, tmp_path, log=logs.append) == \
        ["model.retriever.mention_model"]
    assert "building the random tiny BERT" in logs[0] and str(out) in logs[0]
    assert ensure_tiny_bert(out, log=logs.append) is False and len(logs) == 1  # reused, not rebuilt
    assert [p.name for p in out.parent.iterdir()] == ["tiny_bert"]  # no temporary directory left
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102]  # uncased BERT vocabulary
    model = AutoModel.from_pretrained(out, local_files_only=True)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    other = tmp_path / "again" / TINY_BERT_DIR
    ensure_tiny_bert(other, log=lambda _: None)
    again = AutoModel.from_pretrained(other, local_files_only=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert a.equal(b), name  # seed 0: the same weights every time


def test_a_foreign_directory_is_not_replaced(tmp_path):
    out = tmp_path / TINY_BERT_DIR
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no config.json"):
        ensure_tiny_bert(out, log=lambda _: None)
    assert os.listdir(out) == ["notes.txt"]


def test_a_concurrent_build_that_finishes_first_wins_quietly(tmp_path, monkeypatch):
    """Two jobs building the tiny model at once on a fresh checkout (seen with two pytest-xdist workers
    running README commands): the one that renames second finds the winner's complete model in place
    and uses it, instead of failing on the folder it expected to be empty."""
    from dist_nce.core import models

    out = tmp_path / TINY_BERT_DIR
    out.mkdir(parents=True)  # an empty folder: replaced, as a missing one is created
    real = models.make_tiny_bert

    def build_while_another_job_finishes(tmp):
        real(tmp)
        winner = tmp_path / "winner"
        real(winner)
        os.rmdir(out)
        os.rename(winner, out)  # the other job's rename lands between this one's check and its own

    monkeypatch.setattr(models, "make_tiny_bert", build_while_another_job_finishes)
    ensure_tiny_bert(out, log=lambda _: None)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in out.parent.iterdir()] == ["tiny_bert"]  # this job's temporary copy removed

"""dist_nce.train.model's check of a BLINK start (check_blink_init): the sizes and refusals of the full
build, read from the mapped file and meta-device towers instead of two built BERTs."""
from __future__ import annotations

import pytest
import torch

from dist_nce.core.config import ConfigError
from dist_nce.modeling.retriever import RetrieverConfig
from dist_nce.train import model
from dist_nce.train.config import ModelConfig
from tests.blink_helpers import write_blink_biencoder


@pytest.fixture(scope="module")
def bert64(tmp_path_factory):
    """The architecture of tests/blink_helpers' checkpoints (hidden 64, 1 head), with the MiniLM tokenizer."""
    from dist_nce.core.models import make_tiny_bert

    return make_tiny_bert(tmp_path_factory.mktemp("bert64"), hidden_size=64, num_layers=2, num_heads=1,
                          intermediate_size=96)


def config(path, mention_model=None) -> ModelConfig:
    return ModelConfig(retriever=RetrieverConfig(mention_model=mention_model), blink_checkpoint=str(path))


def full_build_refused(monkeypatch) -> list:
    """Make build_retriever fail the test if called; returns the list of calls a spy records instead."""
    calls: list = []

    def spy(cfg, seed):
        calls.append(cfg.blink_checkpoint)
        raise AssertionError("the check built both towers")

    monkeypatch.setattr(model, "build_retriever", spy)
    return calls


@pytest.mark.parametrize("legacy_names", [True, False])
def test_the_check_reads_sizes_without_building_either_tower(tmp_path, bert64, monkeypatch, legacy_names):
    path = write_blink_biencoder(tmp_path / "biencoder_wiki_large.bin", legacy=legacy_names)
    full = model.build_retriever(config(path, bert64), 0).hidden_size
    calls = full_build_refused(monkeypatch)
    assert model.blink_hidden_size(config(path, bert64), 0) == full == 64
    model.check_blink_init(config(path, bert64))  # the shards are sized from bert64: passes
    with pytest.raises(ConfigError, match=r"holds encoders of hidden size 64, but the shards are sized from the "
                                          r"default model \(MiniLM; .*\): 384"):
        model.check_blink_init(config(path))
    assert calls == []


def test_a_file_in_torchs_legacy_format_is_still_checked_by_the_full_build(tmp_path, bert64, monkeypatch):
    """torch's pre-1.6 format cannot be mapped (blink_stream): the full build answers, as before."""
    path = write_blink_biencoder(tmp_path / "zip.bin", legacy=False)
    legacy = tmp_path / "legacy.bin"
    torch.save(torch.load(path, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    calls = []
    build = model.build_retriever
    monkeypatch.setattr(model, "build_retriever", lambda cfg, seed: calls.append(seed) or build(cfg, seed))
    assert model.blink_hidden_size(config(legacy, bert64), 3) == 64 and calls == [3]


@pytest.mark.parametrize("edit,architecture,said", [
    (lambda s: s.pop("cand_encoder.bert_model.encoder.layer.1.output.dense.bias"), True,
     "missing encoder.layer.1.output.dense.bias"),
    (lambda s: s.update({"context_encoder.bert_model.encoder.layer.2.output.dense.bias": torch.zeros(64)}), True,
     "unexpected encoder.layer.2.output.dense.bias"),
    # 1,000 embedding rows, the architecture read off the weights: the tokenizer's 30,522 tokens are refused
    (lambda s: s.update({k: v[:1000] for k, v in s.items() if k.endswith("word_embeddings.weight")}), False,
     "has 30522 tokens but the checkpoint embeds 1000"),
])
def test_the_check_refuses_what_the_full_build_refuses_in_its_words(tmp_path, bert64, monkeypatch, edit,
                                                                     architecture, said):
    state = dict(torch.load(write_blink_biencoder(tmp_path / "good.bin", legacy=False), weights_only=True))
    edit(state)
    torch.save(state, tmp_path / "bad.bin")
    cfg = config(tmp_path / "bad.bin", bert64 if architecture else None)
    with pytest.raises(ValueError) as full:
        model.build_retriever(cfg, 0)
    full_build_refused(monkeypatch)
    with pytest.raises(ConfigError) as checked:
        model.check_blink_init(cfg)
    assert said in str(full.value)
    assert str(checked.value).startswith("model.blink_checkpoint: " + str(full.value)), (checked.value, full.value)

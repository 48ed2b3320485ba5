"""The entity encoder's fingerprint read off a BLINK file equals the loaded model's, and refuses what it refuses."""
from __future__ import annotations

import pytest
import torch

from dist_nce.index.encode import state_fingerprint
from dist_nce.index.import_encodings import blink_source_model, loaded_source_model
from dist_nce.modeling.blink import BlinkCheckpointError, load_blink_retriever
from dist_nce.modeling.blink_stream import MappedWeights, blink_entity_state
from dist_nce.modeling.retriever import RetrieverConfig
from tests.blink_helpers import write_blink_biencoder


def full(path, config=None) -> str:
    """The fingerprint as it always was: the whole retriever loaded, its entity state hashed."""
    return state_fingerprint(load_blink_retriever(path, config or RetrieverConfig()).entity_encoder_state())


@pytest.mark.parametrize("legacy_names", [True, False])
def test_streamed_fingerprint_is_the_loaded_models(tmp_path, legacy_names):
    path = write_blink_biencoder(tmp_path / "biencoder.bin", seed=2, legacy=legacy_names)
    streamed = blink_entity_state(path, RetrieverConfig())
    assert isinstance(streamed.state["weights"], MappedWeights)
    assert (streamed.hidden_size, streamed.vocab_size) == (64, 30522)
    assert state_fingerprint(streamed.state) == full(path)
    # the score spec is part of it, as in the loaded state
    multi = RetrieverConfig(preset="multi", m=4)
    assert state_fingerprint(blink_entity_state(path, multi).state) == full(path, multi) != full(path)


def test_another_model_gets_another_fingerprint(tmp_path):
    """The import's mismatch check compares fingerprints: a different entity tower must change it,
    a different mention tower must not (the encodings are the entity tower's)."""
    a = write_blink_biencoder(tmp_path / "a.bin", seed=2, legacy=False)
    b = write_blink_biencoder(tmp_path / "b.bin", seed=7, legacy=False)
    state = torch.load(a, weights_only=True)
    one = dict(state)
    one["cand_encoder.bert_model.encoder.layer.1.output.dense.bias"] = \
        state["cand_encoder.bert_model.encoder.layer.1.output.dense.bias"] + 1e-3
    torch.save(one, tmp_path / "one.bin")
    mention = dict(state)
    mention["context_encoder.bert_model.pooler.dense.bias"] = state["context_encoder.bert_model.pooler.dense.bias"] + 1
    torch.save(mention, tmp_path / "mention.bin")
    prints = {name: state_fingerprint(blink_entity_state(tmp_path / name, RetrieverConfig()).state)
              for name in ("a.bin", "b.bin", "one.bin", "mention.bin")}
    assert len({prints["a.bin"], prints["b.bin"], prints["one.bin"]}) == 3
    assert prints["mention.bin"] == prints["a.bin"]
    # fp16 weights: the model holds them as fp32, and so does the streamed state
    torch.save({k: v.half() for k, v in state.items()}, tmp_path / "half.bin")
    assert state_fingerprint(blink_entity_state(tmp_path / "half.bin", RetrieverConfig()).state) == \
        full(tmp_path / "half.bin")


def test_what_cannot_be_streamed_falls_back_and_the_source_model_is_the_same(tmp_path, minilm_dir):
    path = write_blink_biencoder(tmp_path / "biencoder.bin", seed=2, legacy=False)
    state = torch.load(path, weights_only=True)
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)  # torch < 1.6's format
    assert blink_entity_state(tmp_path / "legacy.bin", RetrieverConfig()) is None
    no_pooler = {k: v for k, v in state.items() if not k.startswith("cand_encoder.bert_model.pooler.")}
    torch.save(no_pooler, tmp_path / "no_pooler.bin")
    assert blink_entity_state(tmp_path / "no_pooler.bin", RetrieverConfig()) is None
    streamed = blink_source_model(path, RetrieverConfig())
    loaded = loaded_source_model(load_blink_retriever(path, RetrieverConfig()))
    assert streamed.streamed and not loaded.streamed
    assert (streamed.encoder_fingerprint, streamed.hidden_size, streamed.config) == \
        (loaded.encoder_fingerprint, loaded.hidden_size, loaded.config)
    assert streamed.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.update({"cand_encoder.extra": torch.zeros(1)}), r"unexpected keys cand_encoder\.extra"),
    (lambda s: s.pop("cand_encoder.bert_model.encoder.layer.1.output.dense.bias"),
     r"cand_encoder: missing encoder\.layer\.1\.output\.dense\.bias"),
    (lambda s: s.update({"context_encoder.bert_model.encoder.layer.0.output.dense.weight": torch.zeros(64, 65)}),
     r"context_encoder: shape mismatch encoder\.layer\.0\.output\.dense\.weight \(64, 65\) vs model \(64, 96\)"),
])
def test_bad_files_are_refused_as_the_full_load_refuses_them(tmp_path, edit, message):
    state = torch.load(write_blink_biencoder(tmp_path / "good.bin", legacy=False), weights_only=True)
    edit(state)
    torch.save(state, tmp_path / "bad.bin")
    for read in (lambda: blink_entity_state(tmp_path / "bad.bin", RetrieverConfig()),
                 lambda: load_blink_retriever(tmp_path / "bad.bin", RetrieverConfig())):
        with pytest.raises(BlinkCheckpointError, match=message) as e:
            read()
        assert "bad.bin" in str(e.value)

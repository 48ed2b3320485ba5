"""BLINK biencoder import/export against a tiny checkpoint with BLINK's exact key layout."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import BertModel

from dist_nce.core.models import make_tiny_bert
from dist_nce.index.encode import state_fingerprint
from dist_nce.index.import_encodings import blink_source_model
from dist_nce.modeling.blink import (
    BlinkCheckpointError,
    architecture_file,
    export_blink,
    load_blink_retriever,
    split_blink_state,
)
from dist_nce.modeling.resolve import load_retriever
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from dist_nce.train.model import export_model


class BlinkBiEncoderModule(nn.Module):
    """The module structure BLINK saves (blink/biencoder/biencoder.py, add_linear=False):
    ``context_encoder.bert_model`` and ``cand_encoder.bert_model``."""

    def __init__(self, context: BertModel, cand: BertModel):
        super().__init__()
        self.context_encoder = nn.Module()
        self.context_encoder.bert_model = context
        self.cand_encoder = nn.Module()
        self.cand_encoder.bert_model = cand


@pytest.fixture(scope="module")
def blink(tiny_model_dir):
    """(BLINK-layout state dict, the two BertModels it came from)."""
    context = BertModel.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    cand = BertModel.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in cand.parameters():  # two different encoders, as in a trained biencoder
            p.add_(0.05 * torch.randn_like(p))
    state = BlinkBiEncoderModule(context, cand).state_dict()
    assert any(k.startswith("context_encoder.bert_model.pooler.") for k in state)
    return dict(state), context, cand


def save(state, tmp_path, name="biencoder.bin"):
    path = tmp_path / name
    torch.save(state, path)
    return path


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 3000, (3, 9), generator=g)
    mask = torch.arange(9) < torch.tensor([[9], [4], [6]])
    ids[:, 0] = 101
    return ids.masked_fill(~mask, 0), mask


def cls_states(model: BertModel, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[:, 0]


def test_import_gives_blinks_cls_embeddings(blink, tiny_model_dir, tmp_path):
    state, context, cand = blink
    r = load_blink_retriever(save(state, tmp_path), RetrieverConfig(mention_model=tiny_model_dir)).eval()
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_states(context, ids, mask), rtol=0, atol=1e-6)
        torch.testing.assert_close(r.encode_entities(ids, mask).vecs, cls_states(cand, ids, mask), rtol=0, atol=1e-6)


def test_multi_m_starts_from_the_same_weights(blink, tiny_model_dir, tmp_path):
    state, context, cand = blink
    r = load_blink_retriever(save(state, tmp_path), RetrieverConfig(preset="multi", m=4, mention_model=tiny_model_dir))
    ids, mask = batch(1)
    with torch.no_grad():
        e = r.eval().encode_entities(ids, mask)
        full = cand(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert e.vecs.shape == (3, 4, 32)
    torch.testing.assert_close(e.vecs, full[:, :4], rtol=0, atol=1e-5)
    torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_states(context, ids, mask), rtol=0, atol=1e-6)


def test_architecture_inferred_without_a_model_dir(blink, tmp_path):
    state, context, _ = blink
    path = save(state, tmp_path)
    r = load_blink_retriever(path, RetrieverConfig(), num_attention_heads=2).eval()
    assert r.mention_encoder.model.config.num_hidden_layers == 2
    ids, mask = batch(2)
    with torch.no_grad():
        torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_states(context, ids, mask), rtol=0, atol=1e-6)
    # a file copied without the architecture record our exports write beside it: what to do, and which file
    with pytest.raises(BlinkCheckpointError) as e:
        load_blink_retriever(path, RetrieverConfig())
    assert str(e.value) == (
        f"{path}: hidden size 32 is not a multiple of 64, so the attention head count cannot be inferred (BERT's "
        f"heads are 64 wide); keep {Path(path).with_suffix('.architecture.json').name}, which the export wrote "
        "beside it, next to it (training jobs can instead name a model directory with the architecture's "
        "config.json: model.retriever.mention_model, model.reranker.model)")


def test_legacy_names_and_position_ids_buffer(blink, tiny_model_dir, tmp_path):
    state, context, _ = blink
    legacy = {}
    for k, v in state.items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        legacy[k] = v
    for side in ("context_encoder", "cand_encoder"):
        legacy[f"{side}.bert_model.embeddings.position_ids"] = torch.arange(512)[None]
    assert any(k.endswith("LayerNorm.gamma") for k in legacy)
    r = load_blink_retriever(save(legacy, tmp_path), RetrieverConfig(mention_model=tiny_model_dir)).eval()
    ids, mask = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_states(context, ids, mask), rtol=0, atol=1e-6)
    bad = dict(legacy)
    bad["cand_encoder.bert_model.embeddings.position_ids"] = torch.arange(512).flip(0)[None]
    with pytest.raises(BlinkCheckpointError, match="cand_encoder.bert_model.embeddings.position_ids is not arange"):
        split_blink_state(bad)


def test_missing_pooler_is_benign(blink, tiny_model_dir, tmp_path):
    state, context, _ = blink
    no_pooler = {k: v for k, v in state.items() if ".pooler." not in k}
    r = load_blink_retriever(save(no_pooler, tmp_path), RetrieverConfig(mention_model=tiny_model_dir)).eval()
    ids, mask = batch(4)
    with torch.no_grad():
        torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_states(context, ids, mask), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.pop("cand_encoder.bert_model.encoder.layer.1.output.dense.bias"),
         r"cand_encoder: missing encoder.layer.1.output.dense.bias"),
        (lambda s: s.update({"context_encoder.bert_model.encoder.layer.2.output.dense.bias": torch.zeros(32)}),
         r"context_encoder: unexpected encoder.layer.2.output.dense.bias"),
        (lambda s: s.update({"context_encoder.additional_linear.weight": torch.zeros(1, 32),
                             "context_encoder.additional_linear.bias": torch.zeros(1)}),
         r"keys context_encoder.additional_linear.bias, context_encoder.additional_linear.weight: .*add_linear=True"),
        (lambda s: s.update({"mention_scores.weight": torch.zeros(3)}), r"unexpected keys mention_scores.weight"),
        (lambda s: s.update({"context_encoder.bert_model.embeddings.word_embeddings.weight": torch.zeros(30522, 16)}),
         r"context_encoder: shape mismatch embeddings.word_embeddings.weight \(30522, 16\) vs model \(30522, 32\)"),
    ],
)
def test_bad_checkpoints_name_the_keys(blink, tiny_model_dir, tmp_path, edit, message):
    state = dict(blink[0])
    edit(state)
    with pytest.raises(BlinkCheckpointError, match=message):
        load_blink_retriever(save(state, tmp_path), RetrieverConfig(mention_model=tiny_model_dir))


def test_not_a_state_dict(tmp_path, tiny_model_dir):
    with pytest.raises(BlinkCheckpointError, match=r"bad.bin: expected a state dict"):
        load_blink_retriever(save([torch.zeros(1)], tmp_path, "bad.bin"), RetrieverConfig(mention_model=tiny_model_dir))


def test_export_round_trip_and_blink_strict_load(blink, tiny_model_dir, tmp_path):
    state, _, _ = blink
    r = load_blink_retriever(save(state, tmp_path), RetrieverConfig(mention_model=tiny_model_dir))
    with torch.no_grad():  # "finetune"
        for p in r.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    out = export_blink(r, tmp_path / "exported.bin")
    exported = torch.load(out, weights_only=True)
    assert set(exported) == set(state)  # exactly BLINK's layout, pooler included
    # BLINK loads with a strict load_state_dict into its own module structure
    module = BlinkBiEncoderModule(BertModel(r.mention_encoder.model.config), BertModel(r.entity_encoder.model.config))
    module.load_state_dict(exported, strict=True)
    back = load_blink_retriever(out, RetrieverConfig(mention_model=tiny_model_dir)).eval()
    r.eval()
    ids, mask = batch(5)
    with torch.no_grad():
        for side in ("encode_mentions", "encode_entities"):
            want = getattr(r, side)(ids, mask).vecs
            torch.testing.assert_close(getattr(back, side)(ids, mask).vecs, want, rtol=0, atol=0)
        torch.testing.assert_close(cls_states(module.cand_encoder.bert_model.eval(), ids, mask),
                                   r.encode_entities(ids, mask).vecs, rtol=0, atol=1e-6)


def test_export_refuses_codes(blink, tiny_model_dir, tmp_path):
    config = RetrieverConfig(preset="poly", m=2, mention_model=tiny_model_dir)
    r = load_blink_retriever(save(blink[0], tmp_path), config)
    with pytest.raises(BlinkCheckpointError, match="preset 'poly' has learned codes"):
        export_blink(r, tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists()


def test_an_export_whose_heads_are_not_64_wide_reads_back_as_the_model_it_came_from(tmp_path):
    """all-MiniLM-L6-v2 (the demo's model) has hidden 384 in 12 heads of 32; the weights do not hold the
    head count, and hidden / 64 would read it back with 6 heads, scoring differently and without an
    error. The export records each encoder's config beside the .bin, and every load reads it."""
    model_dir = make_tiny_bert(tmp_path / "bert", hidden_size=128, num_heads=8, seed=3)  # hidden / 64 = 2
    trained = Retriever.build(RetrieverConfig(mention_model=model_dir)).eval()
    paths = export_model(trained, tmp_path / "run")  # as a finetuning run exports: model/ and the .bin
    record = json.loads(architecture_file(paths["blink"]).read_text())
    assert {k: v["num_attention_heads"] for k, v in record["encoders"].items()} == \
        {"context_encoder": 8, "cand_encoder": 8}
    saved, back = load_retriever(paths["model"]).eval(), load_retriever(paths["blink"]).eval()
    assert back.entity_encoder.model.config.num_attention_heads == 8
    ids, mask = batch(7)
    with torch.no_grad():
        for side in ("encode_mentions", "encode_entities"):
            torch.testing.assert_close(getattr(back, side)(ids, mask).vecs, getattr(saved, side)(ids, mask).vecs,
                                       rtol=0, atol=0)
    # the same encoder to the shards: a KB encoded by the run is reused when linking with the .bin,
    # whether the file is loaded or fingerprinted off the mapped file (import_encodings)
    want = state_fingerprint(saved.entity_encoder_state())
    assert state_fingerprint(back.entity_encoder_state()) == want
    assert blink_source_model(paths["blink"], RetrieverConfig()).encoder_fingerprint == want
    # without the record (a .bin copied alone), the weights give hidden / 64 heads: other vectors
    architecture_file(paths["blink"]).unlink()
    guessed = load_retriever(paths["blink"]).eval()
    assert guessed.entity_encoder.model.config.num_attention_heads == 2
    with torch.no_grad():
        assert not torch.allclose(guessed.encode_entities(ids, mask).vecs, saved.encode_entities(ids, mask).vecs)


@pytest.mark.parametrize("record, message", [
    ("{", "unreadable architecture record"),
    ('{"kind": "other", "encoders": {}}', "kind 'other', expected 'blink_bert_architecture'"),
    ('{"kind": "blink_bert_architecture", "encoders": {}}', "'encoders' must map"),
    ('{"kind": "blink_bert_architecture", "encoders": {"cand_encoder": {"model_type": "roberta"}}}',
     "encoders.cand_encoder: expected a BertConfig"),
    ('{"kind": "blink_bert_architecture", "encoders": {"cand_encoder": {"model_type": "bert", '
     '"num_attention_heads": 0}}}', "encoders.cand_encoder.num_attention_heads: 0 is not a positive integer"),
])
def test_a_damaged_architecture_record_is_refused_by_name(blink, tmp_path, record, message):
    path = save(blink[0], tmp_path)
    architecture_file(path).write_text(record)
    with pytest.raises(BlinkCheckpointError, match="biencoder.architecture.json: " + message.replace("(", r"\(")):
        load_retriever(path)

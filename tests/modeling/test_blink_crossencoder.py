"""BLINK cross-encoder import/export against a tiny checkpoint with BLINK's exact key layout."""
import json

import pytest
import torch
from torch import nn
from transformers import BertModel

from dist_nce.core.models import make_tiny_bert
from dist_nce.core.text import load_tokenizer, special_ids
from dist_nce.modeling.blink import BlinkCheckpointError, architecture_file
from dist_nce.modeling.blink_crossencoder import (
    blink_crossencoder_state,
    blink_params_file,
    export_blink_crossencoder,
    load_blink_reranker,
)
from dist_nce.modeling.encoder import load_transformer
from dist_nce.modeling.reranker import Pairs, Reranker, RerankerConfig, build_pairs, layout_pairs
from dist_nce.modeling.resolve import load_reranker


class BlinkBertEncoder(nn.Module):
    """blink/common/ranker_base.py BertEncoder with add_linear=True, out_dim=1."""

    def __init__(self, bert: BertModel):
        super().__init__()
        self.bert_model = bert
        self.additional_linear = nn.Linear(bert.config.hidden_size, 1)
        self.dropout = nn.Dropout(0.1)

    def forward(self, ids, types, mask):
        pooled = self.bert_model(input_ids=ids, token_type_ids=types, attention_mask=mask).pooler_output
        return self.additional_linear(self.dropout(pooled))


class BlinkCrossEncoderModule(nn.Module):
    """blink/crossencoder/crossencoder.py CrossEncoderModule: what BLINK saves."""

    def __init__(self, bert: BertModel):
        super().__init__()
        self.encoder = BlinkBertEncoder(bert)

    def forward(self, ids, types, mask):
        return self.encoder(ids, types, mask).squeeze(-1)


@pytest.fixture(scope="module")
def blink(tiny_model_dir):
    """(BLINK cross-encoder state dict, the module it came from, in eval mode)."""
    torch.manual_seed(0)
    bert = BertModel.from_pretrained(tiny_model_dir, local_files_only=True)
    module = BlinkCrossEncoderModule(bert).eval()
    with torch.no_grad():  # a trained-looking head and encoder: spread scores
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    state = dict(module.state_dict())
    assert "encoder.additional_linear.weight" in state and any(".pooler." in k for k in state)
    return state, module


def save(state, tmp_path, name="crossencoder.bin"):
    path = tmp_path / name
    torch.save(state, path)
    return path


def pairs(tokenizer, max_len=40) -> Pairs:
    """Prepared-KB-shaped mention and entity rows -> BLINK's pair layout (build_pairs)."""
    sp = special_ids(tokenizer)
    g = torch.Generator().manual_seed(1)

    def words(n):
        return torch.randint(2000, 5000, (n,), generator=g).tolist()

    mentions = [[sp.cls, *words(3), sp.mention_start, *words(2), sp.mention_end, *words(4), sp.sep],
                [sp.cls, sp.mention_start, *words(1), sp.mention_end, *words(7), sp.sep]]
    m = torch.full((2, 14), sp.pad)
    for i, row in enumerate(mentions):
        m[i, :len(row)] = torch.tensor(row)
    e = torch.full((2, 3, 12), sp.pad)
    for i in range(2):
        for j in range(3):
            row = [sp.cls, *words(2), sp.title_sep, *words(3 + 2 * j), sp.sep]
            e[i, j, :len(row)] = torch.tensor(row)
    return build_pairs(m, e, sp, max_len)


def test_scores_equal_blinks_forward(blink, tiny_model_dir, tmp_path):
    state, module = blink
    reranker = load_blink_reranker(save(state, tmp_path), RerankerConfig(model=tiny_model_dir, max_len=40)).eval()
    p = pairs(reranker.tokenizer)
    assert p.token_type_ids.sum() > 0  # the entity part has token type 1, as in BLINK
    with torch.no_grad():
        got = reranker(p)
        b, k, length = p.ids.shape
        flat = [t.reshape(b * k, length) for t in p]
        bert_out = module.encoder.bert_model(input_ids=flat[0], token_type_ids=flat[1],
                                             attention_mask=flat[2].long())
        w, bias = state["encoder.additional_linear.weight"], state["encoder.additional_linear.bias"]
        by_hand = (bert_out.pooler_output @ w.T + bias).reshape(b, k)
        theirs = module(*flat[:2], flat[2].long()).reshape(b, k)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, theirs, rtol=0, atol=1e-5)
    assert float(got.std()) > 1e-3  # a non-trivial comparison


def test_blinks_params_beside_the_file_set_where_the_entity_starts(blink, tiny_model_dir, tmp_path):
    """A cross-encoder BLINK trained with other lengths (a Zeshel one: 128 context tokens) is read with
    them from its params file (crossencoder_x.json beside crossencoder_x.bin), not with the 32 of
    crossencoder_wiki_large: the entity starts at max_context_length, where BLINK put it in training."""
    state, _ = blink
    path = save(state, tmp_path, "crossencoder_x.bin")
    blink_params_file(path).write_text(json.dumps({"max_context_length": 12, "max_cand_length": 20,
                                                   "max_seq_length": 256, "add_linear": True, "out_dim": 1}))
    reranker = load_blink_reranker(path, RerankerConfig(model=tiny_model_dir, max_len=24))
    c = reranker.config
    assert (c.layout, c.context_len, c.cand_len, c.max_len) == ("blink", 12, 20, 32)  # 24 would cut the candidate
    sp = special_ids(reranker.tokenizer)
    m = torch.tensor([[sp.cls, 2001, sp.mention_start, 2002, sp.mention_end, sp.sep]])
    e = torch.tensor([[[sp.cls, 2003, sp.title_sep, 2004, 2005, sp.sep]]])
    types = layout_pairs(c, m, e, sp).token_type_ids[0, 0]
    assert int(types.nonzero()[0]) == 12  # BLINK's to_bert_input: segment 1 from max_context_length on
    # an explicit layout is the user's choice: the params file does not override it
    kept = load_blink_reranker(path, RerankerConfig(model=tiny_model_dir, max_len=40, layout="blink"))
    assert (kept.config.context_len, kept.config.cand_len) == (32, 128)


@pytest.mark.parametrize("params,message", [
    ({"max_cand_length": 128}, r"crossencoder_x\.json: BLINK params without max_context_length"),
    ({"max_context_length": "32", "max_cand_length": 128}, r"max_context_length '32': expected an integer"),
    ({"max_context_length": 32, "max_cand_length": 128, "add_linear": False}, r"add_linear false"),
    ({"max_context_length": 128, "max_cand_length": 128, "max_seq_length": 200}, r"max_seq_length 200 < "),
    ([32, 128], r"must be a JSON object"),
])
def test_bad_blink_params_are_named(blink, tiny_model_dir, tmp_path, params, message):
    path = save(blink[0], tmp_path, "crossencoder_x.bin")
    blink_params_file(path).write_text(json.dumps(params))
    with pytest.raises(BlinkCheckpointError, match=message):
        load_blink_reranker(path, RerankerConfig(model=tiny_model_dir))


def test_round_trip_is_byte_equal(blink, tiny_model_dir, tmp_path):
    state, _ = blink
    reranker = load_blink_reranker(save(state, tmp_path), RerankerConfig(model=tiny_model_dir))
    out = export_blink_crossencoder(reranker, tmp_path / "out" / "crossencoder_blink.bin")
    again = torch.load(out, weights_only=True)
    assert type(again) is dict and sorted(again) == sorted(state)
    for k, v in state.items():
        assert again[k].dtype == torch.float32 and again[k].device.type == "cpu"
        assert torch.equal(again[k], v), k
    # what BLINK itself does with the file: a strict load_state_dict
    BlinkCrossEncoderModule(BertModel(reranker.model.config)).load_state_dict(again, strict=True)
    # and the resolver reads the export back into the same scores
    back = load_reranker(out, config=RerankerConfig(model=tiny_model_dir, max_len=40)).eval()
    p = pairs(back.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(back(p), reranker.eval()(p), rtol=0, atol=0)


def test_legacy_names_and_position_ids(blink, tiny_model_dir, tmp_path):
    state, _ = blink
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    legacy["encoder.bert_model.embeddings.position_ids"] = torch.arange(512)[None]
    assert any(k.endswith("LayerNorm.gamma") for k in legacy)
    reranker = load_blink_reranker(save(legacy, tmp_path), RerankerConfig(model=tiny_model_dir))
    exported = blink_crossencoder_state(reranker)
    assert sorted(exported) == sorted(state)  # modern names, no buffer
    assert all(torch.equal(exported[k], v) for k, v in state.items())
    bad = dict(legacy, **{"encoder.bert_model.embeddings.position_ids": torch.arange(512).flip(0)[None]})
    with pytest.raises(BlinkCheckpointError, match="encoder.bert_model.embeddings.position_ids is not arange"):
        load_blink_reranker(save(bad, tmp_path, "bad.bin"), RerankerConfig(model=tiny_model_dir))


def test_architecture_from_the_weights(tmp_path, tiny_model_dir):
    """Without a model directory the sizes come from the weights (heads = hidden / 64)."""
    from transformers import BertConfig

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                intermediate_size=96, max_position_embeddings=128))
    module = BlinkCrossEncoderModule(bert).eval()
    reranker = load_reranker(save(module.state_dict(), tmp_path), config=RerankerConfig(max_len=40),
                             tokenizer_dir=tiny_model_dir).eval()
    cfg = reranker.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (64, 1, 1, 96)
    p = pairs(reranker.tokenizer)
    with torch.no_grad():
        want = module(*(t.reshape(6, -1) for t in p[:2]), p.mask.reshape(6, -1).long()).reshape(2, 3)
        torch.testing.assert_close(reranker(p), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.update({"encoder.extra.weight": torch.zeros(1)}), r"unexpected keys encoder\.extra\.weight"),
    (lambda s: s.update({"context_encoder.bert_model.x": torch.zeros(1)}),
     r"unexpected keys context_encoder\.bert_model\.x"),
    (lambda s: s.pop("encoder.additional_linear.weight"), r"missing encoder\.additional_linear\.weight"),
    (lambda s: (s.pop("encoder.additional_linear.weight"), s.pop("encoder.additional_linear.bias")),
     r"missing encoder\.additional_linear\.weight, encoder\.additional_linear\.bias: the score head"),
    (lambda s: s.update({"encoder.additional_linear.weight": torch.zeros(2, 32),
                         "encoder.additional_linear.bias": torch.zeros(2)}),
     r"shape mismatch encoder\.additional_linear\.weight \(2, 32\), expected \(1, 32\)"),
    (lambda s: s.pop("encoder.bert_model.encoder.layer.1.output.dense.bias"),
     r"encoder\.bert_model: missing encoder\.layer\.1\.output\.dense\.bias"),
    (lambda s: s.update({"encoder.bert_model.encoder.layer.0.output.dense.weight": torch.zeros(32, 65)}),
     r"shape mismatch encoder\.layer\.0\.output\.dense\.weight \(32, 65\) vs model \(32, 64\)"),
])
def test_wrong_checkpoints_are_refused_by_name(blink, tiny_model_dir, tmp_path, edit, message):
    state, _ = blink
    bad = dict(state)
    edit(bad)
    path = save(bad, tmp_path)
    with pytest.raises(BlinkCheckpointError, match=message) as e:
        load_blink_reranker(path, RerankerConfig(model=tiny_model_dir))
    assert str(path) in str(e.value)


def test_a_biencoder_file_or_junk_is_named(tmp_path, tiny_model_dir):
    bi = save({"context_encoder.bert_model.embeddings.word_embeddings.weight": torch.zeros(4, 2)}, tmp_path)
    with pytest.raises(BlinkCheckpointError, match="unexpected keys context_encoder"):
        load_reranker(bi)
    junk = tmp_path / "junk.bin"
    junk.write_text("not a checkpoint")
    with pytest.raises(BlinkCheckpointError, match=f"{junk}: not a torch.save'd state dict"):
        load_reranker(junk)
    with pytest.raises(FileNotFoundError, match="without manifest.json; expected a dist-nce reranker directory"):
        load_reranker(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere.bin: not found; expected"):
        load_reranker(tmp_path / "nowhere.bin")


def test_cls_head_is_refused_both_ways(blink, tiny_model_dir, tmp_path):
    state, _ = blink
    with pytest.raises(BlinkCheckpointError, match="head 'cls' cannot hold it"):
        load_blink_reranker(save(state, tmp_path), RerankerConfig(model=tiny_model_dir, head="cls"))

    cls_head = Reranker(RerankerConfig(head="cls"), load_transformer(tiny_model_dir), load_tokenizer(tiny_model_dir))
    with pytest.raises(BlinkCheckpointError, match="only head 'pooler' has its layout"):
        export_blink_crossencoder(cls_head, tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists()


def test_saved_directory_still_loads(blink, tiny_model_dir, tmp_path):
    state, _ = blink
    reranker = load_blink_reranker(save(state, tmp_path), RerankerConfig(model=tiny_model_dir, max_len=40))
    reranker.save_pretrained(tmp_path / "dir")
    back = load_reranker(tmp_path / "dir")
    assert back.config == reranker.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), reranker.state_dict().values()))


def test_an_export_whose_heads_are_not_64_wide_reads_back_with_its_own_heads(tmp_path):
    """The head count is not in the weights: the export records it (.architecture.json) and the file
    reads back without a model directory as the reranker it came from; alone it would get hidden / 64."""
    model_dir = make_tiny_bert(tmp_path / "bert", hidden_size=128, num_heads=8, seed=4)
    reranker = Reranker(RerankerConfig(layout="blink", max_len=40, context_len=16), load_transformer(model_dir),
                        load_tokenizer(model_dir)).eval()
    out = export_blink_crossencoder(reranker, tmp_path / "crossencoder_blink.bin")
    back = load_reranker(out, config=RerankerConfig(max_len=40, context_len=16)).eval()
    assert back.model.config.num_attention_heads == 8
    p = pairs(back.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(back(p), reranker(p), rtol=0, atol=0)
    architecture_file(out).unlink()
    assert load_reranker(out, config=RerankerConfig(max_len=40, context_len=16)).model.config.num_attention_heads == 2

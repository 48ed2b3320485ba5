"""A BLINK cross-encoder sees BLINK's input: the mention part padded to max_context_length.

The reference is written from BLINK's code with plain transformers and no dist-nce code:
BLINK's slow ``BertTokenizer`` pieces, ``get_context_representation`` (mention centred,
padded to 32), ``get_candidate_representation`` (padded to 128), ``modify`` (context +
candidate without its [CLS], cut to max_seq_length) and ``to_bert_input`` (token type 1 on
real tokens from position 32, mask on non-padding), scored by a ``BertModel`` holding the
file's weights and BLINK's ``additional_linear`` on the pooler output.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizer

from dist_nce.core.models import default_model_dir
from dist_nce.core.text import encode_entity, encode_mention, load_tokenizer, special_ids
from dist_nce.modeling.blink import BlinkCheckpointError
from dist_nce.modeling.blink_crossencoder import export_blink_crossencoder, layout_file, load_blink_reranker
from dist_nce.modeling.reranker import Reranker, RerankerConfig, build_blink_pairs, build_pairs
from dist_nce.modeling.resolve import load_reranker
from tests.blink_helpers import write_blink_crossencoder

CONTEXT, CAND, SEQ = 32, 128, 256  # crossencoder_wiki_large's max_context_length, max_cand_length, max_seq_length
SHORT = ("The talks in", "Geneva", "were chaired by Kofi Annan .")  # 11 of 32 context tokens
LONG = (" ".join(["the delegates of the northern provinces met again"] * 6), "Geneva",
        " ".join(["and the meeting went on late into the night"] * 6))
ENTITIES = [("Geneva", "Geneva is the second most populous city in Switzerland ."),
            ("Lake Geneva", "Lake Geneva is a deep lake on the north side of the Alps ."),
            ("Geneva Conventions", " ".join(["The Geneva Conventions are treaties of humanitarian law ."] * 30))]


@pytest.fixture(scope="module")
def blink_tok():
    """BLINK's tokenizer: the slow BertTokenizer (lower case) with its three tags as special tokens."""
    tok = BertTokenizer.from_pretrained(default_model_dir(), do_lower_case=True, local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["[unused0]", "[unused1]", "[unused2]"]})
    return tok


def blink_context(tok, left: str, mention: str, right: str, n: int) -> list[int]:
    """BLINK's get_context_representation at max_seq_length n (ids padded with 0)."""
    m = ["[unused0]", *tok.tokenize(mention)[: n - 4], "[unused1]"]
    lt, rt = tok.tokenize(left), tok.tokenize(right)
    lq = (n - len(m)) // 2 - 1
    rq = n - len(m) - lq - 2
    if len(lt) <= lq:
        if len(rt) > rq:
            rq += lq - len(lt)
    elif len(rt) <= rq:
        lq += rq - len(rt)
    lt = lt[-lq:] if lq > 0 else []
    rt = rt[:rq] if rq > 0 else []
    ids = tok.convert_tokens_to_ids(["[CLS]", *lt, *m, *rt, "[SEP]"])
    return ids + [0] * (n - len(ids))


def blink_candidate(tok, title: str, text: str, n: int) -> list[int]:
    """BLINK's get_candidate_representation at max_seq_length n."""
    pieces = [*tok.tokenize(title), "[unused2]", *tok.tokenize(text)][: n - 2]
    ids = tok.convert_tokens_to_ids(["[CLS]", *pieces, "[SEP]"])
    return ids + [0] * (n - len(ids))


def blink_scores(path, tok, mention: tuple[str, str, str], entities) -> torch.Tensor:
    """BLINK's cross-encoder scores [K] of one mention against ``entities`` (title, text)."""
    state = torch.load(path, weights_only=True)
    bert_state = {k.removeprefix("encoder.bert_model."): v for k, v in state.items()
                  if k.startswith("encoder.bert_model.")}
    vocab, d = bert_state["embeddings.word_embeddings.weight"].shape
    layers = 1 + max(int(k.split(".")[2]) for k in bert_state if k.startswith("encoder.layer."))
    bert = BertModel(BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=1,
                                intermediate_size=bert_state["encoder.layer.0.intermediate.dense.weight"].shape[0],
                                max_position_embeddings=bert_state["embeddings.position_embeddings.weight"].shape[0]))
    bert.load_state_dict(bert_state, strict=True)
    bert.eval()
    ctx = blink_context(tok, *mention, CONTEXT)
    rows = [(ctx + blink_candidate(tok, t, x, CAND)[1:])[:SEQ] for t, x in entities]  # modify
    ids = torch.tensor(rows)
    types = torch.zeros_like(ids)
    types[:, CONTEXT:] = (ids[:, CONTEXT:] > 0).long()  # to_bert_input
    with torch.no_grad():
        pooled = bert(input_ids=ids, token_type_ids=types, attention_mask=(ids != 0).long()).pooler_output
    return (pooled @ state["encoder.additional_linear.weight"].T + state["encoder.additional_linear.bias"])[:, 0]


def store_rows(tok, mention, entities, mention_len: int, entity_len: int) -> tuple[np.ndarray, np.ndarray]:
    """What a prepared store holds for them: mention ids [1, Tm] and entity ids [1, K, Te], 0-padded."""
    m = encode_mention(tok, *mention, mention_len)
    es = [encode_entity(tok, t, x, entity_len) for t, x in entities]
    e = np.zeros((1, len(es), entity_len), dtype=np.int64)
    for i, row in enumerate(es):
        e[0, i, :len(row)] = row
    return np.array([m + [0] * (mention_len - len(m))]), e


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    return write_blink_crossencoder(tmp_path_factory.mktemp("cross") / "crossencoder_wiki_large.bin", seed=3,
                                    legacy=False)


@pytest.mark.parametrize("mention,mention_len,entity_len", [(SHORT, 32, 128), (SHORT, 64, 200), (LONG, 32, 128),
                                                            (LONG, 64, 200)])
def test_a_blink_file_scores_as_blink_does(cross, blink_tok, mention, mention_len, entity_len):
    """Any store lengths: the window is re-cut to BLINK's 32, the entity to its 128."""
    reranker = load_reranker(cross).eval()
    assert reranker.config.layout == "blink" and reranker.config.context_len == CONTEXT
    m, e = store_rows(reranker.tokenizer, mention, ENTITIES, mention_len, entity_len)
    with torch.no_grad():
        got = reranker.score(m, e)[0]
    want = blink_scores(cross, blink_tok, mention, ENTITIES)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert float(want.std()) > 1e-2  # a non-trivial comparison


def test_the_packed_layout_differs_on_a_short_context_only(cross, blink_tok):
    """The outside test's finding: equal when the context fills 32 tokens, not on a short one."""
    reranker = load_reranker(cross).eval()
    sp = special_ids(reranker.tokenizer)
    for mention, differs in ((SHORT, True), (LONG, False)):
        m, e = store_rows(reranker.tokenizer, mention, ENTITIES, 32, 128)
        with torch.no_grad():
            packed = reranker(build_pairs(m, e, sp, SEQ))[0]
            blink = reranker(build_blink_pairs(m, e, sp, SEQ, CONTEXT, CAND))[0]
        assert (float((packed - blink).abs().max()) > 1e-2) == differs


def test_blink_pairs_by_position(tiny_model_dir):
    """The layout itself: [CLS] window [SEP] pad..(to C) entity [SEP]; types 1 from C; a cut entity loses its [SEP]."""
    sp = special_ids(load_tokenizer(tiny_model_dir))
    m = torch.tensor([[sp.cls, 7, sp.mention_start, 8, sp.mention_end, 9, sp.sep, 0]])
    e = torch.tensor([[[sp.cls, 20, sp.title_sep, 21, 22, sp.sep, 0], [sp.cls, 30, sp.title_sep, sp.sep, 0, 0, 0]]])
    p = build_blink_pairs(m, e, sp, max_len=14, context_len=9, cand_len=6)
    pad = sp.pad
    assert p.ids[0, 0].tolist() == [sp.cls, 7, sp.mention_start, 8, sp.mention_end, 9, sp.sep, pad, pad,
                                     20, sp.title_sep, 21, 22, sp.sep]  # cand_len 6: 4 tokens, then [SEP]
    assert p.ids[0, 1].tolist()[9:] == [30, sp.title_sep, sp.sep, pad, pad]
    assert p.mask[0, 1].tolist() == [True] * 7 + [False, False] + [True] * 3 + [False, False]
    assert p.token_type_ids[0, 1].tolist() == [0] * 9 + [1] * 3 + [0, 0]
    cut = build_blink_pairs(m, e, sp, max_len=12, context_len=9, cand_len=6)  # BLINK's [:max_seq_length]
    assert cut.ids[0, 0].tolist()[9:] == [20, sp.title_sep, 21] and bool(cut.mask[0, 0, 9:].all())
    with pytest.raises(ValueError, match="no room for an entity"):
        build_blink_pairs(m, e, sp, max_len=10, context_len=9, cand_len=6)


def test_the_projects_own_reranker_keeps_its_packed_layout(tiny_model_dir, tmp_path):
    from dist_nce.modeling.encoder import load_transformer

    torch.manual_seed(0)
    reranker = Reranker(RerankerConfig(max_len=40), load_transformer(tiny_model_dir),
                        load_tokenizer(tiny_model_dir)).eval()
    assert reranker.config.layout == "packed"
    tok = reranker.tokenizer
    m, e = store_rows(tok, SHORT, ENTITIES, 32, 32)
    with torch.no_grad():
        want = reranker(build_pairs(m, e, special_ids(tok), 40))
        torch.testing.assert_close(reranker.score(m, e), want, rtol=0, atol=0)
    reranker.save_pretrained(tmp_path / "dir")
    manifest = json.loads((tmp_path / "dir" / "manifest.json").read_text())
    assert manifest["config"]["layout"] == "packed"
    del manifest["config"]["layout"]  # a reranker saved before layouts were recorded was packed
    (tmp_path / "dir" / "manifest.json").write_text(json.dumps(manifest))
    assert load_reranker(tmp_path / "dir").config.layout == "packed"


def test_a_packed_export_says_so_and_reads_back_packed(tiny_model_dir, tmp_path):
    from dist_nce.modeling.encoder import load_transformer

    reranker = Reranker(RerankerConfig(max_len=40), load_transformer(tiny_model_dir), load_tokenizer(tiny_model_dir))
    out = export_blink_crossencoder(reranker, tmp_path / "crossencoder_blink.bin")
    record = json.loads(layout_file(out).read_text())
    assert record["layout"] == "packed" and not record["blink_scores_as_trained"]
    assert "BLINK pads the mention part" in record["note"]
    back = load_blink_reranker(out, RerankerConfig(model=tiny_model_dir))
    assert (back.config.layout, back.config.max_len) == ("packed", 40)
    explicit = load_blink_reranker(out, RerankerConfig(model=tiny_model_dir, layout="blink"))
    assert explicit.config.layout == "blink"  # a layout given explicitly wins over the record
    layout_file(out).write_text(json.dumps({**record, "context_len": 2}))
    with pytest.raises(BlinkCheckpointError, match=r"crossencoder_blink.layout.json: context_len: 2"):
        load_blink_reranker(out, RerankerConfig(model=tiny_model_dir))
    layout_file(out).write_text("{")
    with pytest.raises(BlinkCheckpointError, match="crossencoder_blink.layout.json: unreadable"):
        load_blink_reranker(out, RerankerConfig(model=tiny_model_dir))


def test_a_blink_layout_config_needs_room_for_the_entity():
    with pytest.raises(ValueError, match="max_len 33 leaves no room for an entity after context_len 32"):
        RerankerConfig(max_len=33, layout="blink").validate()

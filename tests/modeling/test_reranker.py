import random

import numpy as np
import pytest
import torch

from dist_nce.core.text import SpecialIds, assemble_mention_ids
from dist_nce.modeling.reranker import Reranker, RerankerConfig, build_pairs, mention_windows

TOK = SpecialIds(cls=101, sep=102, pad=0, mention_start=1, mention_end=2, title_sep=3)


def _mention(left: list[int], mention: list[int], right: list[int], width: int) -> list[int]:
    row = [TOK.cls, *left, TOK.mention_start, *mention, TOK.mention_end, *right, TOK.sep]
    return row + [TOK.pad] * (width - len(row))


def _entity(title: list[int], desc: list[int], width: int) -> list[int]:
    row = [TOK.cls, *title, TOK.title_sep, *desc, TOK.sep]
    return row + [TOK.pad] * (width - len(row))


def _reference_pair(mention_row: list[int], entity_row: list[int], max_len: int) -> tuple[list, list]:
    """One pair at a time, with lists: the layout of the module docstring."""
    m = [t for t in mention_row if t != TOK.pad][1:-1]
    e = [t for t in entity_row if t != TOK.pad][1:-1]
    u0, u1 = m.index(TOK.mention_start), m.index(TOK.mention_end)
    window = assemble_mention_ids(m[:u0], m[u0 + 1 : u1], m[u1 + 1 :], (max_len - 3) // 2 + 2, TOK)[1:-1]
    e = e[: max_len - 3 - len(window)]
    ids = [TOK.cls, *window, TOK.sep, *e, TOK.sep]
    types = [0] * (len(window) + 2) + [1] * (len(e) + 1)
    pad = max_len - len(ids)
    return ids + [TOK.pad] * pad, types + [0] * pad


def test_window_keeps_mention_centred_by_hand():
    rows = torch.tensor([
        # budget 7: markers + mention take 3, the other 4 split 2 left / 2 right
        _mention([11, 12, 13, 14, 15, 16], [50], [21, 22, 23, 24, 25, 26], 20),
        # right context short: the left takes what the right cannot use
        _mention([11, 12, 13, 14, 15, 16], [50], [21], 20),
        # mention longer than the budget: its first tokens, both markers kept
        _mention([11], [50, 51, 52, 53, 54, 55, 56, 57], [21], 20),
        # everything fits: unchanged
        _mention([11], [50], [], 20),
    ])
    window, lengths = mention_windows(rows, TOK, budget=7)
    assert lengths.tolist() == [7, 7, 7, 4]
    assert [w[:n] for w, n in zip(window.tolist(), lengths.tolist())] == [
        [15, 16, 1, 50, 2, 21, 22],
        [14, 15, 16, 1, 50, 2, 21],
        [1, 50, 51, 52, 53, 54, 2],
        [11, 1, 50, 2],
    ]


def test_build_pairs_matches_per_row_reference():
    rng = random.Random(0)
    max_len, b, k = 23, 5, 4
    mentions = []
    for _ in range(b):
        toks = lambda n: [rng.randrange(1000, 2000) for _ in range(n)]  # noqa: E731
        mentions.append(_mention(toks(rng.randrange(0, 9)), toks(rng.randrange(1, 6)), toks(rng.randrange(0, 9)), 30))
    entities = [
        [_entity([rng.randrange(1000, 2000)], [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 20))], 25)
         for _ in range(k)]
        for _ in range(b)
    ]
    pairs = build_pairs(np.array(mentions, dtype=np.int32), np.array(entities, dtype=np.int32), TOK, max_len)
    assert pairs.ids.shape == pairs.token_type_ids.shape == pairs.mask.shape == (b, k, max_len)
    for i in range(b):
        for j in range(k):
            ids, types = _reference_pair(mentions[i], entities[i][j], max_len)
            assert pairs.ids[i, j].tolist() == ids, (i, j)
            assert pairs.token_type_ids[i, j].tolist() == types, (i, j)
            assert pairs.mask[i, j].tolist() == [t != TOK.pad for t in ids]
            assert sum(t != TOK.pad for t in ids[1 : ids.index(TOK.sep)]) <= (max_len - 3) // 2


def test_build_pairs_rejects_bad_rows():
    good = torch.tensor([_mention([5], [6], [7], 10)])
    ent = torch.tensor([[_entity([8], [9], 8)]])
    no_marker = torch.tensor([[TOK.cls, 5, 6, TOK.sep, 0, 0]])
    with pytest.raises(ValueError, match=r"mention row 0 needs exactly one \[unused0\] and one \[unused1\]"):
        build_pairs(no_marker, ent, TOK, 16)
    no_sep = ent.clone()
    no_sep[0, 0, 4] = 77
    with pytest.raises(ValueError, match=r"entity row 0 \(flattened\) is not a right-padded \[CLS\] ... \[SEP\]"):
        build_pairs(good, no_sep, TOK, 16)
    with pytest.raises(ValueError, match=r"expected mention_ids \[B, Tm\] and entity_ids \[B, K, Te\]"):
        build_pairs(good, ent[0], TOK, 16)


@pytest.fixture(scope="module")
def reranker(tiny_model_dir):
    torch.manual_seed(0)
    return Reranker.build(RerankerConfig(model=tiny_model_dir, max_len=32, dropout=0.0))


def _pairs(reranker: Reranker, b: int = 2, k: int = 3):
    assert reranker.special_ids == TOK  # the MiniLM vocabulary, markers as single tokens
    rng = random.Random(1)
    words = lambda n: [rng.randrange(1000, 2000) for _ in range(n)]  # noqa: E731
    mentions = torch.tensor([_mention(words(4), words(2), words(5), 16) for _ in range(b)])
    entities = torch.tensor([[_entity(words(2), words(6 + j), 20) for j in range(k)] for _ in range(b)])
    return mentions, entities


def test_scores_shape_and_padding_trim_invariance(reranker):
    mentions, entities = _pairs(reranker)
    pairs = build_pairs(mentions, entities, reranker.special_ids, 32)
    reranker.eval()
    with torch.no_grad():
        trimmed = reranker(pairs)
        reranker.config.trim_padding = False
        try:
            full = reranker(pairs)
        finally:
            reranker.config.trim_padding = True
    assert trimmed.shape == (2, 3)
    torch.testing.assert_close(trimmed, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reranker.score(mentions, entities), trimmed.detach(), atol=1e-6, rtol=0)


def test_token_types_matter(reranker):
    mentions, entities = _pairs(reranker)
    pairs = build_pairs(mentions, entities, reranker.special_ids, 32)
    reranker.eval()
    with torch.no_grad():
        a = reranker(pairs)
        b = reranker(pairs._replace(token_type_ids=torch.zeros_like(pairs.token_type_ids)))
    assert not torch.allclose(a, b)


def test_nce_training_step_reaches_encoder_and_head(tiny_model_dir):
    from dist_nce.modeling.losses import nce_loss

    torch.manual_seed(0)
    model = Reranker.build(RerankerConfig(model=tiny_model_dir, max_len=32))
    mentions, entities = _pairs(model)
    loss = nce_loss(model.score(mentions, entities))
    loss.backward()
    for name in ("score_layer.weight", "model.pooler.dense.weight", "model.embeddings.word_embeddings.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_cls_head_freezes_pooler(tiny_model_dir):
    model = Reranker.build(RerankerConfig(model=tiny_model_dir, max_len=32, head="cls"))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.pooler.dense.weight", "model.pooler.dense.bias"}


def test_save_and_load_round_trip(reranker, tmp_path):
    from transformers import AutoModel

    from dist_nce.core.artifacts import ArtifactMismatch, read_manifest

    reranker.save_pretrained(tmp_path / "rr")
    manifest = read_manifest(tmp_path / "rr", "reranker")
    assert manifest["hidden_size"] == 32 and manifest["config"]["head"] == "pooler"
    loaded = Reranker.from_pretrained(tmp_path / "rr").eval()
    AutoModel.from_pretrained(tmp_path / "rr" / "encoder", local_files_only=True)
    mentions, entities = _pairs(reranker)
    reranker.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(mentions, entities), reranker.score(mentions, entities), rtol=0, atol=0)
    with pytest.raises(ArtifactMismatch, match="field 'kind' is 'reranker', expected 'retriever'"):
        read_manifest(tmp_path / "rr", "retriever")
    with pytest.raises(ArtifactMismatch, match="field 'hidden_size' is 32, expected 1024"):
        Reranker.from_pretrained(tmp_path / "rr", expect={"hidden_size": 1024})


def test_config_checks(tiny_model_dir):
    from dist_nce.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match=r"max_len: 8: must be >= 9"):
        from_dict(RerankerConfig, {"max_len": 8})
    with pytest.raises(ValueError, match="max_len 600 exceeds the model's max_position_embeddings 512"):
        Reranker.build(RerankerConfig(model=tiny_model_dir, max_len=600))

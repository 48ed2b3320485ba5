import copy

import pytest
import torch

from dist_nce.modeling.encoder import Encoder
from dist_nce.modeling.retriever import EntityEncoder, Retriever, RetrieverConfig, to_storage
from dist_nce.modeling.scoring import Reps, score_all

PRESETS = [("dual", None), ("poly", 3), ("multi", 3), ("som", None), ("genpoly", 3)]


@pytest.fixture(scope="module")
def base_encoder(tiny_model_dir):
    return Encoder.from_pretrained(tiny_model_dir).eval()


def make(base_encoder, preset="dual", m=None, seed=0, **kw) -> Retriever:
    torch.manual_seed(seed)
    entity = copy.deepcopy(base_encoder)
    with torch.no_grad():  # make the two sides differ, as after finetuning
        for p in entity.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return Retriever(RetrieverConfig(preset=preset, m=m, **kw), copy.deepcopy(base_encoder), entity).eval()


def rows(lengths, t=10, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths).reshape(*lead, -1) if lead else torch.tensor(lengths)
    ids = torch.randint(1000, 3000, (*lengths.shape, t), generator=g)
    mask = torch.arange(t) < lengths[..., None]
    ids[..., 0] = 101
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("preset,m", PRESETS)
def test_entity_reps_are_what_the_preset_needs(base_encoder, preset, m):
    r = make(base_encoder, preset, m)
    ids, mask = rows([6, 2, 4], t=10)
    with torch.no_grad():
        e = r.encode_entities(ids, mask)
        x = r.encode_mentions(*rows([5, 7], t=9, seed=1))
    want = {"dual": ((3, 32), False), "poly": ((3, 32), False), "multi": ((3, 3, 32), True),
            "genpoly": ((3, 3, 32), True), "som": ((3, 6, 32), True)}[preset]
    assert tuple(e.vecs.shape) == want[0] and (e.mask is not None) == want[1]
    if preset == "multi":
        assert e.mask.tolist() == [[True] * 3, [True, True, False], [True] * 3]
    want_m = {"dual": (2, 32), "multi": (2, 32), "poly": (2, 3, 32), "genpoly": (2, 3, 32), "som": (2, 7, 32)}
    assert tuple(x.vecs.shape) == want_m[preset]
    assert (r.codes is not None) == (preset in ("poly", "genpoly"))


@pytest.mark.parametrize("preset,m", PRESETS)
def test_forward_matches_one_pair_at_a_time(base_encoder, preset, m):
    """Batched, trimmed, flattened [B, K] training path vs encoding each pair alone, untrimmed."""
    r = make(base_encoder, preset, m)
    mention_ids, mention_mask = rows([5, 9], t=12, seed=2)
    cand_ids, cand_mask = rows([3, 8, 5, 2, 6, 4], t=11, seed=3, lead=(2,))
    with torch.no_grad():
        scores = r(mention_ids, mention_mask, cand_ids, cand_mask)
        r.config.trim_padding = r.entity_side.trim_padding = False
        want = torch.zeros(2, 3)
        for b in range(2):
            x = r.encode_mentions(mention_ids[b : b + 1], mention_mask[b : b + 1])
            for k in range(3):
                y = r.encode_entities(cand_ids[b, k : k + 1], cand_mask[b, k : k + 1])
                want[b, k] = score_all(r.spec, x, y)[0, 0]
    assert scores.shape == (2, 3)
    torch.testing.assert_close(scores, want, atol=1e-4, rtol=1e-4)


def test_gradients_reach_both_encoders_and_codes(base_encoder):
    from dist_nce.modeling.losses import nce_loss

    r = make(base_encoder, "poly", 3).train()
    loss = nce_loss(r(*rows([5, 9], t=12, seed=2), *rows([3, 8, 5, 2, 6, 4], t=11, seed=3, lead=(2,))))
    loss.backward()
    params = dict(r.named_parameters())
    for name in ("codes", "mention_encoder.model.encoder.layer.0.attention.self.query.weight",
                 "entity_side.encoder.model.encoder.layer.1.output.dense.weight"):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    assert all(p.grad is None for n, p in params.items() if "pooler" in n)


@pytest.mark.parametrize("preset,m", [("dual", None), ("poly", 3), ("som", None)])
def test_bf16_autocast_close_to_fp32(base_encoder, preset, m):
    r = make(base_encoder, preset, m)
    args = (*rows([5, 9], t=12, seed=2), *rows([3, 8, 5, 2, 6, 4], t=11, seed=3, lead=(2,)))
    with torch.no_grad():
        fp32 = r(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = r(*args)
    assert bf16.dtype == torch.float32  # scores accumulate in fp32
    # measured: <= 0.4% of the largest score on this model; bf16 keeps 8 significant bits
    assert (bf16 - fp32).abs().max() <= 0.01 * fp32.abs().max(), (bf16, fp32)


def test_entity_encoder_state_rebuilds_the_entity_side(base_encoder):
    r = make(base_encoder, "multi", 3)
    ids, mask = rows([6, 2, 4], t=10)
    state = r.entity_encoder_state()
    assert all(t.device.type == "cpu" for t in state["weights"].values())
    shard = EntityEncoder.from_state(state)
    with torch.no_grad():
        want = r.encode_entities(ids, mask)
        got = shard(ids, mask)
        torch.testing.assert_close(got.vecs, want.vecs, rtol=0, atol=0)
        assert torch.equal(got.mask, want.mask)
        # the state is a snapshot: training on does not change it, a refresh does
        for p in r.entity_encoder.parameters():
            p.mul_(1.5)
        assert torch.equal(shard(ids, mask).vecs, got.vecs)
        shard.load_state(r.entity_encoder_state())
        torch.testing.assert_close(shard(ids, mask).vecs, r.encode_entities(ids, mask).vecs, rtol=0, atol=0)
    small = r.entity_encoder_state(dtype=torch.bfloat16)
    assert small["weights"]["embeddings.word_embeddings.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="entity state has spec"):
        EntityEncoder.from_state({**state, "spec": {**state["spec"], "key_count": 4}}).load_state(state)
    with pytest.raises(ValueError, match="not an entity-encoder state"):
        EntityEncoder.from_state({"weights": {}})


def test_to_storage_casts_and_refuses_fp16_overflow():
    reps = Reps(torch.randn(4, 3, 8), torch.ones(4, 3, dtype=torch.bool))
    half = to_storage(reps, "float16")
    assert half.vecs.dtype == torch.float16 and half.mask is reps.mask
    torch.testing.assert_close(half.vecs.float(), reps.vecs, atol=2e-3, rtol=1e-3)
    assert to_storage(reps, "bfloat16").vecs.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\|x\| = 7e\+04 > float16 max"):
        to_storage(Reps(torch.tensor([[7e4]])), "float16")


def test_config_errors(base_encoder):
    from dist_nce.core.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="needs m"):
        from_dict(RetrieverConfig, {"preset": "poly"})
    with pytest.raises(ConfigError, match="takes no m"):
        from_dict(RetrieverConfig, {"preset": "dual", "m": 2})
    with pytest.raises(ConfigError, match="storage_dtype"):
        from_dict(RetrieverConfig, {"storage_dtype": "int8"})
    wide = Encoder.from_config({**base_encoder.config_dict(), "hidden_size": 64})
    with pytest.raises(ValueError, match="hidden size 32 != entity encoder 64"):
        Retriever(RetrieverConfig(), base_encoder, wide)


def test_save_and_load_round_trip(tiny_model_dir, tmp_path):
    from transformers import AutoModel

    from dist_nce.core.artifacts import read_manifest

    torch.manual_seed(0)
    r = Retriever.build(RetrieverConfig(preset="genpoly", m=2, mention_model=tiny_model_dir)).eval()
    with torch.no_grad():
        r.codes.mul_(-1)  # not the initial values
    r.save_pretrained(tmp_path / "ret")
    manifest = read_manifest(tmp_path / "ret", "retriever")
    assert (manifest["preset"], manifest["m"], manifest["hidden_size"]) == ("genpoly", 2, 32)
    for side in ("mention_encoder", "entity_encoder"):
        AutoModel.from_pretrained(tmp_path / "ret" / side, local_files_only=True)
    loaded = Retriever.from_pretrained(tmp_path / "ret", expect={"preset": "genpoly", "m": 2}).eval()
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == len(r.tokenizer)
    args = (*rows([5, 9], t=12, seed=2), *rows([3, 8, 5, 2, 6, 4], t=11, seed=3, lead=(2,)))
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), r(*args), rtol=0, atol=0)


def test_from_pretrained_refuses_mismatches(base_encoder, tmp_path):
    import json

    from safetensors.torch import save_file

    from dist_nce.core.artifacts import ArtifactMismatch

    make(base_encoder, "poly", 3).save_pretrained(tmp_path / "ret")
    with pytest.raises(ArtifactMismatch, match="field 'preset' is 'poly', expected 'dual'"):
        Retriever.from_pretrained(tmp_path / "ret", expect={"preset": "dual"})
    with pytest.raises(ArtifactMismatch, match="field 'kind' is 'retriever', expected 'reranker'"):
        from dist_nce.modeling.reranker import Reranker

        Reranker.from_pretrained(tmp_path / "ret")
    save_file({"codes": torch.zeros(4, 32)}, str(tmp_path / "ret" / "codes.safetensors"))
    with pytest.raises(ArtifactMismatch, match=r"codes.safetensors: expected tensor 'codes' of shape \(3, 32\)"):
        Retriever.from_pretrained(tmp_path / "ret")
    path = tmp_path / "ret" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "hidden_size": 48}))
    with pytest.raises(ArtifactMismatch, match="mention_encoder: hidden size 32, manifest says 48"):
        Retriever.from_pretrained(tmp_path / "ret")
    path.write_text(json.dumps({**manifest, "m": 5}))
    with pytest.raises(ArtifactMismatch, match="preset/m poly/5 disagree with config poly/3"):
        Retriever.from_pretrained(tmp_path / "ret")


def test_build_refuses_entity_model_with_another_vocabulary(tiny_model_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="other: tokenizer vocabulary differs from"):
        Retriever.build(RetrieverConfig(mention_model=tiny_model_dir, entity_model=str(other)))
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    r = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir, entity_model=str(same)))
    assert r.entity_encoder.hidden_size == 32

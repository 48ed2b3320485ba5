"""load_retriever / load_reranker: one resolver for saved directories and BLINK checkpoint files."""
import pytest
import torch

from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.core.models import default_model_dir
from dist_nce.core.text import load_tokenizer, tokenizer_fingerprint
from dist_nce.index.encode import state_fingerprint
from dist_nce.modeling.blink import BlinkCheckpointError
from dist_nce.modeling.resolve import load_reranker, load_retriever
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from tests.blink_helpers import tiny_bert, write_blink_biencoder, write_blink_crossencoder


@pytest.fixture(scope="module")
def biencoder(tmp_path_factory):
    return write_blink_biencoder(tmp_path_factory.mktemp("blink") / "biencoder_wiki_large.bin")


def cls_state(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[:, 0]


def test_a_blink_file_is_read_with_the_inferred_architecture(biencoder):
    r = load_retriever(biencoder).eval()
    cfg = r.mention_encoder.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 1)
    assert r.config.preset == "dual"
    # the default tokenizer: the default model's (bert-uncased's vocabulary)
    assert tokenizer_fingerprint(r.tokenizer)["sha256"] == tokenizer_fingerprint(load_tokenizer())["sha256"]
    ids = torch.tensor([[101, 2054, 2003, 102, 0], [101, 3000, 102, 0, 0]])
    mask = ids != 0
    with torch.no_grad():  # legacy gamma/beta names in the file, same embeddings as the source models
        torch.testing.assert_close(r.encode_mentions(ids, mask).vecs, cls_state(tiny_bert(0), ids, mask),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(r.encode_entities(ids, mask).vecs, cls_state(tiny_bert(1), ids, mask),
                                   rtol=0, atol=1e-5)


def test_blink_file_loads_to_the_same_fingerprint_twice(biencoder, tiny_model_dir):
    """Encodings made in one process (encode_kb) are recognised in another (link, evaluate)."""
    a = load_retriever(biencoder, tokenizer_dir=tiny_model_dir)
    b = load_retriever(biencoder)
    assert state_fingerprint(a.entity_encoder_state()) == state_fingerprint(b.entity_encoder_state())


def test_a_blink_file_under_another_preset(biencoder):
    r = load_retriever(biencoder, config=RetrieverConfig(preset="multi", m=3, storage_dtype="float32"))
    assert (r.config.preset, r.config.m, r.config.storage_dtype) == ("multi", 3, "float32")


def test_a_saved_directory(tiny_model_dir, tmp_path):
    saved = Retriever.build(RetrieverConfig(preset="multi", m=2, mention_model=tiny_model_dir))
    saved.save_pretrained(tmp_path / "r")
    r = load_retriever(tmp_path / "r")
    assert (r.config.preset, r.config.m) == ("multi", 2)
    assert state_fingerprint(r.entity_encoder_state()) == state_fingerprint(saved.entity_encoder_state())
    with pytest.raises(ArtifactMismatch, match="preset"):
        load_retriever(tmp_path / "r", config=RetrieverConfig(preset="dual"))


def test_anything_else_is_refused_naming_the_path(tmp_path, biencoder):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: a directory without manifest.json; expected a "
                                                "dist-nce retriever directory"):
        load_retriever(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.bin: not found; expected .* BLINK biencoder checkpoint"):
        load_retriever(tmp_path / "missing.bin")
    with pytest.raises(BlinkCheckpointError, match=r"looks like a BLINK cross-encoder .*: load it as a reranker"):
        load_retriever(write_blink_crossencoder(tmp_path / "cross.bin"))
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(BlinkCheckpointError, match=f"{junk}: not a torch.save'd state dict"):
        load_retriever(junk)


def test_a_blink_crossencoder_file_through_the_reranker_resolver(tmp_path):
    r = load_reranker(write_blink_crossencoder(tmp_path / "crossencoder_wiki_large.bin"))
    assert r.config.head == "pooler" and r.model.config.hidden_size == 64
    assert r.tokenizer is not None and len(r.tokenizer) <= r.model.config.vocab_size
    assert default_model_dir()  # the tokenizer's source when none is given

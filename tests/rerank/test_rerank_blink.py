"""The reranker job starts from BLINK's cross-encoder file and exports BLINK's layout beside its directory."""
import pytest
import torch

from dist_nce.core.config import ConfigError
from dist_nce.core.text import load_tokenizer
from dist_nce.modeling.encoder import load_transformer
from dist_nce.modeling.reranker import Reranker, RerankerConfig
from dist_nce.modeling.resolve import load_reranker
from dist_nce.rerank.config import RerankJobConfig, check_inputs
from dist_nce.rerank.loop import BLINK_FILE, MODEL_DIR, build_reranker, export_reranker
from tests.blink_helpers import write_blink_crossencoder


def test_init_from_a_blink_file_and_export_both_layouts(tmp_path):
    cross = write_blink_crossencoder(tmp_path / "crossencoder_wiki_large.bin", legacy=False)
    cfg = RerankJobConfig()
    cfg.model.init_from, cfg.model.reranker = str(cross), RerankerConfig(model=None, max_len=64)
    reranker = build_reranker(cfg, seed=0)
    assert reranker.config.max_len == 64 and reranker.model.config.hidden_size == 64
    paths = export_reranker(reranker, tmp_path / "run")
    assert paths == {"model": str(tmp_path / "run" / MODEL_DIR), "blink": str(tmp_path / "run" / BLINK_FILE)}
    original, exported = torch.load(cross, weights_only=True), torch.load(paths["blink"], weights_only=True)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    back = load_reranker(paths["model"])
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), reranker.state_dict().values()))


def test_a_start_is_trained_with_the_jobs_pair_length_and_dropout(tmp_path, tiny_model_dir):
    """model.init_from with its own max_len (a saved directory's config, or the layout record our export writes
    beside a BLINK file): the run printed, checked on resume and recorded the config's max_len (48) but trained
    and exported the checkpoint's (64). Now the job's max_len and dropout are trained with; the layout is the
    checkpoint's unless the config sets one; a head the weights do not hold is refused."""
    reranker = Reranker(RerankerConfig(max_len=64, dropout=0.0), load_transformer(tiny_model_dir),
                        load_tokenizer(tiny_model_dir))
    paths = export_reranker(reranker, tmp_path / "start")
    for init in (paths["model"], paths["blink"]):
        cfg = RerankJobConfig()
        cfg.model.init_from = init
        cfg.model.reranker = RerankerConfig(model=tiny_model_dir, max_len=48, dropout=0.3)
        got = build_reranker(cfg, seed=0)
        assert (got.config.max_len, got.config.dropout, got.dropout.p, got.config.layout) == (48, 0.3, 0.3, "packed")
        assert export_reranker(got, tmp_path / "out")  # and what the export records
        assert load_reranker(tmp_path / "out" / MODEL_DIR).config.max_len == 48
        cfg.model.reranker = RerankerConfig(model=tiny_model_dir, max_len=48, layout="blink", context_len=16)
        assert (build_reranker(cfg, seed=0).config.layout, build_reranker(cfg, seed=0).config.context_len) == \
            ("blink", 16)
    cls = Reranker(RerankerConfig(head="cls", max_len=64), load_transformer(tiny_model_dir),
                   load_tokenizer(tiny_model_dir))
    cfg.model.init_from = export_reranker(cls, tmp_path / "cls")["model"]
    cfg.model.reranker = RerankerConfig(model=tiny_model_dir, max_len=48)
    with pytest.raises(ConfigError, match=r"model.reranker.head: 'pooler', but model.init_from .* holds a 'cls' "):
        build_reranker(cfg, seed=0)
    # and before any cluster work (--dry-run, the driver), from the files beside the weights alone
    for init, head, theirs in ((cfg.model.init_from, "pooler", "cls"), (paths["blink"], "cls", "pooler")):
        cfg.model.init_from, cfg.model.reranker = init, RerankerConfig(model=tiny_model_dir, max_len=48, head=head)
        with pytest.raises(ConfigError) as e:  # other inputs (stores, candidates) are missing here
            check_inputs(cfg)
        assert f"model.reranker.head: {head!r}, but model.init_from {init} holds a {theirs!r} head; set " \
               f"model.reranker.head: {theirs}" in str(e.value), str(e.value)
    cfg.model.reranker = RerankerConfig(model=tiny_model_dir, max_len=600)  # the tiny BERT has 512 positions
    with pytest.raises(ConfigError, match=r"model.reranker.max_len: 600 exceeds the max_position_embeddings 512 of"):
        check_inputs(cfg)


def test_a_cls_head_exports_its_directory_only(tmp_path, tiny_model_dir):
    reranker = Reranker(RerankerConfig(head="cls", max_len=64), load_transformer(tiny_model_dir),
                        load_tokenizer(tiny_model_dir))
    paths = export_reranker(reranker, tmp_path)
    assert paths["blink"] is None and "only head 'pooler'" in paths["blink_skipped"]
    assert (tmp_path / MODEL_DIR / "manifest.json").is_file() and not (tmp_path / BLINK_FILE).exists()


def test_check_inputs_takes_a_file_or_a_reranker_directory(tmp_path):
    cross = write_blink_crossencoder(tmp_path / "cross.bin")
    cfg = RerankJobConfig()
    for init, refused in ((str(cross), False), (str(tmp_path), True), (str(tmp_path / "none"), True)):
        cfg.model.init_from = init
        with pytest.raises(ConfigError) as e:  # other inputs (stores, candidates) are missing here
            check_inputs(cfg)
        assert ("model.init_from: neither a reranker directory" in str(e.value)) == refused, str(e.value)


def test_a_packed_reranker_exports_blinks_keys_and_says_the_layout_differs(tmp_path, tiny_model_dir):
    reranker = Reranker(RerankerConfig(max_len=64), load_transformer(tiny_model_dir), load_tokenizer(tiny_model_dir))
    paths = export_reranker(reranker, tmp_path)
    assert paths["blink"] == str(tmp_path / BLINK_FILE) and "BLINK pads the mention part" in paths["blink_note"]
    assert (tmp_path / "crossencoder_blink.layout.json").is_file()
    back = load_reranker(paths["blink"], config=RerankerConfig(model=tiny_model_dir))
    assert (back.config.layout, back.config.max_len) == ("packed", 64)  # read back as trained
    assert load_reranker(paths["model"]).config.layout == "packed"

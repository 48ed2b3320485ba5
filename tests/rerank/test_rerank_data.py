"""Reranker data (training set, plan, evaluation sets) and its sharded evaluation, without Ray.

Synthetic Zeshel; the train store holds ONE train world, so the other train world's
mentions have no gold in it (excluded from training, counted).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.cli.zeshel_reranker import main as reranker_main
from dist_nce.core.config import ConfigError
from dist_nce.core.text import load_tokenizer
from dist_nce.eval.zeshel import evaluate_reranker_split, read_candidates, read_tfidf_candidates
from dist_nce.modeling.encoder import load_transformer
from dist_nce.modeling.reranker import Reranker, RerankerConfig
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.rerank.data import data_order, load_eval_sets, load_training_set, make_plan
from dist_nce.rerank.loop import candidate_scores, evaluate_sets
from kb.prepare import PrepareConfig, prepare
from kb.store import EntityStore, MentionTable
from kb.synthetic import write_zeshel

C = 6


def _write(path, key, lists):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"mention_id": m, key: docs}) + "\n" for m, docs in lists.items()))


def _lists(store: EntityStore, mentions: MentionTable, rng: np.random.Generator) -> dict[str, list[str]]:
    """Per mention: C document ids of its world (plus one unknown id), the gold among them about half the time."""
    out = {}
    ranges = store.world_ranges()
    for mid, world, gold in zip(mentions.mention_ids, mentions.worlds, mentions.gold_rows):
        a, b = ranges.get(world, (0, len(store)))
        rows = [int(r) for r in rng.permutation(np.arange(a, b)) if r != gold][:C]
        if gold >= 0 and rng.random() < 0.5:
            rows[int(rng.integers(C))] = int(gold)
        out[mid] = store.source_ids(rows) + ["NOT-A-DOCUMENT"]
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("rerank_data")
    write_zeshel(root / "src", ["starwars", "military", "muppets", "lego"], 25, 16, seed=2)
    common = dict(zeshel_root=str(root / "src"), model_dir=tiny_model_dir, entity_max_len=32, mention_max_len=32,
                  progress=False)
    prepare(PrepareConfig(out=str(root / "train"), zeshel_worlds="starwars", zeshel_splits="train", **common),
            log=lambda _: None)
    prepare(PrepareConfig(out=str(root / "eval"), zeshel_worlds="val,test", zeshel_splits="val,test", **common),
            log=lambda _: None)
    rng = np.random.default_rng(0)
    for store_dir, splits in (("train", ["train"]), ("eval", ["val", "test"])):
        store = EntityStore(root / store_dir)
        for split in splits:
            lists = _lists(store, MentionTable(root / store_dir, split), rng)
            _write(root / "cands" / f"candidates_{split}.json", "candidates", lists)
            _write(root / "tfidf" / f"{split}.json", "tfidf_candidates", {m: d[::-1] for m, d in lists.items()})
    return root


def config(root, fmt="retriever", **data) -> RerankJobConfig:
    cfg = RerankJobConfig()
    cfg.data.train_store, cfg.data.eval_store = str(root / "train"), str(root / "eval")
    cfg.data.candidates_dir = str(root / ("cands" if fmt == "retriever" else "tfidf"))
    cfg.data.candidates_format, cfg.data.num_candidates = fmt, C
    for k, v in data.items():
        setattr(cfg.data, k, v)
    cfg.optim.batch_size, cfg.optim.epochs = 4, 2
    return cfg


def test_training_set_and_plan(setup):
    ts = load_training_set(config(setup))
    gold = ts.mentions.gold_rows
    worlds = np.array(ts.mentions.worlds)
    # military's mentions have no gold in a starwars-only store: excluded, counted.
    assert set(worlds[gold < 0]) == {"military"} and (gold[ts.mention_idx] >= 0).all()
    assert np.array_equal(ts.cands[:, 0], gold[ts.mention_idx]) and ts.cands.shape[1] == C
    had_gold = ts.candidates.gold_pos[ts.mention_idx] >= 0
    assert np.array_equal(ts.inserted, ~had_gold) and ts.inserted.any() and had_gold.any()
    assert ts.candidates.n_unknown_documents == len(ts.mentions)  # one per line, dropped
    plan = make_plan(config(setup), ts)
    assert plan.excluded_missing_gold == int((gold < 0).sum()) and plan.train_mentions == len(ts.mention_idx)
    assert plan.gold_inserted == int(ts.inserted.sum())
    assert plan.total_steps == 2 * (plan.train_mentions // 4)
    order = data_order(plan)
    seen = np.concatenate([order.mentions(s, 0) for s in range(plan.steps_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == plan.steps_per_epoch * 4  # each example once per epoch
    small = make_plan(config(setup, max_train_mentions=10), load_training_set(config(setup, max_train_mentions=10)))
    assert small.train_mentions + small.excluded_missing_gold == 10


def test_a_resume_with_another_model_or_objective_is_refused(setup):
    """The plan records the settings a resumed run must share (the check every worker's load makes)."""
    from dist_nce.worker.checkpoint import check_resumable

    ts = load_training_set(config(setup))
    plan = make_plan(config(setup), ts).as_dict()
    assert plan["settings"]["optim.lr"] == config(setup).optim.lr and "model.reranker.head" in plan["settings"]
    check_resumable({"plan": plan}, make_plan(config(setup), ts).as_dict(), "ckpt")
    other = config(setup)
    other.optim.lr, other.model.reranker.head = 0.5, "cls"
    with pytest.raises(ValueError, match=r"model.reranker.head: checkpoint 'pooler', now 'cls'; optim.lr: "):
        check_resumable({"plan": plan}, make_plan(other, ts).as_dict(), "ckpt")
    # the score head's dropout: resumed, the rest of the run trained under another one than its first steps
    other = config(setup)
    other.model.reranker.dropout = 0.5
    with pytest.raises(ValueError, match=r"model.reranker.dropout: checkpoint 0.1, now 0.5"):
        check_resumable({"plan": plan}, make_plan(other, ts).as_dict(), "ckpt")


def test_num_candidates_beyond_the_lists_is_refused(setup):
    """The files hold C + 1 = 7 ids per mention (the last unknown to the KB): C = 8 is refused by the
    loaders, naming the key, the value, the file and the length found; C = 7 loads."""
    for load, split in ((load_training_set, "train"), (load_eval_sets, "val")):
        with pytest.raises(ConfigError, match=rf"^data\.num_candidates: 8: \S+candidates_{split}\.json holds at "
                                              "most 7 candidates per mention"):
            load(config(setup, num_candidates=8))
    assert load_training_set(config(setup, num_candidates=7)).cands.shape[1] == 7


def test_a_smaller_num_candidates_uses_the_top_of_each_list(setup):
    full, top = (load_training_set(config(setup, num_candidates=c)) for c in (C, 3))
    assert np.array_equal(top.candidates.rows, full.candidates.rows[:, :3]) and top.cands.shape[1] == 3


@pytest.mark.parametrize("num_candidates, refused", [(7, False), (8, True)])
def test_dry_run_checks_num_candidates_against_the_files(setup, tiny_model_dir, capsys, num_candidates, refused):
    """--dry-run reads the candidate files: C beyond the lists fails before any model or data loads."""
    sets = [f"data.train_store={setup / 'train'}", f"data.eval_store={setup / 'eval'}",
            f"data.candidates_dir={setup / 'cands'}", f"model.reranker.model={tiny_model_dir}",
            f"data.num_candidates={num_candidates}"]
    config_file = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "reranker_tiny_cpu.yaml"
    code = reranker_main(["--config", str(config_file), "--dry-run",
                          *[w for kv in sets for w in ("--set", kv)]])
    err = capsys.readouterr().err
    assert code == (2 if refused else 0), err
    # One problem line per split file (train, val, test), each naming its file.
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("data.num_candidates")]
    assert len(lines) == (3 if refused else 0), err
    assert all(f"{setup / 'cands'}/candidates_" in ln and "holds at most 7 candidates" in ln for ln in lines)


def test_a_run_in_use_is_refused_before_its_data_loads(setup, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Another live job holds the reranker's run.output_dir: status 2, one line naming it and its holder,
    before the candidates are read or Ray starts; with run.backend=local too (no Ray Train storage to share)."""
    import os

    from dist_nce.core.run_lock import acquire

    def loaded(*a, **k):
        raise AssertionError("the training set was loaded")

    monkeypatch.setattr("dist_nce.rerank.data.load_training_set", loaded)
    out = tmp_path / "out"
    sets = [f"data.train_store={setup / 'train'}", f"data.eval_store={setup / 'eval'}",
            f"data.candidates_dir={setup / 'cands'}", f"model.reranker.model={tiny_model_dir}",
            "data.num_candidates=7", f"run.output_dir={out}", f"run.storage_path={tmp_path / 'ray'}"]
    config_file = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "reranker_tiny_cpu.yaml"
    argv = ["--config", str(config_file), *[w for kv in sets for w in ("--set", kv)]]
    capsys.readouterr()
    with acquire(out):
        for backend in ("ray", "local"):
            assert reranker_main([*argv, "--set", f"run.backend={backend}"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: run directory {out} is in use by another job (pid {os.getpid()} "), err
            assert err.count("\n") == 1, err
    assert not (tmp_path / "ray").exists()  # nothing of Ray Train's


def _candidates_as_the_retriever_writes_them(setup, out: Path, edit=lambda split, entry: None) -> Path:
    """setup's candidate files in a directory whose manifest is a retriever's (zeshel.evaluate): each split's
    file, store, mention count and store identity; ``edit`` changes an entry in place."""
    import shutil

    from dist_nce.core.artifacts import write_manifest
    from dist_nce.eval.zeshel import CANDIDATES_KIND
    from dist_nce.index.encode import store_fingerprint

    out.mkdir(parents=True)
    splits = {}
    for store, split in (("train", "train"), ("eval", "val"), ("eval", "test")):
        shutil.copy(setup / "cands" / f"candidates_{split}.json", out)
        splits[split] = {"file": f"candidates_{split}.json", "store": str(setup / store),
                         "mentions": len(MentionTable(setup / store, split)),
                         "store_fingerprint": store_fingerprint(str(setup / store))}
        edit(split, splits[split])
    write_manifest(out, CANDIDATES_KIND, 1, k=C, preset="dual", m=None, setting="own_world", splits=splits,
                   complete=True)
    return out


def test_candidates_made_over_another_store_are_refused_before_any_data_loads(setup, tiny_model_dir, tmp_path,
                                                                            capsys):
    """A reranker pointed at a retriever's candidates with its stores left elsewhere passed --dry-run and failed
    once training began (an outside user: "no candidates for 4755 of 5045 mentions", a traceback). The
    candidates manifest names each split's store: another store is refused by key, in the dry run too."""
    config_file = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "reranker_tiny_cpu.yaml"

    def dry_run(cands: Path) -> tuple[int, str]:
        sets = [f"data.train_store={setup / 'train'}", f"data.eval_store={setup / 'eval'}",
                f"data.candidates_dir={cands}", f"model.reranker.model={tiny_model_dir}", "data.num_candidates=7"]
        capsys.readouterr()
        code = reranker_main(["--config", str(config_file), "--dry-run", *[w for kv in sets for w in ("--set", kv)]])
        return code, capsys.readouterr().err

    same = _candidates_as_the_retriever_writes_them(setup, tmp_path / "same")
    assert dry_run(same) == (0, "")

    def other_train_store(split, entry):
        if split == "train":
            entry["store"], entry["store_fingerprint"] = "/data/other/train", "0" * 64

    code, err = dry_run(_candidates_as_the_retriever_writes_them(setup, tmp_path / "other", other_train_store))
    assert code == 2, err
    assert (f"data.train_store: {setup / 'train'} is not the store the candidates of train in {tmp_path / 'other'} "
            "were made over /data/other/train") in err and "set data.train_store to that store" in err, err
    assert "data.eval_store" not in err  # val and test were made over the eval store given

    def old_manifest_other_val(split, entry):  # a manifest from before store identities: the mention count tells
        del entry["store_fingerprint"]
        if split == "val":
            entry["mentions"] += 5

    code, err = dry_run(_candidates_as_the_retriever_writes_them(setup, tmp_path / "old", old_manifest_other_val))
    n = len(MentionTable(setup / "eval", "val"))
    assert code == 2 and f"data.eval_store: {setup / 'eval'} has {n} mentions of val, but the candidates of val" \
        in err and f"which has {n + 5}" in err, err


def test_candidates_the_checks_cannot_place_fail_by_name_not_by_traceback(setup, tiny_model_dir, tmp_path, capsys):
    """Hand-written candidates (no manifest) for other mentions: the loader's refusal, as one line, status 2."""
    cands = tmp_path / "cands"
    cands.mkdir()
    for split in ("val", "test"):
        (cands / f"candidates_{split}.json").write_text((setup / "cands" / f"candidates_{split}.json").read_text())
    lists = [json.loads(line) for line in (setup / "cands" / "candidates_train.json").read_text().splitlines()]
    _write(cands / "candidates_train.json", "candidates", {"someone-else": lists[0]["candidates"]})
    sets = [f"data.train_store={setup / 'train'}", f"data.eval_store={setup / 'eval'}", f"data.candidates_dir={cands}",
            f"model.reranker.model={tiny_model_dir}", "data.num_candidates=7", f"run.output_dir={tmp_path / 'out'}",
            f"run.storage_path={tmp_path / 'ray'}"]
    config_file = Path(__file__).resolve().parents[2] / "configs" / "zeshel" / "reranker_tiny_cpu.yaml"
    capsys.readouterr()
    assert reranker_main(["--config", str(config_file), *[w for kv in sets for w in ("--set", kv)]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cands / 'candidates_train.json'}: no candidates for ") and \
        err.count("\n") == 1 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def reranker(tiny_model_dir):
    torch.manual_seed(0)
    r = Reranker(RerankerConfig(model=tiny_model_dir, max_len=48, head="cls", dropout=0.0),
                 load_transformer(tiny_model_dir), load_tokenizer(tiny_model_dir)).eval()
    with torch.no_grad():  # spread a random tiny BERT's near-equal scores (see tests/eval)
        for p in r.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return r


@pytest.mark.parametrize("fmt", ["retriever", "tfidf"])
def test_sharded_evaluation_equals_reranking_every_mention(setup, reranker, fmt, tmp_path):
    """Skipping mentions whose gold is not a candidate, and splitting the rest over 2 ranks,
    gives eval.zeshel's report over all mentions; rank 0 writes the choice per mention, from which
    U.Acc and N.Acc are recomputed."""
    cfg = config(setup, fmt)
    sets = load_eval_sets(cfg)
    assert [s.split for s in sets] == ["val", "test"]
    if fmt == "tfidf":
        assert sets[0].source.endswith("tfidf/val.json")
    sent: list = []
    pred_dir = tmp_path / "predictions"
    assert evaluate_sets(reranker, sets, C, 1, rank=1, world=2, all_gather=lambda p: sent.append(p) or [p, p],
                         predictions_dir=pred_dir) is None
    assert not pred_dir.exists()  # rank 0 alone writes
    got = evaluate_sets(reranker, sets, C, 1, rank=0, world=2, all_gather=lambda p: [p, sent.pop(0)],
                        predictions_dir=pred_dir)
    manifest = json.loads((pred_dir / "manifest.json").read_text())
    assert manifest["splits"] == ["val", "test"]
    for s in sets:
        lines = [json.loads(x) for x in (pred_dir / f"{s.split}.jsonl").read_text().splitlines()]
        assert all(list(x) == manifest["fields"] for x in lines)  # every key the lines have, in their order
        assert [x["mention_id"] for x in lines] == list(s.mentions.mention_ids)
        # the labelled document, also for a mention whose gold is not in the KB ("gold" is null there)
        assert [x["gold_label"] for x in lines] == s.mentions.table.column("gold_source_id").to_pylist()
        assert all(x["gold_label"] == x["gold"] for x in lines if x["gold"] is not None)
        assert got[s.split]["predictions_file"] == str(pred_dir / f"{s.split}.jsonl")
        scored = [x for x in lines if x["gold_rank"] >= 0]
        assert all(x["correct"] == (x["prediction"] == x["gold"] is not None) for x in lines)
        assert not any(x["correct"] for x in lines if x["gold_rank"] < 0)
        assert got[s.split]["unnormalized_accuracy"]["micro"] == pytest.approx(
            sum(x["correct"] for x in lines) / len(lines))
        assert got[s.split]["normalized_accuracy"]["micro"] == pytest.approx(
            sum(x["correct"] for x in scored) / len(scored))
    for s in sets:
        raw = read_tfidf_candidates(s.source) if fmt == "tfidf" else read_candidates(s.source)
        want = evaluate_reranker_split(reranker, s.store, s.mentions, raw, C, s.source, batch_size=1, progress=False)
        mine = got[s.split]
        for key in ("unnormalized_accuracy", "normalized_accuracy", f"candidate_recall@{C}"):
            assert mine[key] == want[key], key
        assert 0 < mine["n_gold_not_in_candidates"] < mine["n_mentions"]
        u, n, r = (mine[k]["micro"] for k in ("unnormalized_accuracy", "normalized_accuracy", f"candidate_recall@{C}"))
        assert u == pytest.approx(n * r)


def test_max_eval_mentions(setup):
    sets = load_eval_sets(config(setup, max_eval_mentions=5))
    assert all(len(s.candidates.gold_pos) == 5 and s.candidates.n_extra_mentions > 0 for s in sets)
    full = MentionTable(setup / "eval", "val")
    assert sets[0].mentions.mention_ids == full.mention_ids[:5]
    assert np.array_equal(sets[0].mentions.token_ids([4]), full.token_ids([4]))


def test_empty_slots_score_minus_inf(setup, reranker):
    ts = load_training_set(config(setup))
    cands = ts.cands[:2].copy()
    cands[1, 3:] = -1
    scores = candidate_scores(reranker, reranker, ts.mentions.token_ids(ts.mention_idx[:2]),
                              ts.store.token_ids(np.maximum(cands, 0)), cands, torch.device("cpu"))
    assert scores.shape == (2, C) and torch.isinf(scores[1, 3:]).all() and torch.isfinite(scores[0]).all()
    assert torch.isfinite(scores[1, :3]).all()

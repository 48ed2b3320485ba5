import json
from pathlib import Path

import pytest
import yaml

from dist_nce.core.config import ConfigError, load_config
from dist_nce.minipaper.cells import aida_cells, reranker_cells, zeshel_cells
from dist_nce.minipaper.config import MiniPaperConfig

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path, **parts) -> MiniPaperConfig:
    data = {"seeds": [0, 1, 2], "zeshel": {
        "config": "configs/zeshel/test_tiny.yaml", "set": ["run.progress=false"],
        "warmup": ["negatives.mode=random"], "branch": ["optim.epochs=1"],
        "architectures": {"dual": ["model.retriever.preset=dual"], "som": ["model.retriever.preset=som"]},
        "arms": {"random": ["negatives.mode=random"], "hard": ["negatives.mode=hard"]}}, **parts}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(MiniPaperConfig, path)


def test_every_arm_and_seed_branches_from_its_architectures_one_shared_start(tmp_path):
    cfg = config(tmp_path)
    cells = zeshel_cells(cfg, REPO)
    assert list(cells)[:1] == ["zeshel-dual-start"]
    assert len(cells) == 2 * (1 + 2 * 3)
    start = cells["zeshel-dual-start"]
    assert "negatives.mode=random" in start.sets and "optim.seed=1000" in start.sets
    init = f"model.init_from=<out>/cells/zeshel-dual-start-{start.key(REPO)}/model"
    for arm in ("random", "hard"):
        for seed in (0, 1, 2):
            c = cells[f"zeshel-dual-{arm}-s{seed}"]
            assert init in c.sets and c.sets[-1] == f"optim.seed={seed}" and c.after == ("zeshel-dual-start",)
            assert f"negatives.mode={arm}" in c.sets and "optim.epochs=1" in c.sets
    # the arm's overrides come after the branch's, the shared start's after the arm's: the later wins
    c = cells["zeshel-som-hard-s2"].sets
    assert c.index("optim.epochs=1") < c.index("negatives.mode=hard") < c.index(
        next(s for s in c if s.startswith("model.init_from=")))


def test_keys_follow_settings_and_a_changed_start_rekeys_its_branches(tmp_path):
    a = zeshel_cells(config(tmp_path), REPO)
    b = zeshel_cells(config(tmp_path), REPO)
    assert {n: c.key(REPO) for n, c in a.items()} == {n: c.key(REPO) for n, c in b.items()}
    cfg = config(tmp_path)
    cfg.zeshel.warmup = ["negatives.mode=random", "optim.lr=1e-3"]
    c = zeshel_cells(cfg, REPO)
    assert c["zeshel-dual-start"].key(REPO) != a["zeshel-dual-start"].key(REPO)
    assert c["zeshel-dual-hard-s0"].key(REPO) != a["zeshel-dual-hard-s0"].key(REPO)
    assert c["zeshel-dual-hard-s0"].key(REPO) != a["zeshel-dual-hard-s1"].key(REPO)
    # where a cell's job stops or checkpoints is not its result: a cell time-boxed with run.stop_after_steps
    # keeps its key (its directory and Ray Train run), so the next run continues it instead of starting over
    cfg = config(tmp_path)
    cfg.zeshel.set = [*cfg.zeshel.set, "run.stop_after_steps=5", "run.checkpoint_every_steps=1",
                      "run.tracking.mlflow.experiment=x"]
    boxed = zeshel_cells(cfg, REPO)
    assert {n: c.key(REPO) for n, c in boxed.items()} == {n: c.key(REPO) for n, c in a.items()}
    assert "--set" in (argv := boxed["zeshel-dual-hard-s0"].argv(tmp_path, REPO)) and "run.stop_after_steps=5" in argv
    cfg.zeshel.set = [*cfg.zeshel.set, "run.eval_every_steps=3"]  # what it reports when: part of the result
    assert zeshel_cells(cfg, REPO)["zeshel-dual-hard-s0"].key(REPO) != a["zeshel-dual-hard-s0"].key(REPO)


def test_argv_places_the_run_in_the_cells_directory(tmp_path):
    cells = zeshel_cells(config(tmp_path), REPO)
    c = cells["zeshel-dual-hard-s1"]
    argv = c.argv(tmp_path / "grid", REPO)
    assert argv[:3] == [str(REPO / "jobs/zeshel_retriever.py"), "--config", str(REPO / "configs/zeshel/test_tiny.yaml")]
    sets = argv[4::2]
    assert f"run.output_dir={c.dir(tmp_path / 'grid', REPO)}" in sets
    assert not any("<out>" in s for s in sets)
    assert any(s.startswith(f"model.init_from={tmp_path / 'grid'}/cells/zeshel-dual-start-") for s in sets)


def test_no_warmup_means_every_cell_starts_from_the_base_model(tmp_path):
    cfg = config(tmp_path)
    cfg.zeshel.warmup = None
    cells = zeshel_cells(cfg, REPO)
    assert len(cells) == 2 * 2 * 3 and not any(s.startswith("model.init_from") for c in cells.values() for s in c.sets)


def test_reranker_cells_rerank_the_same_seeds_retriever_and_aida_cells_cover_arms_and_seeds(tmp_path):
    cfg = config(tmp_path, aida={"architectures": {"dual": []}, "arms": {"random": [], "mixed50": ["negatives.p=50"]}})
    z = zeshel_cells(cfg, REPO)
    rr = reranker_cells(cfg, z, [("dual", "hard"), ("dual", "random")], REPO)
    assert len(rr) == 6
    c = rr["rerank-dual-hard-s2"]
    assert c.after == ("zeshel-dual-hard-s2",)
    assert f"data.candidates_dir=<out>/cells/zeshel-dual-hard-s2-{z['zeshel-dual-hard-s2'].key(REPO)}/candidates" in c.sets
    assert sorted(aida_cells(cfg)) == sorted(f"aida-dual-{a}-s{s}" for a in ("random", "mixed50") for s in range(3))


def test_a_part_can_run_its_own_seeds_and_table_2_follows_the_retrievers(tmp_path):
    cfg = config(tmp_path, aida={"seeds": [5], "architectures": {"dual": []}, "arms": {"random": [], "hard": []}})
    cfg.zeshel.seeds = [3, 4]
    assert sorted(aida_cells(cfg)) == ["aida-dual-hard-s5", "aida-dual-random-s5"]
    z = zeshel_cells(cfg, REPO)
    assert sorted(n for n in z if n.startswith("zeshel-dual-hard")) == ["zeshel-dual-hard-s3", "zeshel-dual-hard-s4"]
    assert sorted(reranker_cells(cfg, z, [("dual", "hard")], REPO)) == ["rerank-dual-hard-s3", "rerank-dual-hard-s4"]
    cfg.reranker.seeds = [4]
    assert list(reranker_cells(cfg, z, [("dual", "hard")], REPO)) == ["rerank-dual-hard-s4"]


@pytest.mark.parametrize("patch, message", [
    ({"seeds": [1, 1]}, "distinct seeds"),
    ({"aida": {"seeds": []}}, "aida.seeds: need distinct seeds"),
    ({"zeshel": {"seeds": [0, 1]}, "reranker": {"seeds": [2]}}, r"reranker.seeds: \[2\] have no zeshel retriever run"),
    ({"zeshel": {"architectures": {"dual": []}, "arms": {"hard": []}}}, "'random' arm"),
    ({"zeshel": {"branch": ["optim.lr"]}}, "is not key=value"),
    ({"zeshel": {"architectures": {"du al": []}, "arms": {"random": []}}}, "architectures.du al"),
    ({"zeshel": {"epochs": 2}}, "unknown key"),
    ({"reranker": {"enabled": True}}, "zeshel.architectures is empty"),
])
def test_bad_configs_name_the_key(tmp_path, patch, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(patch))
    with pytest.raises(ConfigError, match=message):
        load_config(MiniPaperConfig, path)


def test_the_one_unseen_world_job_is_the_dual_and_som_grids_cell_for_cell():
    """configs/mini_paper/minilm_unseen_cpu.yaml runs both MiniLM grids of docs/mini_paper.md as one job: its
    cells carry the names and keys (so the directories) of minilm_cpu.yaml's and minilm_som_cpu.yaml's."""
    def cells(name):
        cfg = load_config(MiniPaperConfig, REPO / "configs" / "mini_paper" / name)
        return {c.name: (c.key(REPO), c.after) for c in zeshel_cells(cfg, REPO).values()}

    dual, som, both = cells("minilm_cpu.yaml"), cells("minilm_som_cpu.yaml"), cells("minilm_unseen_cpu.yaml")
    assert len(dual) == len(som) == 10 and both == {**dual, **som}
    # The committed runs are these very cells: the job reuses their directories, or reruns their settings.
    for run, arch in (("minilm", "dual"), ("minilm_som", "som")):
        committed = json.loads((REPO / "docs" / "mini_paper" / run / "mini_paper.json").read_text(encoding="utf-8"))
        assert {c["name"]: Path(c["dir"]).name for c in committed["cells"]} == \
            {n: f"{n}-{key}" for n, (key, _) in both.items() if n.startswith(f"zeshel-{arch}-")}
    for name in ("minilm_cpu.yaml", "minilm_som_cpu.yaml", "minilm_unseen_cpu.yaml"):
        cfg = load_config(MiniPaperConfig, REPO / "configs" / "mini_paper" / name)
        assert not cfg.reranker.enabled and cfg.seeds == [0, 1, 2], name


def _store(path: Path, made: str) -> None:
    """A prepared store as store_fingerprint reads it: its manifest (a store prepared again has another)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"kind": "store", "created_utc": made}))


def test_a_rerun_reuses_cells_of_the_same_inputs_and_stops_at_one_finished_on_inputs_rebuilt_since(tmp_path):
    """A cell's key hashes its settings, not what its paths hold: each finished cell records what it read
    (stores by manifest, models by content, its shared start by what the start reads). A cell recorded on a
    store rebuilt in place since is refused, one line naming it and the input; a cell of the same inputs is
    reused, and so is one finished before cells recorded their inputs."""
    from dist_nce.minipaper.cells import INPUTS, StaleCell, cell_inputs, changed_inputs, record_inputs, reusable

    _store(tmp_path / "train", "1")
    _store(tmp_path / "eval", "1")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1}')
    cfg = config(tmp_path, seeds=[0, 1])
    cfg.zeshel.architectures = {"dual": []}
    cfg.zeshel.set = [f"data.prepared_dir={tmp_path / 'train'}", f"zeshel.eval_store={tmp_path / 'eval'}",
                      f"model.retriever.mention_model={model}"]
    cfg.zeshel.warmup = ["negatives.mode=random", f"deepspeed.config={ds}"]  # read by the shared start alone
    cells = zeshel_cells(cfg, REPO)
    out = tmp_path / "grid"

    def finish(name: str, record: bool = True) -> Path:
        d = cells[name].dir(out, REPO)
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.json").write_text(json.dumps({"done": True}))
        if record:
            record_inputs(d, cell_inputs(cells[name], out, REPO, cells))
        return d

    for name in ("zeshel-dual-start", "zeshel-dual-random-s0", "zeshel-dual-hard-s0"):
        finish(name)
    finish("zeshel-dual-random-s1", record=False)  # finished before cells recorded their inputs
    # zeshel-dual-hard-s1 never finished
    recorded = json.loads((cells["zeshel-dual-hard-s0"].dir(out, REPO) / "summary.json").read_text())[INPUTS]
    assert set(recorded) == {"data.prepared_dir", "zeshel.eval_store", "model.retriever.mention_model",
                             "model.init_from", "deepspeed.config"}
    start_dir = cells["zeshel-dual-start"].dir(out, REPO)
    assert recorded["model.init_from"].startswith(f"cell {start_dir.name}: ")
    finished, unchecked = reusable(cells, out, REPO)
    assert set(finished) == {"zeshel-dual-start", "zeshel-dual-random-s0", "zeshel-dual-hard-s0",
                             "zeshel-dual-random-s1"}
    assert unchecked == ["zeshel-dual-random-s1"]

    # the train store prepared again in place; the start and hard-s0 trained again on it, random-s0 not
    _store(tmp_path / "train", "2")
    finish("zeshel-dual-start")
    finish("zeshel-dual-hard-s0")
    with pytest.raises(StaleCell) as e:
        reusable(cells, out, REPO)
    msg = str(e.value)
    assert msg.startswith("cell zeshel-dual-random-s0 finished on other inputs: data.prepared_dir, model.init_from "
                          "changed"), msg  # its own store, and the start's
    assert "hard-s0" not in msg and "more cells" not in msg and "another --out" in msg and "\n" not in msg
    finish("zeshel-dual-random-s0")
    assert len(reusable(cells, out, REPO)[0]) == 4

    # the start's export written again (its manifest's time), the start run again on the same inputs: the
    # branches are still its branches; what the start alone reads, changed, makes them another grid's
    (start_dir / "model").mkdir()
    (start_dir / "model" / "manifest.json").write_text('{"created_utc": "later"}')
    assert len(reusable(cells, out, REPO)[0]) == 4
    before = cell_inputs(cells["zeshel-dual-hard-s0"], out, REPO, cells)
    ds.write_text('{"train_micro_batch_size_per_gpu": 2}')
    assert changed_inputs(before, cell_inputs(cells["zeshel-dual-hard-s0"], out, REPO, cells)) == ["model.init_from"]
    with pytest.raises(StaleCell, match=r"^cell zeshel-dual-start finished on other inputs: deepspeed.config "
                                        r"changed .*\(and 2 more cells: "):
        reusable(cells, out, REPO)

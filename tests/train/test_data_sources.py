"""The AIDA job's data section against what it would do: a source it would ignore, a store of the user's
own that the tiny configs' synthetic data would meet, a store cut at other token lengths, BLINK's
entity.jsonl as a source, and a rerun whose plan its checkpoints cannot resume; each refused before
any cluster work, naming the key. Last, what a Ctrl-C during training tells the user."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dist_nce.core.config import ConfigError
from dist_nce.train.config import check_inputs
from dist_nce.train.data import ensure_prepared
from kb.prepare import PrepareConfig, prepare
from kb.synthetic import write_kilt
from tests.train.tinyrun import tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def own(tmp_path_factory, tiny_model_dir):
    """A user's BLINK entity.jsonl and AIDA files, and the store jobs/prepare_kb.py makes of them
    (its default lengths: entities 128, mentions 32)."""
    root = tmp_path_factory.mktemp("own")
    paths = write_kilt(root / "src", 120, 24, 8, 4, seed=3, blink=True)
    prepare(PrepareConfig(out=str(root / "store"), blink_entities=str(paths["blink"]), aida_dir=str(root / "src"),
                          model_dir=tiny_model_dir, progress=False), log=lambda s: None)
    return root, paths


def problems(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg)
    return str(e.value)


def test_aida_files_without_a_kb_are_refused_not_ignored(tmp_path, own, tiny_model_dir):
    root, _ = own
    # the tiny config generates synthetic data: the user's AIDA files alone used to be dropped silently
    said = problems(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", f"data.aida_dir={root / 'src'}"))
    assert "data.aida_dir:" in said and "data.kilt_knowledge_source or data.blink_entities" in said
    said = problems(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", f"data.aida_dir={root / 'src'}",
                                f"data.kilt_knowledge_source={root / 'src' / 'kilt_knowledgesource.json'}",
                                f"data.blink_entities={root / 'src' / 'entity.jsonl'}"))
    assert "data.kilt_knowledge_source and data.blink_entities: give one KB source" in said


def test_a_store_of_ones_own_is_trained_on_once_synthetic_data_is_off(tmp_path, own, tiny_model_dir):
    root, _ = own
    store = f"data.prepared_dir={root / 'store'}"
    said = problems(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", store, "data.entity_max_len=128"))
    assert f"{root / 'store'} holds a store prepared from {root / 'src' / 'entity.jsonl'} (blink)" in said
    assert "set data.synthetic_entities=0" in said
    # synthetic data off: the store as it is, at its own lengths
    cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", store, "data.synthetic_entities=0",
                      "data.entity_max_len=128")
    check_inputs(cfg)
    manifest = json.loads((root / "store" / "manifest.json").read_text())
    assert ensure_prepared(cfg.data, tiny_model_dir, log=lambda s: None) == str(root / "store")
    assert json.loads((root / "store" / "manifest.json").read_text()) == manifest
    # at other lengths: refused by the config check (so by --dry-run), not first by the run
    said = problems(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", store, "data.synthetic_entities=0"))
    assert f"data.entity_max_len is 32 but the store {root / 'store'} was prepared with 128" in said
    with pytest.raises(ValueError, match="data.entity_max_len is 32"):
        ensure_prepared(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", store,
                                    "data.synthetic_entities=0").data, tiny_model_dir, log=lambda s: None)


def test_synthetic_data_and_its_store_moved_together_are_still_the_configs(tmp_path, tiny_model_dir):
    import shutil

    def cfg(root: Path):
        return tiny_config(root, tiny_model_dir, root / "run")

    ensure_prepared(cfg(tmp_path / "a").data, tiny_model_dir, log=lambda s: None)
    shutil.move(tmp_path / "a", tmp_path / "b")  # to shared storage, say: the manifest names the old paths
    check_inputs(cfg(tmp_path / "b"))
    logs: list[str] = []
    assert ensure_prepared(cfg(tmp_path / "b").data, tiny_model_dir, log=logs.append) == str(tmp_path / "b" /
                                                                                            "prepared")
    assert logs == []  # reused as it is


def test_blink_entities_are_a_source_of_the_job(tmp_path, own, tiny_model_dir):
    root, paths = own
    cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", f"data.prepared_dir={tmp_path / 'kb'}",
                      f"data.blink_entities={paths['blink']}", f"data.aida_dir={root / 'src'}")
    check_inputs(cfg)  # a source given: the tiny config's synthetic settings are not used
    ensure_prepared(cfg.data, tiny_model_dir, log=lambda s: None)
    got = json.loads((tmp_path / "kb" / "manifest.json").read_text())
    own_store = json.loads((root / "store" / "manifest.json").read_text())
    assert got["source"]["format"] == "blink" and got["source"]["entity_files"] == [str(paths["blink"])]
    assert got["entities"]["count"] == own_store["entities"]["count"] == 120
    assert got["mentions"]["train"]["gold"] == own_store["mentions"]["train"]["gold"]
    assert not (tmp_path / "data").exists()  # nothing synthetic was written


def test_a_malformed_source_line_stops_the_job_with_its_key_or_is_skipped(tmp_path, own, tiny_model_dir):
    root, paths = own
    lines = paths["blink"].read_text().splitlines()
    lines[7] = lines[7][:20]  # cut off mid-object
    bad = tmp_path / "entity.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    sets = [f"data.prepared_dir={tmp_path / 'kb'}", f"data.blink_entities={bad}", f"data.aida_dir={root / 'src'}"]
    with pytest.raises(ValueError, match=rf"(?s){bad}:8: not JSON.*set data.on_bad_record=skip"):
        ensure_prepared(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets).data, tiny_model_dir,
                        log=lambda s: None)
    ensure_prepared(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets, "data.on_bad_record=skip").data,
                    tiny_model_dir, log=lambda s: None)
    got = json.loads((tmp_path / "kb" / "manifest.json").read_text())
    assert got["entities"]["count"] == 119 and got["skipped"]["count"] == 1
    assert got["skipped"]["records"][0]["line"] == 8
    # --dry-run (check_existing_store) without the skip: refused as the run refuses to prepare over that store,
    # not "OK" and then refused at once by the run; with it, OK
    from dist_nce.cli.aida_finetune import _check_existing_store as check_existing_store  # the job's --dry-run hook

    with pytest.raises(ConfigError, match=rf"^data.prepared_dir: {tmp_path / 'kb'} already holds a prepared store "
                                          r"from other inputs \(differs in: on_bad_record\).*: "
                                          r"data.prepared_dir=<another directory> to keep it$"):
        check_existing_store(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets,
                                         "data.synthetic_entities=0"))
    check_existing_store(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets, "data.synthetic_entities=0",
                                     "data.on_bad_record=skip"))
    with pytest.raises(ValueError, match="differs in: on_bad_record"):  # what the run says, for comparison
        ensure_prepared(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets).data, tiny_model_dir,
                        log=lambda s: None)


def test_a_missing_shipped_path_run_elsewhere_says_where_it_is(tmp_path, tiny_model_dir, monkeypatch):
    from dist_nce.core.config import load_config
    from dist_nce.train.config import TrainJobConfig, with_absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = with_absolute_paths(load_config(TrainJobConfig, REPO / "configs" / "aida" / "test_tiny.yaml",
                                          [f"model.retriever.mention_model={tiny_model_dir}"]))
    said = problems(cfg)
    assert f"deepspeed.config: file not found: {tmp_path / 'configs' / 'deepspeed'}" in said
    assert f"{REPO / 'configs' / 'deepspeed'}" in said and f"run from {REPO}" in said


# --------------------------------------------------------------------------- a rerun that cannot resume

def save_both_ranks(engine, directory: Path, step: int, plan: dict) -> None:
    """What the plan's two workers write into one checkpoint directory, from this one-process engine: each
    rank's part, and rank 0's ZeRO partition copied as rank 1's (the engine holds rank 0's only)."""
    from dist_nce.worker import checkpoint

    for rank in (1, 0):
        checkpoint.save(engine, directory, checkpoint.WorkerState(step=step), rank=rank, plan=plan)
    for part in directory.rglob("*zero_pp_rank_0_*"):
        part.with_name(part.name.replace("rank_0_", "rank_1_")).write_bytes(part.read_bytes())


@pytest.fixture(scope="module")
def engine(dist_env):
    from dist_nce.worker.engine import build_engine, load_deepspeed_config

    torch.manual_seed(0)
    ds = load_deepspeed_config(REPO / "configs" / "deepspeed" / "zero2_fp32.json", micro_batch=2, world_size=1,
                               grad_clip=1.0)
    eng, _, _ = build_engine(torch.nn.Linear(4, 2), ds, lr=1e-2, weight_decay=0.0, total_steps=4,
                             warmup_proportion=0.0, dist_init_required=True)
    return eng


def test_a_rerun_its_checkpoints_cannot_resume_is_refused_before_ray(tmp_path, own, engine, tiny_model_dir,
                                                                     capsys, monkeypatch):
    """What the workers would refuse at load (worker.checkpoint.check_resumable), each restart logging its
    traceback after the shards encoded the KB, is refused by the driver first: exit 2, no Ray started."""
    import ray

    from dist_nce.cli.aida_finetune import main
    from dist_nce.train.trainer import check_resume, plan_for
    from dist_nce.worker import checkpoint

    # every ray.init the job makes and whether it got to the cluster part (an earlier test of this process
    # may have left Ray up, so ray.is_initialized() would not tell)
    inits: list = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append((a, k)))
    monkeypatch.setattr("dist_nce.train.driver.run_training", lambda *a, **k: inits.append("run_training"))

    root, _ = own
    sets = [f"data.prepared_dir={root / 'store'}", "data.synthetic_entities=0", "data.entity_max_len=128"]
    cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets)
    check_resume(cfg)  # no checkpoint yet: a new run
    run_dir = Path(cfg.run.storage_path) / cfg.run.name
    plan = plan_for(cfg).as_dict()

    def save(name: str, step: int, plan: dict) -> None:
        save_both_ranks(engine, run_dir / name, step, plan)
        assert checkpoint.incomplete(run_dir / name) is None

    save("checkpoint_000000", 2, plan)
    check_resume(cfg)  # the same plan resumes
    lr = cfg.optim.lr
    for change, what in (("optim.batch_size=8", "global_batch: checkpoint 4, now 8"),
                         ("run.num_workers=1", "num_workers: checkpoint 2, now 1"),
                         # the same shapes, another model or objective: a finished run rerun so re-reported its
                         # weights under the new settings and overwrote its summary
                         ("model.retriever.preset=multi,model.retriever.m=2",
                          "model.retriever.m: checkpoint None, now 2; model.retriever.preset: checkpoint 'dual', "
                          "now 'multi'"),
                         ("optim.lr=0.01", f"optim.lr: checkpoint {lr!r}, now 0.01")):
        with pytest.raises(ConfigError, match=re.escape(what)):
            check_resume(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets, *change.split(",")))
    # what changes only speed or bookkeeping resumes, and so does the same model at another path (a
    # `ray job submit --working-dir` copy of the project): the resume loads the checkpoint's weights
    moved = shutil.copytree(tiny_model_dir, tmp_path / "copy_of_the_model")
    check_resume(tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets, "run.eval_every_steps=7",
                             "model.retriever.storage_dtype=float32", "negatives.prefetch=1",
                             f"model.retriever.mention_model={moved}"))
    # a KB changed under the run (its fingerprint), through the job as a user runs it
    save("checkpoint_000001", 3, {**plan, "data_fingerprint": "an earlier KB"})
    argv = ["--config", str(REPO / "configs" / "aida" / "test_tiny.yaml"),
            *(a for s in [*sets, f"model.retriever.mention_model={tiny_model_dir}",
                          f"run.output_dir={tmp_path / 'run' / 'out'}", f"run.storage_path={cfg.run.storage_path}"]
              for a in ("--set", s))]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot resume this run with a different plan (data_fingerprint: checkpoint 'an earlier KB'" in err
    assert str(run_dir / "checkpoint_000001") in err and inits == []
    assert f"use another run.name for a new run, or move {run_dir} away to start this one over from step 0" in err


def test_a_dry_run_checks_what_the_run_checks_once_its_store_exists(tmp_path, own, tiny_model_dir, capsys):
    """--dry-run prepares nothing, and said OK to a K or a shard count the run then refused at once: with
    the store there, it checks them (and a rerun's checkpoints) against it, saying which store."""
    from dist_nce.cli.aida_finetune import main

    root, _ = own
    argv = ["--config", str(REPO / "configs" / "aida" / "test_tiny.yaml"), "--dry-run"]
    for s in (f"data.prepared_dir={root / 'store'}", "data.synthetic_entities=0", "data.entity_max_len=128",
              f"model.retriever.mention_model={tiny_model_dir}", f"run.output_dir={tmp_path / 'out'}",
              f"run.storage_path={tmp_path / 'ray'}"):
        argv += ["--set", s]
    capsys.readouterr()
    assert main(argv) == 0 and "config and inputs OK" in capsys.readouterr().out
    for change, what in (("negatives.num_candidates=500", "negatives.num_candidates: 500: must be <= the 120"),
                         ("service.num_shards=121", "service.num_shards: 121: must be <= the 120")):
        assert main([*argv, "--set", change]) == 2
        err = capsys.readouterr().err
        assert what in err and f"checked against the prepared store as it is now, {root / 'store'}" in err, err
    # no store yet: nothing to check it against, the run checks it once prepared
    assert main([*argv, "--set", f"data.prepared_dir={tmp_path / 'none'}", "--set", "data.synthetic_entities=200",
                 "--set", "negatives.num_candidates=500"]) == 0


def test_a_ctrl_c_during_training_says_how_to_go_on(tmp_path, own, engine, tiny_model_dir, capsys, monkeypatch):
    """Ray Train (2.60) aborts the run on SIGINT and the driver's ray.get raises SystemExit(1): the job says
    where a rerun resumes instead of ending with status 1 and no word (seen by hand, a job under SIGINT:
    exit 130 and the step its rerun then resumed at). The step is the one Ray Train's snapshot records, not
    a checkpoint a worker wrote after it; a cut snapshot resumes from the newest whole checkpoint."""
    from dist_nce.cli.aida_finetune import main
    from dist_nce.cli.common import interrupted
    from dist_nce.train.trainer import plan_for
    from dist_nce.worker.launch import SNAPSHOT

    def abort(*a, **k):
        raise SystemExit(1)  # what ray.get raises in the driver once Ray Train aborted the run

    monkeypatch.setattr("dist_nce.train.driver.run_training", abort)
    root, _ = own
    sets = [f"data.prepared_dir={root / 'store'}", "data.synthetic_entities=0", "data.entity_max_len=128",
            f"model.retriever.mention_model={tiny_model_dir}", f"run.output_dir={tmp_path / 'out'}",
            f"run.storage_path={tmp_path / 'ray'}"]
    capsys.readouterr()
    assert main(["--config", str(REPO / "configs" / "aida" / "test_tiny.yaml"),
                 *(a for s in sets for a in ("--set", s))]) == 130
    assert capsys.readouterr().err == \
        "interrupted before a whole checkpoint was written: the same command again starts the run over\n"

    def stopped(*a, **k):
        raise KeyboardInterrupt

    # Ctrl-C while the job prepares its KB: how it goes on, as jobs/prepare_kb.py says it, not a traceback
    monkeypatch.setattr("dist_nce.train.data.ensure_prepared", stopped)
    assert main(["--config", str(REPO / "configs" / "aida" / "test_tiny.yaml"),
                 *(a for s in sets for a in ("--set", s))]) == 130
    assert capsys.readouterr().err == f"interrupted while preparing the data ({root / 'store'}): the chunks done " \
        "are kept; run the same command again to resume\n"
    cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / "run", *sets[:3])
    run_dir = Path(cfg.run.storage_path) / cfg.run.name
    for step in (4, 5):
        save_both_ranks(engine, run_dir / f"step_{step:08d}", step, plan_for(cfg).as_dict())
    # stopped before Ray Train recorded either (no snapshot): the rerun resumes the newest whole one
    assert interrupted(cfg.run) == 130
    assert capsys.readouterr().err == \
        f"interrupted: run the same command again to resume from step 5 ({run_dir / 'step_00000005'})\n"
    (run_dir / SNAPSHOT).write_text(json.dumps({"latest_checkpoint_result": {
        "checkpoint_dir_name": "step_00000004", "metrics": {"step": 4}}}))
    assert interrupted(cfg.run) == 130  # step 5 was written after the last report Ray Train took
    assert capsys.readouterr().err == \
        f"interrupted: run the same command again to resume from step 4 ({run_dir / 'step_00000004'})\n"
    (run_dir / SNAPSHOT).write_text("")  # cut off: recover_unrecorded takes the newest whole checkpoint
    assert interrupted(cfg.run) == 130
    assert capsys.readouterr().err == \
        f"interrupted: run the same command again to resume from step 5 ({run_dir / 'step_00000005'})\n"

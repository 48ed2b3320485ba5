"""Every job refuses a bad flag value before any work: exit status 2, one line naming the flag and
the value, no traceback, no output written, no Ray started (issue 25, item 6).

The jobs run in this process (``dist_nce.cli.<job>.main``, what ``jobs/<job>.py`` calls), so a
row costs milliseconds; the inputs are dummy paths wherever the refusal comes first, which is
itself the point: a job that read them before checking its flags would fail differently.
"""
from __future__ import annotations

import importlib
import json
import re
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py"))

AIDA = "configs/aida/tiny_cpu.yaml"
RETRIEVER = "configs/zeshel/retriever_tiny_cpu.yaml"
RERANKER = "configs/zeshel/reranker_tiny_cpu.yaml"
MINI = "configs/mini_paper/tiny_cpu.yaml"

# Placeholders, filled per test: {dir} an existing empty directory, {file} an existing file, {full} a
# directory holding a file, {out} an output path that must still be absent afterwards.
BASE = {
    "prepare_kb": ["--out", "{out}", "--kilt-ks", "{file}"],
    "update_kb": ["--store", "{dir}", "--add", "{file}"],
    "encode_kb": ["--prepared", "{dir}", "--model", "{dir}", "--out", "{out}"],
    "import_encodings": ["--encodings", "{file}", "--model", "{dir}", "--prepared", "{dir}", "--out", "{out}"],
    "evaluate_kilt_aida": ["--model", "{dir}", "--store", "{dir}", "--out", "{out}", "--searcher", "local"],
    "link": ["--run", "{dir}", "--text", "Tulsa is in [Oklahoma] ."],
    "aida_finetune": ["--config", AIDA],
    "zeshel_retriever": ["--config", RETRIEVER],
    "zeshel_reranker": ["--config", RERANKER],
    "zeshel_grid": ["--config", RETRIEVER, "--rows", "configs/zeshel/grid_tiny_rows.yaml", "--out", "{out}"],
    "bias_experiment": ["--out", "{out}"],
    "mini_paper": ["--config", MINI, "--out", "{out}"],
    "demo": [],
}

# (job, flag, bad value, text the message must hold besides the flag and the value, or None). The value
# is appended to the job's valid arguments: argparse checks every occurrence of a flag.
ROWS = [
    ("prepare_kb", "--workers", "0", "must be >= 1"),
    ("prepare_kb", "--chunk-size", "12Q", "byte count"),
    ("prepare_kb", "--chunk-size", "0", "byte count"),
    ("prepare_kb", "--mention-max-len", "4", "must be >= 5"),
    ("prepare_kb", "--entity-max-len", "x", "not an integer"),
    ("prepare_kb", "--rows-per-part", "0", "must be >= 1"),
    ("prepare_kb", "--min-gold-resolution", "1.5", "must be in [0, 1]"),
    ("prepare_kb", "--on-bad-record", "ignore", "must be one of error, skip"),
    ("prepare_kb", "--kilt-ks", "/no/such/kb.json", "not found"),
    ("prepare_kb", "--aida-dir", "{file}", "not a directory"),
    ("update_kb", "--workers", "0", "must be >= 1"),
    ("update_kb", "--chunk-size", "12Q", "byte count"),
    ("update_kb", "--format", "wiki", "must be one of kilt, blink, zeshel"),
    ("update_kb", "--on-bad-record", "ignore", "must be one of"),
    ("update_kb", "--store", "/no/such/store", "not found"),
    ("update_kb", "--remove", "/no/such/ids.txt", "not found"),
    ("update_kb", "--model-dir", "{file}", "not a directory"),
    ("encode_kb", "--num-shards", "0", "must be >= 1"),
    ("encode_kb", "--m", "0", "must be >= 1"),
    ("encode_kb", "--num-cpus", "-1", "must be >= 0"),
    ("encode_kb", "--num-gpus", "x", "not a number"),
    ("encode_kb", "--threads", "0", "must be >= 1"),
    ("encode_kb", "--batch-size", "0", "must be >= 1"),
    ("encode_kb", "--preset", "tri", "must be one of"),
    ("encode_kb", "--storage-dtype", "int8", "must be one of"),
    ("encode_kb", "--export-dtype", "bfloat16", "must be one of float32, float16"),
    ("encode_kb", "--encode-dtype", "fp8", "must be one of"),
    ("encode_kb", "--prepared", "/no/such/kb", "not found"),
    ("encode_kb", "--tokenizer", "/no/such/tok", "not found"),
    ("encode_kb", "--model", "/no/such/model", "--model not found"),
    ("import_encodings", "--num-shards", "0", "must be >= 1"),
    ("import_encodings", "--row-grid", "-2", "must be >= 1"),
    ("import_encodings", "--chunk-rows", "1e3", "not an integer"),
    ("import_encodings", "--storage-dtype", "int8", "must be one of"),
    ("import_encodings", "--encodings", "/no/such/m.t7", "not found"),
    ("import_encodings", "--ids", "/no/such/ids.jsonl", "not found"),
    ("import_encodings", "--train-config", "/no/such.yaml", "not found"),
    ("evaluate_kilt_aida", "--k", "0", "must be >= 1"),
    ("evaluate_kilt_aida", "--ks", "1,x", "not an integer"),
    ("evaluate_kilt_aida", "--ks", "0", "must be >= 1"),
    ("evaluate_kilt_aida", "--splits", "dev,val", "unknown val"),
    ("evaluate_kilt_aida", "--searcher", "remote", "must be one of service, local"),
    ("evaluate_kilt_aida", "--batch-size", "0", "must be >= 1"),
    ("evaluate_kilt_aida", "--threads", "-1", "must be >= 1"),
    ("evaluate_kilt_aida", "--device", "gpu0", "device"),
    ("evaluate_kilt_aida", "--store", "/no/such/kb", "not found"),
    ("evaluate_kilt_aida", "--aida-dir", "/no/such/aida", "not found"),
    ("evaluate_kilt_aida", "--service-config", "/no/such.yaml", "not found"),
    ("link", "--k", "0", "must be >= 1"),
    ("link", "--searcher", "remote", "must be one of local, service"),
    ("link", "--kb", "disk", "must be one of snapshot, encode"),
    ("link", "--threads", "0", "must be >= 1"),
    ("link", "--format", "csv", "must be one of jsonl, kilt"),
    ("link", "--format", "kilt", "give --input"),
    ("link", "--store", "/no/such/kb", "not found"),
    ("link", "--model", "/no/such/model", "not found"),
    ("link", "--snapshot", "/no/such/snap", "not found"),
    ("link", "--reranker", "/no/such/rr", "not found"),
    ("link", "--config", "/no/such.yaml", "not found"),
    ("link", "--run", "{file}", "not a directory"),
    ("aida_finetune", "--config", "/no/such.yaml", "not found"),
    ("zeshel_retriever", "--config", "/no/such.yaml", "not found"),
    ("zeshel_reranker", "--config", "{dir}", "not a file"),
    ("zeshel_grid", "--only", "som_best", "no rows named som_best"),
    ("zeshel_grid", "--only", ",", "comma-separated"),
    ("zeshel_grid", "--rows", "/no/such_rows.yaml", "not found"),
    ("bias_experiment", "--updates", "-1", "must be >= 0"),
    ("bias_experiment", "--threads", "0", "must be >= 1"),
    ("bias_experiment", "--config", "/no/such.yaml", "not found"),
    ("bias_experiment", "--out", "{file}", "not a directory"),
    ("mini_paper", "--only", "zeshel,tables", "unknown tables"),
    ("mini_paper", "--only", "reranker", "add zeshel"),
    ("mini_paper", "--config", "/no/such.yaml", "not found"),
    ("demo", "--name", "../x", "plain name"),
    ("demo", "--config", "no/such.yaml", "not found"),
]

# Config-driven jobs keep the config's form, ``file: key: value: why``: (job, --set item, message part).
CONFIG_ROWS = [
    ("aida_finetune", "optim.lr=-1", f"--set (over {AIDA}): optim.lr: -1.0: must be > 0"),
    ("zeshel_retriever", "optim.lr=0", f"--set (over {RETRIEVER}): optim.lr: 0.0: must be > 0"),
    ("zeshel_reranker", "optim.lr=-1", f"--set (over {RERANKER}): optim.lr: -1.0: must be > 0"),
    ("zeshel_grid", "optim.lr=-1", "optim.lr: -1.0: must be > 0"),
    ("bias_experiment", "num_draws=0", "--set: num_draws: 0: must be"),
    ("mini_paper", "seeds=[]", None),
    ("evaluate_kilt_aida", "num_shards=0", "--set: num_shards: 0: must be >= 1"),
    ("link", "k=0", "k: 0: must be >= 1"),
    ("demo", "optim.lr=-1", "optim.lr: -1.0: must be > 0"),
]


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("{}\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("x")
    return {"dir": str(tmp_path / "dir"), "file": str(tmp_path / "file"), "full": str(tmp_path / "full"),
            "out": str(tmp_path / "out")}


@pytest.fixture(autouse=True)
def ray_inits(monkeypatch):
    """Every ray.init call a job makes (none should: earlier tests in this process may have left Ray up,
    so ``ray.is_initialized()`` alone would not tell)."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append((a, k)))
    return calls


# A line Ray's log monitor streams to a driver: "(raylet) ..." or "(Actor pid=123) ...", maybe colored.
RAY_LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?\((raylet|gcs_server|[A-Za-z_:.]+ pid=\d+|pid=\d+)[^)]*\)")


def refused(job: str, argv: list[str], paths: dict, capsys) -> str:
    """Run ``job``'s main in this process; assert it ended at once with status 2 and no side effect;
    return its stderr."""
    import ray

    main = importlib.import_module(f"dist_nce.cli.{job}").main
    argv = [a.format(**paths) for a in argv]
    ray_up = ray.is_initialized()
    capsys.readouterr()
    t0 = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusal
        code = e.code
    seconds = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    # The job's own lines: a Ray an earlier test of this process left up streams its processes' log lines
    # to this stderr too (seen: the raylet's "over 95% full" disk warning in the middle of a refusal).
    own = [line for line in err.strip().splitlines() if not RAY_LOG_LINE.match(line)]
    assert len(own) == 1, err
    assert not Path(paths["out"]).exists(), f"{job} created its output before refusing"
    assert ray.is_initialized() == ray_up
    assert seconds < 5, f"{job} took {seconds:.1f} s to refuse: it did work first"
    return err


def test_every_job_is_in_the_table():
    assert sorted(BASE) == JOBS
    for job in JOBS:  # the wrapper runs the module the table tests
        assert f"from dist_nce.cli.{job} import main" in (REPO / "jobs" / f"{job}.py").read_text()
    assert {r[0] for r in ROWS} == set(JOBS)


@pytest.mark.parametrize("job, flag, value, why", ROWS, ids=[f"{j} {f} {v}" for j, f, v, _ in ROWS])
def test_a_bad_value_is_refused_before_any_work(job, flag, value, why, paths, capsys, monkeypatch, ray_inits):
    monkeypatch.chdir(REPO)
    err = refused(job, [*BASE[job], flag, value], paths, capsys)
    value = value.format(**paths)
    assert f"{flag}: {value}" in err or f"{value}: {flag}" in err, err
    assert not ray_inits
    assert why is None or why in err, err


@pytest.mark.parametrize("job, item, why", CONFIG_ROWS, ids=[f"{j} {i}" for j, i, _ in CONFIG_ROWS])
def test_a_bad_config_value_is_refused_as_file_key_value(job, item, why, paths, capsys, monkeypatch, ray_inits):
    monkeypatch.chdir(REPO)
    err = refused(job, [*BASE[job], "--set", item], paths, capsys)
    key = item.split("=")[0]
    assert key in err and (why is None or why in err), err
    assert not ray_inits


def test_update_kb_compact_into_a_non_empty_directory_is_refused_up_front(paths, capsys):
    """No flag lets --compact replace a directory: before, the rename at its very end failed (OSError)."""
    err = refused("update_kb", ["--store", "{dir}", "--compact", "--out", "{full}"], paths, capsys)
    assert f"--out: {paths['full']}: not empty" in err
    assert sorted(p.name for p in Path(paths["full"]).iterdir()) == ["kept.txt"]


def test_link_kilt_format_checks_every_line_before_the_model_loads(paths, capsys, tmp_path):
    """A line --format kilt cannot write is refused before linking: no partial guess file."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "a", "input": "x [START_ENT] Paris [END_ENT] y"}) + "\n"
                   + json.dumps({"text": "Paris and Rome", "mentions": [[0, 5], [10, 14]]}) + "\n")
    out = Path(paths["out"])
    err = refused("link", ["--run", "{dir}", "--input", str(src), "--output", str(out), "--format", "kilt"],
                  paths, capsys)
    assert f"{src}:2: --format kilt needs an 'id' and exactly one mention per line" in err
    assert not out.exists()


def test_link_output_in_a_missing_directory_is_refused(paths, capsys):
    err = refused("link", ["--run", "{dir}", "--input", "{file}", "--output", "/no/such/dir/out.jsonl"], paths,
                  capsys)
    assert "--output: /no/such/dir/out.jsonl: directory /no/such/dir not found" in err


@pytest.mark.parametrize("job", ["aida_finetune", "zeshel_retriever", "zeshel_reranker", "zeshel_grid", "mini_paper",
                                 "bias_experiment", "demo", "link"])
def test_every_job_with_a_config_prints_its_fields(job, capsys, monkeypatch, ray_inits):
    """``--help-config`` (the README promises it for every job with ``--config``/``--set``): each field with
    its type and help, status 0, no Ray and nothing else needed (no other flag)."""
    monkeypatch.chdir(REPO)
    main = importlib.import_module(f"dist_nce.cli.{job}").main
    capsys.readouterr()
    try:
        code = main(["--help-config"])
    except SystemExit as e:  # printed during parsing, as --help is
        code = e.code
    out = capsys.readouterr().out
    assert code in (0, None) and re.search(r"^ *\w+: .+  # ", out, re.M), out[:2000]
    assert not ray_inits


def test_the_jobs_with_a_config_are_the_ones_above():
    """Every job whose --help offers --config and --set is in the list above."""
    import contextlib
    import io

    with_config = []
    for job in JOBS:
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
            importlib.import_module(f"dist_nce.cli.{job}").main(["--help"])
        if "--config" in text.getvalue() and "--set" in text.getvalue():
            with_config.append(job)
    assert sorted(with_config) == sorted(["aida_finetune", "zeshel_retriever", "zeshel_reranker", "zeshel_grid",
                                          "mini_paper", "bias_experiment", "demo", "link"])

"""Every shell command in README.md and the docs/ pages runs as written on a fresh clone, or is checked as far
as this machine allows.

The ```bash / ```sh / ```console blocks of README.md and of every docs/*.md page (PAGES: the README links
out to the pages that hold its running-on-a-cluster, real-data and linking commands) are extracted
(continuation lines joined, comments dropped) and each command must match exactly one rule of RULES, which
says how it is checked. A command no rule matches fails ``test_every_readme_command_is_classified``: neither
the README nor a page can gain a command nobody checks.

How each kind is checked, in a copy of the tracked files (a fresh clone: no data/, runs/,
models or .venv; git's working-tree content, so uncommitted edits are what is tested):

* ``run``: run as written with the project's Python first on PATH (slow ones marked slow).
  Inputs a user brings (the KILT knowledge source, AIDA/, zeshel/, entity.jsonl, a trained
  model) are made first from the project's synthetic generators under the README's names;
* ``dry_run``: the job with ``--dry-run``: the config parses, every key and range is valid
  and every input exists (the tiny model is built by the job). A paper config may miss only
  inputs under /mnt/shared (the cluster's shared storage docs/cluster.md tells you to fill); the
  reranker may miss only what the README's retriever command writes;
* ``make``: ``make -n`` of the target (a fresh clone would create .venv first), and the job
  lines of its recipe are dry-run in turn;
* ``ray``: cluster commands are not started here (a head on the default port would collide
  with other clusters on the machine; tests/cluster/test_head.py starts one on free ports): every
  flag must be one the installed ``ray`` CLI accepts, JSON resources must parse, and the job a
  ``ray job submit`` runs is dry-run;
* ``shell``: runs in bash (with HOME in a scratch directory when it writes to ~).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The README and every page under docs/ (where the README's longer sections live).
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # the project's venv: `python` and `ray` in README commands
SHELL_LANGS = {"bash", "sh", "console"}
SHARED = "/mnt/shared/"  # the shared storage of docs/cluster.md's commands; absent here by design


@dataclass(frozen=True)
class Command:
    line: int  # line of the command's first line in its page
    text: str  # as written, continuation lines joined (what bash runs)
    words: tuple[str, ...]  # shlex words, comments dropped (what rules match)
    page: str = "README.md"  # the file it is written in, relative to the repository

    @property
    def joined(self) -> str:
        return " ".join(self.words)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.joined}"


def readme_commands(text: str, page: str = "README.md") -> list[Command]:
    """The commands of every shell code block of ``text`` (the file ``page``), in order. In ```console
    blocks only ``$ `` lines are commands (the rest is output)."""
    out: list[Command] = []
    lang: str | None = None
    pending: tuple[int, str] | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w-]*)", raw)
        if fence:
            if pending:
                raise ValueError(f"{page}:{pending[0]}: code block ends inside a continued command")
            lang = None if lang is not None else fence.group(1).lower()
            continue
        if lang not in SHELL_LANGS:
            continue
        line = raw.strip()
        if pending is None:
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            pending = (n, line)
        else:
            pending = (pending[0], pending[1][:-1].rstrip() + " " + line)
        if not pending[1].endswith("\\"):
            first, cmd = pending
            pending = None
            out.append(Command(first, cmd, tuple(shlex.split(cmd, comments=True)), page))
    if lang is not None:
        raise ValueError(f"{page}: a code block is never closed")
    return out


COMMANDS = [c for path in PAGES
            for c in readme_commands(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]

# --- rules: (kind, fullmatch regex over the command's words joined by spaces, why) -------------------
RULES: list[tuple[str, str, str]] = [
    ("make", r"make (demo|test|zeshel)", "make -n; the recipe's job lines dry-run"),
    ("shell", r"ray get-auth-token --generate > /dev/null && chmod 600 ~/\.ray/auth_token",
     "writes the token under a scratch HOME"),
    ("shell", r"export RAY_AUTH_MODE=token", "a shell builtin"),
    ("ray", r"(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_ADDRESS=127\.0\.0\.1:6379 )?ray start .*",
     "flags checked against `ray start --help`; not started (port 6379)"),
    ("ray", r"ray job submit .* -- python jobs/\w+\.py .*", "flags checked; the submitted job dry-run"),
    ("dry_run", r"python jobs/(aida_finetune|zeshel_retriever|zeshel_reranker|zeshel_grid|mini_paper)\.py .*",
     "a training run or grid takes minutes to hours: config and inputs checked (make zeshel runs the "
     "Zeshel pair; tests/jobs run each job on tiny data)"),
    ("run", r"python jobs/prepare_kb\.py .*", "on synthetic inputs written under the README's names"),
    ("run", r"python jobs/(encode_kb|evaluate_kilt_aida)\.py .*",
     "on the store the README's prepare command makes and a tiny retriever at runs/x/model"),
    ("run", r"python -m kb\.synthetic (kilt|zeshel) .*", "as written"),
    ("run", r"python jobs/bias_experiment\.py .*", "as written (~10 s)"),
    ("update", r"python jobs/update_kb\.py --store data/kilt .*",
     "on the store the README's prepare command makes, with a few new KILT pages and removed ids"),
    ("run", r"python jobs/import_encodings\.py .*",
     "on BLINK-layout files made under docs/real_data.md's names (blink_files): a tiny biencoder and its encodings"),
    ("link", r"(\.venv/bin/)?python jobs/link\.py --(run \$RUN|model \S+) .*",
     "needs the demo's run: arguments parsed by the job's own parser, inputs are files make demo writes "
     "(tests/link runs the job on a tiny exported run)"),
    ("link", r"RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (\.venv/bin/)?serve run \S+( run=\$RUN)?",
     "the import path or YAML resolves to the Serve application (tests/link/test_serve.py serves it)"),
    ("link", r"RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (\.venv/bin/)?python -m dist_nce\.cli\.serve_link "
             r"\S+\.yaml( [\w.]+=\S+)*",
     "the YAML's app with the overrides is a valid ServeConfig, its edge on loopback and Serve's proxy off "
     "(tests/link/test_serve_hostile.py serves it)"),
    ("link", r"curl -s -X POST http://127\.0\.0\.1:8000/(link)? .*", "loopback; the body is a valid link request"),
]


def classify(cmd: Command) -> str:
    kinds = [kind for kind, pattern, _ in RULES if re.fullmatch(pattern, cmd.joined)]
    if len(kinds) != 1:
        what = "no rule" if not kinds else f"several rules ({kinds})"
        raise AssertionError(f"{cmd}\n  {what} in tests/test_readme_commands.py RULES says how this command is "
                             "checked; add one (run it with tiny settings, or dry-run it)")
    return kinds[0]


def test_readme_has_commands_and_extraction_is_exact():
    """The extractor sees the blocks it should (a broken fence or language tag would silently
    drop commands: then every other test here passes vacuously), in the README and in each page
    its moved sections live on."""
    joined = [c.joined for c in COMMANDS if c.page == "README.md"]
    assert "make demo" in joined and "make test" in joined and "make zeshel" in joined
    assert len(COMMANDS) >= 20
    per_page = {page: [c for c in COMMANDS if c.page == page] for page in
                ("docs/cluster.md", "docs/real_data.md", "docs/linking.md")}
    assert all(len(cmds) >= 3 for cmds in per_page.values()), {p: len(c) for p, c in per_page.items()}
    # a continued command is one command, its comment dropped
    grids = [c for c in COMMANDS if "jobs/zeshel_grid.py" in c.text]
    assert len(grids) == 1, "README.md and docs/ should show the Zeshel grid command once"
    assert grids[0].words[-2:] == ("--out", "runs/zeshel_grid") and "#" not in grids[0].joined


def test_extractor_handles_console_prompts_and_continuations():
    text = ("```console\n$ make demo   # note\nsome output\n```\n"
            "```python\nprint('not shell')\n```\n"
            "```sh\npython jobs/x.py --a 1 \\\n    --b '{\"k\": 1}'\n# comment\n```\n"
            "```\nfolder tree\n```\n")
    cmds = readme_commands(text)
    assert [(c.line, c.words) for c in cmds] == [(2, ("make", "demo")), (9, ("python", "jobs/x.py", "--a", "1",
                                                                             "--b", '{"k": 1}'))]
    with pytest.raises(ValueError, match="never closed"):
        readme_commands("```bash\nmake demo\n")
    assert str(readme_commands("```bash\nmake demo\n```\n", "docs/x.md")[0]) == "docs/x.md:2: make demo"


def test_every_readme_command_is_classified():
    problems = []
    for cmd in COMMANDS:
        try:
            classify(cmd)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


def test_unclassified_command_fails():
    with pytest.raises(AssertionError, match=r"(?s)README.md:7: kubectl apply .*no rule"):
        classify(Command(7, "kubectl apply -f x.yaml", ("kubectl", "apply", "-f", "x.yaml")))


# --- the fresh clone ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files (working-tree content), nothing else: no data/, runs/, .venv."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    root = tmp_path_factory.mktemp("fresh_clone")
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the working tree is not part of the clone
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    assert not (root / "data").exists() and (root / "jobs" / "zeshel_retriever.py").exists()
    return root


def env_for(root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu",
           "RAY_USAGE_STATS_ENABLED": "0", **extra}
    # The clone's own code (a fresh clone's `make venv` installs the clone), not the checkout's, to
    # which the venv's editable install maps dist_nce and kb.
    env["PYTHONPATH"] = str(root)
    return env


def sh(root: Path, script: str, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=root, env=env_for(root, **extra), capture_output=True,
                          text=True, timeout=timeout)


def ok(r: subprocess.CompletedProcess, what: object) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{what}\n  exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


# --- dry runs -------------------------------------------------------------------------------------------

def problems_of(stderr: str) -> list[str]:
    """The lines of an ``error: invalid inputs:`` message (one per missing input)."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    return lines[lines.index("error: invalid inputs:") + 1:] if "error: invalid inputs:" in lines else []


def retriever_outputs(root: Path) -> list[str]:
    """What the README's Zeshel retriever command writes: its stores and candidates directory."""
    from dist_nce.core.config import load_config
    from dist_nce.zeshel.config import ZeshelRetrieverConfig, absolute, candidates_dir

    cmds = [c for c in COMMANDS if re.fullmatch(r"python jobs/zeshel_retriever\.py .*", c.joined)]
    assert cmds, "README.md: the reranker's candidates need the README's zeshel_retriever command"
    args = cmds[0].words[2:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    cfg = absolute(load_config(ZeshelRetrieverConfig, root / args[args.index("--config") + 1], sets), str(root))
    return [cfg.data.prepared_dir, cfg.zeshel.eval_store, candidates_dir(cfg)]


def job_module(root: Path, script: str):
    """The module the clone's ``jobs/<job>.py`` runs: ``dist_nce.cli.<job>``."""
    name = f"dist_nce.cli.{Path(script).stem}"
    assert re.fullmatch(r"jobs/\w+\.py", script) and f"from {name} import main" in (root / script).read_text(), script
    return importlib.import_module(name)


def run_job_main(root: Path, script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``python <script> <argv>`` in-process (a subprocess costs ~10 s of imports per command on 2
    loaded cores), with the clone as working directory: every relative path resolves there, as
    for a user in a fresh clone. The job's code is the checkout's (the clone holds the same bytes)."""
    import contextlib
    import io

    module = job_module(root, script)
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(root)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = module.main(argv)
            except SystemExit as e:  # argparse: an unknown flag or a bad value
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(), err.getvalue())


def dry_run(root: Path, words: tuple[str, ...], what: object) -> None:
    assert words[0] == "python" and words[1].startswith("jobs/"), what
    r = run_job_main(root, words[1], [*words[2:], "--dry-run"])
    if r.returncode == 0:
        assert "config and inputs OK" in r.stdout, f"{what}\n{r.stdout}"
        if "configs/zeshel/" in " ".join(words) and "_paper_" not in " ".join(words):
            # the tiny configs name data/models/tiny_bert: the job built it, loadable offline
            assert (root / "data" / "models" / "tiny_bert" / "config.json").exists(), what
        return
    problems = problems_of(r.stderr)
    assert r.returncode == 2 and problems, f"{what}\n  exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    if "jobs/zeshel_reranker.py" in words[1]:
        # Only the README retriever command's outputs may be missing (the recipe that makes them).
        made = retriever_outputs(root)
        stray = [p for p in problems if not any(p.endswith(m) or f"{m}/" in p or f"{m}:" in p for m in made)]
        assert not stray, f"{what}\n  inputs no README command creates: {stray}\n  (retriever writes {made})"
        return
    # A paper config on the cluster's shared storage: only external downloads there may be missing.
    stray = [p for p in problems if not re.fullmatch(rf"(model|data)\.[\w.]+: (file|directory) not found: "
                                                     rf"{re.escape(SHARED)}\S+", p)]
    assert not stray, f"{what}\n  missing inputs outside {SHARED}: {stray}"


# --- ray CLI flags ----------------------------------------------------------------------------------------

def ray_options(*sub: str) -> set[str]:
    """The options of ``ray <sub>`` as the installed CLI defines them (its click commands, read
    in-process: ``ray ... --help`` costs ~10 s of imports per call here)."""
    from ray.scripts.scripts import cli

    command = cli
    for name in sub:
        assert name in command.commands, f"ray has no command {' '.join(sub)}"
        command = command.commands[name]
    return {opt for param in command.params for opt in param.opts + param.secondary_opts}


def check_ray(root: Path, cmd: Command) -> None:
    words = list(cmd.words)
    while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value before the command
        words.pop(0)
    inner: tuple[str, ...] = ()
    if "--" in words:
        words, inner = words[:words.index("--")], tuple(words[words.index("--") + 1:])
    sub = tuple(w for w in words[1:3] if not w.startswith("-"))
    options = ray_options(*sub)
    for w in words:
        if not w.startswith("--"):
            continue
        flag, _, value = w.partition("=")
        assert flag in options, f"{cmd}\n  `ray {' '.join(sub)}` has no option {flag}"
        if flag == "--resources":
            assert isinstance(json.loads(value), dict), cmd
    if "--working-dir" in words:
        assert (root / words[words.index("--working-dir") + 1] / "jobs").is_dir(), cmd
    if inner:
        dry_run(root, inner, cmd)


# --- link -------------------------------------------------------------------------------------------------

def check_link(root: Path, cmd: Command) -> None:
    words = list(cmd.words)
    if words[0] == "curl":
        from dist_nce.link.inputs import parse_docs

        body = json.loads(words[words.index("-d") + 1])
        assert set(body) <= {"docs", "k"} and parse_docs(body["docs"]), cmd
        return
    if words[0] == "RAY_AUTH_MODE=token":  # serve run <import path or YAML> [run=$RUN]
        # the local Ray that `serve run` starts stays on loopback only with this variable
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in words, cmd
        if "dist_nce.cli.serve_link" in words:  # python -m dist_nce.cli.serve_link <YAML> [key=value ...]
            import yaml

            from dist_nce.cli.serve_link import overridden
            from dist_nce.core.config import from_dict
            from dist_nce.link.config import ServeConfig

            at = words.index("dist_nce.cli.serve_link") + 1
            config = yaml.safe_load((root / words[at]).read_text())
            (app,) = config["applications"]
            args = overridden(app["args"], [w.replace("$RUN", "runs/demo/T/") for w in words[at + 1:]])
            serve = from_dict(ServeConfig, args)
            assert config["proxy_location"] == "Disabled" and serve.edge_host == "127.0.0.1" and serve.edge_port, cmd
            return
        target = words[words.index("run") + 1]
        if target.endswith((".yaml", ".yml")):
            import yaml

            config = yaml.safe_load((root / target).read_text())
            args = config["applications"][0]["args"]
            # clients at the app's edge, on loopback; Serve's own proxy off
            assert config["proxy_location"] == "Disabled" and args["edge_host"] == "127.0.0.1", cmd
            target = config["applications"][0]["import_path"]
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), cmd
        return
    args = job_module(root, words[1]).parse_args([w.replace("$RUN", "runs/demo/T/") for w in words[2:]])
    if args.blink_scores:  # one of BLINK's benchmark files, under the names its scripts give them (run on tiny
        # ones by tests/link/test_link_job.py)
        assert args.input.startswith("BLINK_benchmark/") and args.input.endswith(".jsonl"), cmd
    elif args.input:  # a file `make demo` writes (the demo's synthetic KILT AIDA dev split)
        assert args.input.startswith("data/demo/synthetic/") and args.input.endswith("-kilt.jsonl"), cmd


# --- make -------------------------------------------------------------------------------------------------

def check_make(root: Path, cmd: Command) -> None:
    target = cmd.words[1]
    # As a user types it: not with the settings of a `make test` this may run under.
    env = {k: v for k, v in env_for(root).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "FAISS", "VENV",
                                                                 "PY", "PYTHON", "PYTEST_ARGS")}
    r = ok(subprocess.run(["make", "-n", target], cwd=root, env=env, capture_output=True, text=True, timeout=60), cmd)
    recipe = [ln.strip() for ln in r.stdout.replace("\\\n", " ").splitlines()]
    assert any("-m venv .venv" in ln for ln in recipe), f"{cmd}: a fresh clone must create .venv first"
    jobs = [ln for ln in recipe if re.match(r"\.venv/bin/python (jobs/|-m pytest)", ln)]
    assert jobs, f"{cmd}: no job in the recipe:\n{r.stdout}"
    for ln in jobs:
        words = tuple(shlex.split(ln))
        if words[1] == "-m":
            continue  # make test: the suite this file belongs to
        if words[1] == "jobs/demo.py":  # no config to check of its own: it runs aida_finetune on its default
            ok(run_job_main(root, "jobs/demo.py", ["--help"]), cmd)
            dry_run(root, ("python", "jobs/aida_finetune.py", "--config", "configs/aida/tiny_cpu.yaml"), cmd)
        else:
            dry_run(root, ("python", *words[1:]), f"{cmd} -> {ln}")


# --- runs ---------------------------------------------------------------------------------------------------

def user_inputs(root: Path) -> None:
    """The inputs the README's prepare commands name (kilt_knowledgesource.json, AIDA/, entity.jsonl,
    zeshel/) in the clone, from the project's synthetic generators: small, in the real formats."""
    if (root / "zeshel" / "documents").is_dir():
        return
    from kb.synthetic.kilt import AIDA_FILES, BLINK_FILE, KB_FILE

    src = root / "synthetic_inputs"
    ok(sh(root, f"python -m kb.synthetic kilt --out {src} --entities 300 --train 40 --dev 20 --test 20 --blink"),
       "synthetic KILT inputs")
    (root / "AIDA").mkdir()
    for name in AIDA_FILES.values():
        shutil.move(src / name, root / "AIDA" / name)
    shutil.move(src / KB_FILE, root / KB_FILE)
    shutil.move(src / BLINK_FILE, root / BLINK_FILE)
    ok(sh(root, "python -m kb.synthetic zeshel --out zeshel --entities-per-world 20 --mentions-per-world 6"),
       "synthetic Zeshel tree")


def readme_command(pattern: str) -> Command:
    found = [c for c in COMMANDS if re.fullmatch(pattern, c.joined)]
    assert found, f"README.md and docs/: no command matches {pattern}"
    return found[0]


def trained_model(root: Path) -> None:
    """runs/x/model: what jobs/aida_finetune.py exports (Retriever.save_pretrained), here from the
    tiny model the jobs build; the KB store: the README's own prepare command."""
    if not (root / "data" / "kilt" / "manifest.json").exists():
        user_inputs(root)
        cmd = readme_command(r"python jobs/prepare_kb\.py --kilt-ks .* --out data/kilt( .*)?")
        ok(sh(root, cmd.text), cmd)
    if not (root / "runs" / "x" / "model").exists():
        ok(sh(root, "python -c 'import torch; from dist_nce.core.models import ensure_tiny_bert; "
                    "from dist_nce.modeling.retriever import Retriever, RetrieverConfig; "
                    "ensure_tiny_bert(\"data/models/tiny_bert\"); torch.manual_seed(0); "
                    "Retriever.build(RetrieverConfig(mention_model=\"data/models/tiny_bert\", "
                    "storage_dtype=\"float32\")).save_pretrained(\"runs/x/model\")'", PYTHONPATH=str(root)),
           "runs/x/model")


def blink_files(root: Path, through_import: bool) -> None:
    """BLINK's released files under docs/real_data.md's names, in their layouts: tiny BLINK biencoder and
    cross-encoder checkpoints (tests/blink_helpers.py) and all_entities_large.t7, the biencoder's
    entity [CLS] states in entity.jsonl's line order, saved as BLINK did (torch's legacy format);
    data/blink: the README's prepare command. ``through_import``: that page's import command too."""
    import numpy as np
    import torch

    from kb.store import EntityStore
    from tests.blink_helpers import tiny_bert, write_blink_biencoder, write_blink_crossencoder

    if not (root / "all_entities_large.t7").exists():
        user_inputs(root)
        if not (root / "data" / "blink" / "manifest.json").exists():
            prep = readme_command(r"python jobs/prepare_kb\.py --blink-entities .* --out data/blink( .*)?")
            ok(sh(root, prep.text), prep)
        write_blink_biencoder(root / "biencoder_wiki_large.bin", seed=0)
        write_blink_crossencoder(root / "crossencoder_wiki_large.bin", seed=2)
        store = EntityStore(root / "data" / "blink")
        ids = [json.loads(line)["idx"].rsplit("=", 1)[1] for line in (root / "entity.jsonl").open(encoding="utf-8")]
        rows = store.rows_for_source_ids(ids)
        assert (rows >= 0).all(), "every entity.jsonl line is a store row"
        tokens = torch.from_numpy(store.token_ids(rows)).long()
        with torch.no_grad():  # write_blink_biencoder's cand_encoder is tiny_bert(seed + 1)
            enc = tiny_bert(1)(input_ids=tokens, attention_mask=(tokens != 0).long()).last_hidden_state[:, 0]
        torch.save(enc.contiguous(), root / "all_entities_large.t7", _use_new_zipfile_serialization=False)
    if through_import and not (root / "data" / "blink_encodings" / "manifest.json").exists():
        imp = readme_command(r"python jobs/import_encodings\.py .*")
        ok(sh(root, imp.text), imp)


def run(root: Path, cmd: Command) -> None:
    job = cmd.words[1] if cmd.words[1] != "-m" else cmd.words[2]
    if job == "jobs/prepare_kb.py":
        user_inputs(root)
    elif "biencoder_wiki_large.bin" in cmd.words:  # BLINK's released files (docs/real_data.md)
        blink_files(root, through_import=job != "jobs/import_encodings.py")
    elif job in ("jobs/encode_kb.py", "jobs/evaluate_kilt_aida.py"):
        trained_model(root)
    r = ok(sh(root, cmd.text, timeout=600), cmd)
    # Each command leaves what the README says it makes, where it says (its --out). (The KILT store
    # may already be there: encode_kb's and evaluate's tests make it with this very command.)
    assert "--out" in cmd.words, f"{cmd}: a `run` command needs an --out to check"
    out = root / cmd.words[cmd.words.index("--out") + 1]
    assert out.is_dir() and any(out.iterdir()), f"{cmd}\n  wrote nothing to {out}\n{r.stdout[-2000:]}"
    expected = {"jobs/bias_experiment.py": {"bias.json", "bias.png", "manifest.json"},
                "jobs/import_encodings.py": {"manifest.json", "shards"},
                "jobs/prepare_kb.py": {"manifest.json"}, "jobs/evaluate_kilt_aida.py": {"scores.json"}}
    missing = expected.get(job, set()) - {p.name for p in out.iterdir()}
    assert not missing, f"{cmd}\n  {out} lacks {sorted(missing)}"
    if "data/blink_encodings/shards" in cmd.words and job == "jobs/evaluate_kilt_aida.py":
        assert "reused the persisted snapshot" in r.stdout, f"{cmd}: the imported encodings were not served as they are"


def update_kb(root: Path, cmd: Command) -> None:
    """jobs/update_kb.py on the README's KILT store: new_pages.json (3 pages of the store's source with new ids)
    and gone_ids.txt (2 ids of the store) are written first; the command must leave a new KB version (or, with
    --compact, a fresh store at --out)."""
    from kb.store import EntityStore

    store = root / "data" / "kilt"
    if not (store / "manifest.json").exists():
        user_inputs(root)
        prep = readme_command(r"python jobs/prepare_kb\.py --kilt-ks .* --out data/kilt( .*)?")
        ok(sh(root, prep.text), prep)
    if not (root / "new_pages.json").exists():
        lines = (root / "kilt_knowledgesource.json").read_text(encoding="utf-8").splitlines()[:3]
        pages = [json.loads(line) for line in lines]
        for i, page in enumerate(pages):
            page["wikipedia_id"] = str(990000 + i)
        (root / "new_pages.json").write_text("".join(json.dumps(p) + "\n" for p in pages), encoding="utf-8")
        ids = EntityStore(store).source_ids([0, 1])
        (root / "gone_ids.txt").write_text("".join(i + "\n" for i in ids), encoding="utf-8")
    before = EntityStore(store).kb_version
    r = ok(sh(root, cmd.text, timeout=600), cmd)
    if "--compact" in cmd.words:
        out = EntityStore(root / cmd.words[cmd.words.index("--out") + 1])
        assert out.num_entities == EntityStore(store).num_live, f"{cmd}\n{r.stdout[-2000:]}"
    else:
        after = EntityStore(store)
        assert after.kb_version == before + 1 and after.rows_for_source_ids(["990000"])[0] >= 0, cmd


# --- the per-command test -----------------------------------------------------------------------------------

def _param(cmd: Command):
    try:
        kind = classify(cmd)
    except AssertionError:
        kind = "unclassified"  # reported by test_every_readme_command_is_classified
    # Real runs (subprocesses; some start Ray or write 100k entities) take 5-60 s each on 2 cores;
    # the in-process checks and `make -n` take about a second.
    marks = [pytest.mark.slow] if kind in ("run", "update") or "get-auth-token" in cmd.joined else []
    return pytest.param(cmd, kind, marks=marks, id=f"{Path(cmd.page).stem}-L{cmd.line}-{kind}")


@pytest.mark.parametrize("cmd,kind", [_param(c) for c in COMMANDS])
def test_readme_command(cmd: Command, kind: str, clone: Path, tmp_path: Path):
    if kind == "unclassified":
        pytest.fail(str(cmd) + "\n  unclassified (see test_every_readme_command_is_classified)")
    if kind == "make":
        check_make(clone, cmd)
    elif kind == "ray":
        check_ray(clone, cmd)
    elif kind == "dry_run":
        dry_run(clone, cmd.words, cmd)
    elif kind == "run":
        run(clone, cmd)
    elif kind == "update":
        update_kb(clone, cmd)
    elif kind == "link":
        check_link(clone, cmd)
    elif kind == "shell":
        home = tmp_path / "home"
        home.mkdir()
        ok(sh(clone, cmd.text + "\necho \"RAY_AUTH_MODE=${RAY_AUTH_MODE:-}\"", timeout=120, HOME=str(home)), cmd)
        if "get-auth-token" in cmd.text:  # the token exists, private, on a machine that never ran Ray
            token = home / ".ray" / "auth_token"
            assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text().strip()) >= 32, cmd
    else:  # pragma: no cover - a kind added to RULES without a handler
        pytest.fail(f"{cmd}: no handler for kind {kind!r}")

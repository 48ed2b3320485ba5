"""kb.synthetic.cache: a synthetic directory is reused only when it holds what is asked for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kb.synthetic import KB_FILE
from kb.synthetic.cache import IN_PROGRESS, SyntheticDataError, ensure_kilt, ensure_zeshel
from kb.synthetic.kilt import AIDA_FILES


def lines(path: Path) -> int:
    return sum(1 for _ in path.open(encoding="utf-8"))


def edit_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def test_kilt_reused_only_for_the_same_settings(tmp_path):
    out, log = tmp_path / "syn", []
    paths = ensure_kilt(out, 40, 6, 4, 3, seed=1, log=log.append)
    assert lines(paths["kb"]) == 40 and lines(paths["train"]) == 6
    assert any("generating" in m for m in log)
    before = paths["kb"].stat().st_mtime_ns

    log.clear()
    assert ensure_kilt(out, 40, 6, 4, 3, seed=1, log=log.append) == paths
    assert log == [] and paths["kb"].stat().st_mtime_ns == before  # reused, untouched

    for kwargs, key in (({"num_entities": 55}, "num_entities"), ({"seed": 2}, "seed"),
                        ({"num_train": 9}, "num_mentions")):
        args = {"num_entities": 40, "num_train": 6, "num_dev": 4, "num_test": 3, "seed": 1, **kwargs}
        log.clear()
        ensure_kilt(out, **args, log=log.append)
        assert any("differs in:" in m and key in m.split("differs in:")[1] for m in log), log
        assert lines(out / KB_FILE) == args["num_entities"]
        assert lines(out / AIDA_FILES["train"]) == args["num_train"]
        assert json.loads((out / "manifest.json").read_text())["settings"]["seed"] == args["seed"]
        assert not (out / IN_PROGRESS).exists()


def test_kilt_regenerated_after_a_generator_change_or_by_an_older_version(tmp_path):
    out, log = tmp_path / "syn", []
    ensure_kilt(out, 30, 2, 2, 2, log=log.append)
    edit_manifest(out, lambda m: m["settings"].update(generator=0))
    log.clear()
    ensure_kilt(out, 30, 2, 2, 2, log=log.append)
    assert any("differs in: generator" in m for m in log)

    edit_manifest(out, lambda m: m.pop("settings"))  # a manifest written before settings were recorded
    log.clear()
    ensure_kilt(out, 30, 2, 2, 2, log=log.append)
    assert any("none recorded" in m for m in log)
    assert json.loads((out / "manifest.json").read_text())["settings"]["num_entities"] == 30


def test_kilt_missing_file_regenerates_and_blink_file_is_removed_when_no_longer_asked(tmp_path):
    out, log = tmp_path / "syn", []
    paths = ensure_kilt(out, 30, 2, 2, 2, blink=True, log=log.append)
    assert paths["blink"].exists()
    paths["dev"].unlink()
    log.clear()
    ensure_kilt(out, 30, 2, 2, 2, blink=True, log=log.append)
    assert any("incomplete (missing aidayago2-dev-kilt.jsonl)" in m for m in log) and paths["dev"].exists()
    ensure_kilt(out, 30, 2, 2, 2, blink=False, log=log.append)
    assert not paths["blink"].exists()  # a stale extra file does not linger next to the new data


def test_real_data_and_other_artifacts_are_never_overwritten(tmp_path):
    real = tmp_path / "aida"
    real.mkdir()
    (real / AIDA_FILES["train"]).write_text('{"id": "real"}\n')
    with pytest.raises(SyntheticDataError, match=r"no synthetic manifest.*not overwritten"):
        ensure_kilt(real, 20, 1, 1, 1, log=lambda _m: None)
    assert (real / AIDA_FILES["train"]).read_text() == '{"id": "real"}\n'

    other = tmp_path / "store"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"kind": "prepared_store"}))
    with pytest.raises(SyntheticDataError, match="'prepared_store' artifact"):
        ensure_kilt(other, 20, 1, 1, 1, log=lambda _m: None)


def test_an_interrupted_generation_is_redone(tmp_path, monkeypatch):
    import kb.synthetic.kilt as kilt

    out = tmp_path / "syn"
    real_write = kilt.write_kilt

    def dies_after_files(out_dir, *args, **kwargs):
        real_write(out_dir, *args, **kwargs)
        (Path(out_dir) / "manifest.json").unlink()  # as if killed before the manifest landed
        raise KeyboardInterrupt

    monkeypatch.setattr(kilt, "write_kilt", dies_after_files)
    with pytest.raises(KeyboardInterrupt):
        ensure_kilt(out, 25, 2, 2, 2, log=lambda _m: None)
    assert (out / IN_PROGRESS).exists() and (out / KB_FILE).exists()
    monkeypatch.setattr(kilt, "write_kilt", real_write)
    log: list[str] = []
    ensure_kilt(out, 25, 2, 2, 2, log=log.append)
    assert any("interrupted" in m for m in log)
    assert (out / "manifest.json").exists() and not (out / IN_PROGRESS).exists()


def test_zeshel_world_change_regenerates_and_drops_old_world_files(tmp_path):
    out, log = tmp_path / "zeshel", []
    ensure_zeshel(out, ["starwars", "lego"], 12, 6, seed=0, log=log.append)
    log.clear()
    ensure_zeshel(out, ["starwars", "lego"], 12, 6, seed=0, log=log.append)
    assert log == []
    ensure_zeshel(out, ["starwars", "muppets"], 12, {"starwars": 6, "muppets": 4}, seed=0, log=log.append)
    assert any("differs in: entities_per_world, mentions_per_world, worlds" in m for m in log), log
    assert sorted(p.name for p in (out / "documents").iterdir()) == ["muppets.json", "starwars.json"]
    assert lines(out / "documents" / "muppets.json") == 12


def test_a_split_asked_for_no_mentions_loses_its_file_and_is_still_reused(tmp_path):
    out = tmp_path / "kilt"
    ensure_kilt(out, 30, 2, 2, 2, log=lambda _m: None)
    assert (out / AIDA_FILES["dev"]).is_file()
    log: list[str] = []
    paths = ensure_kilt(out, 30, 2, 0, 2, log=log.append)
    assert not (out / AIDA_FILES["dev"]).exists() and "dev" not in paths
    assert ensure_kilt(out, 30, 2, 0, 2, log=log.append) == paths
    assert sum(m.startswith("generating") for m in log) == 1, log  # the second call reused the directory

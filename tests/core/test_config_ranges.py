"""Every numeric field of every job config declares its range, and the loader refuses a value
outside it as ``file: dotted.key: value: why`` before any cluster work.

The walk is generic: a numeric field added without a range fails
``test_every_numeric_field_has_a_range``, and then gets its out-of-range value tried here.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest

from dist_nce.actors.config import ServiceConfig
from dist_nce.bias.synthetic import SyntheticConfig
from dist_nce.core.config import ConfigError, Range, describe, from_dict, load_config
from dist_nce.rerank.config import RerankJobConfig
from dist_nce.train.config import TrainJobConfig, check_against_store
from dist_nce.zeshel.config import ZeshelRetrieverConfig
from kb.prepare import PrepareConfig

REPO = Path(__file__).resolve().parents[2]
JOB_CONFIGS = [TrainJobConfig, ZeshelRetrieverConfig, RerankJobConfig, SyntheticConfig, PrepareConfig, ServiceConfig]
# What each config needs besides the field under test to get as far as its ranges.
BASE: dict[type, dict] = {PrepareConfig: {"out": "x", "kilt_ks": "x.json"},
                          ZeshelRetrieverConfig: {"data": {"dev_split": "heldout_train_seen"}}}


def _numeric(tp: Any) -> tuple[type, str] | None:
    """(number type, container: "" | "list" | "dict") of a numeric annotation, else None."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _numeric(inner[0]) if len(inner) == 1 else None
    if origin in (list, tuple) and typing.get_args(tp):
        found = _numeric(typing.get_args(tp)[0])
        return (found[0], "list") if found else None
    if origin is dict:
        found = _numeric(typing.get_args(tp)[1])
        return (found[0], "dict") if found else None
    return (tp, "") if tp in (int, float) else None  # bool is its own type in annotations


def numeric_fields(cls: type, prefix: str = ""):
    """(dotted name, field, number type, container) for every numeric leaf under ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from numeric_fields(tp, f"{prefix}{f.name}.")
        elif (found := _numeric(tp)) is not None:
            yield (f"{prefix}{f.name}", f, *found)


def _cases():
    for cls in JOB_CONFIGS:
        for dotted, f, number, container in numeric_fields(cls):
            yield pytest.param(cls, dotted, f, number, container, id=f"{cls.__name__}.{dotted}")


def _outside(bounds: Range, number: type) -> list:
    """Values just outside each side of ``bounds`` (the bound itself when it is strict)."""
    step = 1 if number is int else 0.5
    values = []
    if bounds.ge is not None:
        values.append(bounds.ge - step)
    if bounds.gt is not None:
        values.append(bounds.gt)
    if bounds.le is not None:
        values.append(bounds.le + step)
    if bounds.lt is not None:
        values.append(bounds.lt)
    return [number(v) for v in values]


def _nested(dotted: str, value: Any) -> dict:
    *parents, name = dotted.split(".")
    data: dict = {name: value}
    for p in reversed(parents):
        data = {p: data}
    return data


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_every_numeric_field_has_a_range():
    missing = [f"{cls.__name__}.{dotted}" for cls in JOB_CONFIGS
               for dotted, f, _, _ in numeric_fields(cls) if not isinstance(f.metadata.get("range"), Range)]
    assert not missing, f"numeric config fields without metadata['range']: {missing}"


@pytest.mark.parametrize("cls, dotted, f, number, container", list(_cases()))
def test_out_of_range_values_are_refused_with_the_dotted_key(cls, dotted, f, number, container):
    bounds = f.metadata["range"]
    values = _outside(bounds, number)
    assert values, f"{dotted}: its range {bounds} bounds nothing"
    for bad in values:
        value, key = {"": (bad, dotted), "list": ([bad], f"{dotted}[0]"), "dict": ({"x": bad}, f"{dotted}.x")}[container]
        with pytest.raises(ConfigError) as e:
            from_dict(cls, _merge(BASE.get(cls, {}), _nested(dotted, value)), source="job.yaml")
        assert str(e.value).startswith(f"job.yaml: {key}: {bad!r}: must be "), str(e.value)


@pytest.mark.parametrize("cls", JOB_CONFIGS)
def test_defaults_are_in_range(cls):
    from_dict(cls, BASE.get(cls, {}))
    assert "(>= " in describe(cls) or "(in [" in describe(cls)  # ranges are shown with the help


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-5", "optim.lr: -5.0: must be > 0"),
    ("negatives.temperature=-1", "negatives.temperature: -1.0: must be > 0 (scores are divided by it)"),
    ("optim.warmup_proportion=7.0", "optim.warmup_proportion: 7.0: must be in [0, 1] (above 1 the rate never"),
    ("service.num_gpus=-3", "service.num_gpus: -3.0: must be >= 0"),
    ("service.threads=0", "service.threads: 0: must be >= 1"),
    ("service.encode_batch_size=0", "service.encode_batch_size: 0: must be >= 1"),
    ("run.num_to_keep=0", "run.num_to_keep: 0: must be >= 1 (resuming needs one)"),
    ("service.resources={kb_shard: -1}", "service.resources.kb_shard: -1.0: must be >= 0"),
    ("run.resources_per_worker={trainer: -0.5}", "run.resources_per_worker.trainer: -0.5: must be >= 0"),
    ("run.name=../../x", "run.name: '../../x': must be a plain name"),
    ("run.name=a/b", "run.name: 'a/b': must be a plain name"),
    ("run.name=..", "run.name: '..': must be a plain name"),
])
def test_the_values_from_the_issue_are_refused_at_load_time(override, message):
    path = REPO / "configs" / "aida" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(TrainJobConfig, path, [override])
    assert str(e.value).startswith(f"--set (over {path}): {message}"), str(e.value)  # the file is valid


def test_plain_run_names_and_rerank_run_names():
    assert load_config(TrainJobConfig, REPO / "configs" / "aida" / "tiny_cpu.yaml", ["run.name=aida_v2.1"])
    with pytest.raises(ConfigError, match=r"run\.name: 'x/y': must be a plain name"):
        from_dict(RerankJobConfig, {"run": {"name": "x/y"}})


def test_nan_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.lr: nan: must be > 0"):
        from_dict(TrainJobConfig, {"optim": {"lr": float("nan")}})


def _store(tmp_path: Path, n: int) -> str:
    (tmp_path / "manifest.json").write_text(json.dumps({"entities": {"count": n}}))
    return str(tmp_path)


def test_candidates_and_shards_must_fit_the_kb(tmp_path):
    cfg = from_dict(TrainJobConfig, {"negatives": {"num_candidates": 8}, "service": {"num_shards": 3}})
    check_against_store(cfg, _store(tmp_path, 8))
    with pytest.raises(ConfigError) as e:
        check_against_store(cfg, _store(tmp_path, 2))
    assert str(e.value).splitlines() == [
        f"negatives.num_candidates: 8: must be <= the 2 entities of {tmp_path} (the gold and K-1 distinct other "
        "entities)",
        f"service.num_shards: 3: must be <= the 2 entities of {tmp_path} (every shard owns at least one row)"]

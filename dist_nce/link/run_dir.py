"""Where a trained run keeps what linking needs, and the KB index built from it.

``jobs/aida_finetune.py`` leaves in ``runs/<name>/<time>/``::

    model/          the retriever (Retriever.save_pretrained: both encoders, tokenizer, manifest)
    kb_snapshot/    the KB embeddings of the final index (dist_nce.index.export), rows = store rows
    shards/         the shards' persisted versions the snapshot was exported from
    summary.json    the run's config: data.prepared_dir (the prepared store), service (the shards)

:func:`locate` finds these; :func:`locate_model` stands in for a run when linking with a
model alone (a retriever directory or BLINK's ``biencoder_wiki_large.bin``), a prepared
store and optionally a snapshot exported elsewhere (``jobs/encode_kb.py --out``), and
:func:`resolve` picks one of the two. :func:`snapshot_index` loads the snapshot into an in-process
:class:`~dist_nce.index.search.ShardIndex` after checking that it belongs to this store
(row count, source ids) and, where the shard manifests it came from are still there, to
this model's entity encoder (a snapshot of other weights would rank by stale vectors).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dist_nce.core.artifacts import MANIFEST, ArtifactMismatch, read_manifest
from dist_nce.index.config import IndexConfig
from dist_nce.index.export import KIND as SNAPSHOT_KIND
from dist_nce.index.export import SCHEMA_VERSION as SNAPSHOT_SCHEMA
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.scoring import Reps, ScoreSpec
from kb.store import EntityStore

MODEL_DIR = "model"
SNAPSHOT_DIR = "kb_snapshot"
SHARDS_DIR = "shards"
SUMMARY = "summary.json"


@dataclass(frozen=True)
class RunArtifacts:
    """Paths of one run; ``snapshot`` None when the run exported none; ``service`` the run's
    ``service`` config section (a dict, or None without a summary). ``run_dir`` is None when
    linking with a model and store alone (:func:`locate_model`); ``model`` is then a
    retriever directory or a BLINK biencoder file."""

    run_dir: Path | None
    model: Path
    store: Path
    snapshot: Path | None
    service: dict[str, Any] | None


def locate(run_dir: str | os.PathLike, store: str | os.PathLike | None = None) -> RunArtifacts:
    """The artifacts of ``run_dir``; ``store`` overrides the summary's ``data.prepared_dir``."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: run directory not found (jobs/aida_finetune.py writes runs/<name>/<time>)")
    model = run / MODEL_DIR
    if not (model / MANIFEST).is_file():
        raise FileNotFoundError(f"{model}: no exported retriever (model/manifest.json); did the run finish with "
                                "run.export on?")
    summary: dict[str, Any] = {}
    if (run / SUMMARY).is_file():
        summary = json.loads((run / SUMMARY).read_text(encoding="utf-8"))
    config = summary.get("config") or {}
    if store is None:
        store = (config.get("data") or {}).get("prepared_dir")
        if store is None:
            raise FileNotFoundError(f"{run / SUMMARY}: missing or without config.data.prepared_dir; give the "
                                    "prepared store (store=... / --store)")
        if not Path(store).is_absolute():  # the job resolves it; an older summary may not have
            store = run / store
    store = Path(store)
    if not (store / MANIFEST).is_file():
        raise FileNotFoundError(f"{store}: prepared store not found (no manifest.json)")
    snapshot = run / SNAPSHOT_DIR
    return RunArtifacts(run, model, store, snapshot if (snapshot / MANIFEST).is_file() else None,
                        config.get("service"))


def locate_model(model: str | os.PathLike, store: str | os.PathLike | None,
                 snapshot: str | os.PathLike | None = None) -> RunArtifacts:
    """The artifacts of linking without a run: ``model`` (a retriever directory or a BLINK
    biencoder file), the prepared ``store`` (required) and an optional exported ``snapshot``."""
    from dist_nce.modeling.resolve import is_checkpoint_file

    is_checkpoint_file(model)  # a wrong path fails here, naming the forms accepted
    if store is None:
        raise FileNotFoundError(f"linking with model {model} and no run directory needs the prepared store "
                                "(store=... / --store)")
    store = Path(store)
    if not (store / MANIFEST).is_file():
        raise FileNotFoundError(f"{store}: prepared store not found (no manifest.json)")
    return RunArtifacts(None, Path(model), store, _snapshot_dir(snapshot), None)


def _snapshot_dir(snapshot: str | os.PathLike | None) -> Path | None:
    if snapshot is None:
        return None
    snapshot = Path(snapshot)
    if not (snapshot / MANIFEST).is_file():
        raise FileNotFoundError(f"{snapshot}: no exported KB snapshot (manifest.json); give the --out of "
                                "jobs/encode_kb.py or a run's kb_snapshot/")
    return snapshot


def resolve(run_dir: str | os.PathLike | None, model: str | os.PathLike | None = None,
            store: str | os.PathLike | None = None, snapshot: str | os.PathLike | None = None) -> RunArtifacts:
    """What to link with: a run directory (:func:`locate`) or a model + store (:func:`locate_model`);
    ``snapshot`` replaces the run's exported one."""
    if run_dir and model:
        raise ValueError(f"give a run directory ({run_dir}) or a model ({model}), not both")
    if model:
        return locate_model(model, store, snapshot)
    if not run_dir:
        raise FileNotFoundError("nothing to link with: give a run directory (--run) or a model (--model, "
                                "a retriever directory or BLINK biencoder file) with --store")
    art = locate(run_dir, store)
    return dataclasses.replace(art, snapshot=_snapshot_dir(snapshot)) if snapshot else art


def check_snapshot_for_store(art: RunArtifacts) -> None:
    """What :func:`snapshot_index` checks of ``art.snapshot`` against ``art.store`` without loading the model:
    that it exists and indexes the store's rows now (a KB delta since makes it stale). For a caller that
    starts processes which would each refuse it later (the Serve app's replicas)."""
    if art.snapshot is None:
        where = f"{art.run_dir}: no kb_snapshot/ (the run exported none)" if art.run_dir else \
            f"{art.model}: no KB snapshot to search; give snapshot (the --out of jobs/encode_kb.py)"
        raise FileNotFoundError(f"{where}; or kb: encode to encode the store in the searcher")
    manifest = read_manifest(art.snapshot, SNAPSHOT_KIND, SNAPSHOT_SCHEMA)
    _check_snapshot(art.snapshot, manifest, EntityStore(art.store), None)


def _check_snapshot(snapshot: Path, manifest: dict, store: EntityStore, encoder_fingerprint: str | None) -> None:
    n = store.num_entities
    if manifest.get("num_entities") != n:
        changed = ("; the store was changed by KB deltas since (kb_version "
                   f"{store.kb_version}): link with --searcher service, which serves its current version, or "
                   "--kb encode, or compact it and export a new snapshot with jobs/encode_kb.py"
                   if store.kb_version else "")
        raise ArtifactMismatch(f"{snapshot}: {manifest.get('num_entities')} entities, the store {store.path} has "
                               f"{n}{changed}")
    with open(snapshot / manifest["files"]["ids"], encoding="utf-8") as f:
        first = f.readline().strip()
        last = first
        for line in f:
            last = line
    want = store.source_ids(np.array([0, n - 1]))
    if [first, last.strip()] != want:
        raise ArtifactMismatch(f"{snapshot}/ids.txt: rows 0 and {n - 1} are {[first, last.strip()]}, the store "
                               f"{store.path} has {want}: the snapshot indexes another KB")
    if encoder_fingerprint is None:
        return
    own = manifest.get("encoder_fingerprint")  # jobs/encode_kb.py records it; run exports do not
    if own is not None and own != encoder_fingerprint:
        raise ArtifactMismatch(f"{snapshot}: encoded by other entity-encoder weights ({own}) than the model's "
                               f"({encoder_fingerprint}); use kb: encode, or encode_kb with this model")
    for part in manifest.get("parts", []):
        part_manifest = Path(part["dir"]) / MANIFEST
        if not part_manifest.is_file():
            continue  # the shard directory was moved or pruned: only the store checks above apply
        got = json.loads(part_manifest.read_text(encoding="utf-8")).get("encoder_fingerprint")
        if got is not None and got != encoder_fingerprint:
            raise ArtifactMismatch(f"{part['dir']}: the snapshot was encoded by other entity-encoder weights "
                                   f"({got}) than the model's ({encoder_fingerprint}); use kb: encode")


def snapshot_index(snapshot: str | os.PathLike, store: EntityStore, spec: ScoreSpec, config: IndexConfig,
                   encoder_fingerprint: str | None = None) -> ShardIndex:
    """An in-process index over every row of ``store`` from an exported snapshot.

    The snapshot holds vecs [N, d] (dual/poly), [N, m, d] + mask.npy (multi-m/genpoly) or
    [N, T, d] + mask (SOM), row i = store row i; the index answers global store rows.
    """
    snapshot = Path(snapshot)
    manifest = read_manifest(snapshot, SNAPSHOT_KIND, SNAPSHOT_SCHEMA)
    _check_snapshot(snapshot, manifest, store, encoder_fingerprint)
    vecs = torch.from_numpy(np.load(snapshot / manifest["files"]["embeddings"]).astype(np.float32, copy=False))
    mask = None
    if "mask" in manifest["files"]:
        mask = torch.from_numpy(np.load(snapshot / manifest["files"]["mask"]))
    dead = getattr(store, "tombstones", None)  # rows a KB delta removed since: never linked to
    return ShardIndex(spec, Reps(vecs, mask), 0, config, int(manifest.get("version", 0)),
                      dead=None if dead is None else torch.as_tensor(dead))

"""A worker's checkpoint directory, without pickle: engine, RNG, step and the loop's own state.

A checkpoint directory (one per reported step; Ray Train merges the workers' files) holds::

    manifest.json          kind "train_checkpoint": step, plan, DeepSpeed tag
    train_state.json       rank 0: the loop state (:class:`WorkerState`, or a subclass's)
    rng_rank{r}.json       each rank: python, numpy, torch (and CUDA) RNG states as JSON
    <name>.safetensors     a trainer's own tensors (the retriever's mined negatives), by name
    deepspeed/             engine.save_checkpoint: module, optimizer (ZeRO partitions), LR scheduler

What a trainer adds (the retriever's index bookkeeping and prefetched negatives,
``dist_nce.train.checkpoint``) travels through :class:`WorkerState` subclasses and the
``tensors`` argument: this module knows no trainer.

**No pickle on load.** Our own files are JSON and safetensors. DeepSpeed's files are
``torch.save`` pickles that DeepSpeed itself loads with ``weights_only=False``
(deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py, ``TorchCheckpointEngine.load``).
They load with ``weights_only=True`` once three of DeepSpeed's plain data classes are
allowed: ``LossScaler`` (ZeRO-1/2 optimizer states), ``ZeroStageEnum`` (ZeRO-3) and
``fragment_address`` (bf16/ZeRO optimizer states); :func:`install_weights_only_loading`
swaps that loader in. Not covered: DeepSpeed's universal-checkpoint path
(``load_hp_checkpoint_state*`` in deepspeed/runtime/zero/stage3.py calls ``torch.load(...,
weights_only=False)`` directly); dist-nce never uses it.
"""
from __future__ import annotations

import base64
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dist_nce.core.artifacts import atomic_path, atomic_write_json, read_manifest, write_manifest

KIND = "train_checkpoint"
SCHEMA_VERSION = 1
DS_DIR = "deepspeed"
STATE_FILE = "train_state.json"
# Plan fields a resumed run must share with its checkpoint (the data order depends on them).
RESUME_KEYS = ("num_workers", "per_worker_batch", "global_batch", "steps_per_epoch", "total_steps",
               "train_mentions", "num_candidates", "n_hard", "n_random", "seed", "data_fingerprint")
# The plan's {dotted config key: value} of the settings a resumed run must share too (what the model is and
# what it is trained towards); the trainer that makes the plan chooses them (train.plan.RESUME_SETTINGS).
SETTINGS = "settings"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


@dataclass
class WorkerState:
    """What a loop needs besides the engine to continue at ``step`` (the next step to train).
    Trainers with more loop state subclass it (``to_json``/``from_json`` extended)."""

    step: int = 0
    dev_before: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "dev_before": self.dev_before}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorkerState":
        return cls(int(d["step"]), d.get("dev_before"))


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """Every RNG this process draws from, as JSON-ready values."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": {"version": version, "state": list(words), "gauss": gauss},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()]
    return out


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def restore_rng(state: dict[str, Any]) -> None:
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])


# --------------------------------------------------------------------------- DeepSpeed loading


def _deepspeed_safe_globals() -> list[type]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed checkpoint file (see module docstring)."""
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def install_weights_only_loading(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` read every file with ``weights_only=True``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return weights_only_load(path, map_location)

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise RuntimeError(f"DeepSpeed uses {type(engine.checkpoint_engine).__name__}; dist-nce expects the "
                           "default torch checkpoint engine (remove checkpoint writer/datastates settings)")
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


# --------------------------------------------------------------------------- save / load


def save(engine: Any, directory: str | Path, state: WorkerState, rank: int, plan: dict[str, Any],
         tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
    """Write this rank's part of the checkpoint (a collective: every rank calls it).

    tensors: file name -> named tensors, written as safetensors beside the engine (the
    trainer's own extras, read back with :func:`load_tensors`).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory / DS_DIR), tag=f"step{state.step}")
    atomic_write_json(directory / rng_file(rank), capture_rng())
    for name, named in (tensors or {}).items():
        with atomic_path(directory / name) as tmp:
            save_file({k: v.contiguous() for k, v in named.items()}, str(tmp))
    if rank == 0:
        atomic_write_json(directory / STATE_FILE, state.to_json())
        write_manifest(directory, KIND, SCHEMA_VERSION, step=state.step, deepspeed_tag=f"step{state.step}",
                       plan=plan)


def check_resumable(manifest: dict[str, Any], plan: dict[str, Any], where: str, run_dir: str | None = None) -> None:
    """Refuse (ValueError naming each difference) to resume from a checkpoint whose plan (``manifest``'s)
    differs from ``plan`` in a :data:`RESUME_KEYS` field or one of its :data:`SETTINGS`. ``where``: the
    checkpoint; ``run_dir``: the run's directory in a local storage, if known (the message says to move it)."""
    saved = manifest.get("plan", {})
    diff = [f"{k}: checkpoint {saved.get(k)!r}, now {plan.get(k)!r}" for k in RESUME_KEYS if saved.get(k) != plan.get(k)]
    old, new = saved.get(SETTINGS), plan.get(SETTINGS) or {}
    if old is not None:  # a checkpoint written before settings were recorded is checked on the fields alone
        # and on the settings it recorded: one that a later version added (the reranker's dropout) cannot be
        # compared, and counting it as changed stranded every run checkpointed before that version
        diff += [f"{k}: checkpoint {old[k]!r}, now {new.get(k)!r}" for k in sorted(old) if old[k] != new.get(k)]
    if diff:
        # Both ways out where the run's directory is known: the grids name their runs themselves (a row's or a
        # cell's key), so another run.name is not one there; moving the run's directory away starts it over.
        over = f", or move {run_dir} away to start this one over from step 0" if run_dir else ""
        raise ValueError(f"{where}: cannot resume this run with a different plan ({'; '.join(diff)}); "
                         f"use another run.name for a new run{over}")


def saved_plan(resumed: Any) -> dict[str, Any]:
    """The plan a ``ray.train.Checkpoint`` was written with, read from its manifest alone: a checkpoint on a
    remote storage is not downloaded for it (its filesystem is pyarrow's)."""
    from dist_nce.core.artifacts import MANIFEST

    with resumed.filesystem.open_input_stream(f"{str(resumed.path).rstrip('/')}/{MANIFEST}") as f:
        return json.loads(f.read().decode("utf-8")).get("plan") or {}


def load(engine: Any, directory: str | Path, rank: int, plan: dict[str, Any],
         state_cls: type[WorkerState] = WorkerState) -> WorkerState:
    """Restore engine (module, optimizer, scheduler), RNG and loop state (a ``state_cls``)."""
    directory = Path(directory)
    manifest = read_manifest(directory, KIND, SCHEMA_VERSION)
    check_resumable(manifest, plan, str(directory))
    path, _ = engine.load_checkpoint(str(directory / DS_DIR), tag=manifest["deepspeed_tag"],
                                     load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"{directory / DS_DIR}: DeepSpeed found no checkpoint {manifest['deepspeed_tag']}")
    state = state_cls.from_json(json.loads((directory / STATE_FILE).read_text()))
    restore_rng(json.loads((directory / rng_file(rank)).read_text()))
    return state


ZERO_PARTITION = re.compile(r"(.*zero_pp_rank_)(\d+)(_.*\.pt)")  # DeepSpeed's file of one rank's partition


def incomplete(directory: str | Path) -> str | None:
    """Why the checkpoint directory cannot be resumed from (a part missing, cut short or unreadable), or None.

    Why: a checkpoint is copied into Ray Train's storage file by file, so a process killed during the copy
    leaves a directory with some files absent and the last one truncated. Without reading the tensors:
    our JSON parses (each was written atomically), each rank of the plan left its RNG file, DeepSpeed's
    ``torch.save`` files are whole zip archives (a cut one has no central directory at its end), and each
    safetensors file is as long as its header says."""
    import zipfile

    directory = Path(directory)
    try:
        manifest = read_manifest(directory, KIND, SCHEMA_VERSION)
        json.loads((directory / STATE_FILE).read_text())
        ranks = int(manifest.get("plan", {}).get("num_workers", 1))
        for rank in range(ranks):
            json.loads((directory / rng_file(rank)).read_text())
    except (OSError, ValueError) as exc:  # ArtifactMismatch is a ValueError; JSONDecodeError too
        return f"{type(exc).__name__}: {exc}"
    tag = directory / DS_DIR / str(manifest.get("deepspeed_tag"))
    if not tag.is_dir() or not any(tag.iterdir()):
        return f"{tag}: no DeepSpeed checkpoint"
    for f in sorted(tag.rglob("*.pt")):
        if not zipfile.is_zipfile(f):
            return f"{f}: not a whole torch.save archive"
    # Each rank copies its own files, so a kill can leave some absent while every file there is whole:
    # the module's states (mp_rank_00_model_states.pt; under ZeRO-3 one per rank), and each kind of ZeRO
    # partition (zero_pp_rank_<r>_mp_rank_00_optim_states.pt, bf16_..., ...) for every data-parallel rank
    names = {f.name for f in tag.rglob("*.pt")}
    if not any(n.endswith("model_states.pt") for n in names):
        return f"{tag}: no model states"
    kinds = {(m[1], m[3]) for m in map(ZERO_PARTITION.fullmatch, names) if m}
    for head, tail in sorted(kinds):
        for rank in range(ranks):
            if f"{head}{rank}{tail}" not in names:
                return f"{tag}: no {head}{rank}{tail}"
    for f in sorted(directory.glob("*.safetensors")):
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            try:
                header = json.loads(fh.read(n)) if 0 < n < size else None
            except ValueError:
                header = None
        ends = [v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"]
        if header is None or 8 + n + max(ends, default=0) > size:
            return f"{f}: cut short"
    return None


def load_tensors(directory: str | Path, name: str) -> dict[str, torch.Tensor] | None:
    """The named tensors saved as ``name`` by :func:`save` (None when this checkpoint has none)."""
    path = Path(directory) / name
    return load_file(str(path)) if path.exists() else None

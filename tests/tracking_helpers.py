"""Reading back what a tracked run wrote: MLflow's store through MlflowClient, and W&B's offline
run directories through the records of their ``.wandb`` files.

wandb 0.31 ships no Python reader of ``.wandb`` files (its Go core writes and syncs them), so
:func:`wandb_records` undoes the framing: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then LevelDB's log format (32 KiB blocks; each chunk a 4-byte checksum, a 2-byte length, a type:
1 whole, 2 first, 3 middle, 4 last); each record is parsed with wandb's own protobuf,
``wandb.proto.wandb_internal_pb2.Record``. Checksums are not verified: a corrupt file fails
to parse, which fails the test as well.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
HEADER = 7


def wandb_records(path: str | Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a .wandb file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def complete_records(path: Path, wait_s: float = 60.0) -> list[Any]:
    """The records of a ``.wandb`` file once W&B has written all of it: up to its exit record.

    ``run.finish()`` returns before wandb-core closes the run's stream, and the core writes the file
    out when it closes it (seen: a read right after ``finish`` found no run record; 50 ms later the
    file was whole). So wait for the exit record, which ``finish`` sends last."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = list(wandb_records(path))
        except Exception as e:  # noqa: BLE001 (a half-written file: a cut chunk, or not even the header yet)
            if time.monotonic() > deadline:
                raise AssertionError(f"{path}: still not a whole .wandb file after {wait_s} s: {e}") from e
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {wait_s} s ({len(records)} records)"
        time.sleep(0.1)


def wandb_run(run_dir: Path, wait_s: float = 60.0) -> dict[str, Any]:
    """One finished offline run directory: its id, config, history rows ({step: {key: value}}),
    summary updates and logged artifacts (name, type, file paths); ``wait_s``: for the file to be whole."""
    (file,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"id": None, "config": {}, "history": {}, "summary": {}, "artifacts": []}
    for rec in complete_records(file, wait_s):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"] = rec.run.run_id
            out["config"].update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            step = rec.history.step.num if rec.history.HasField("step") else row.get("_step")
            out["history"].setdefault(int(step), {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "artifact":
            out["artifacts"].append({"name": rec.artifact.name, "type": rec.artifact.type,
                                     "files": sorted(e.path for e in rec.artifact.manifest.contents)})
    return out


def wandb_runs(wandb_dir: Path, wait_s: float = 60.0) -> list[dict[str, Any]]:
    """Every offline run under ``<dir>/wandb``, oldest first (one per process that opened it)."""
    return [wandb_run(d, wait_s) for d in sorted((wandb_dir / "wandb").glob("offline-run-*"))]


def mlflow_history(client: Any, run_id: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of a run, the last value of a step winning (as metrics.jsonl's reader)."""
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            out.setdefault(m.step, {})[key] = m.value
    return out


def mlflow_artifacts(client: Any, run_id: str, path: str = "") -> list[str]:
    """Every artifact file of a run, recursively."""
    out = []
    for a in client.list_artifacts(run_id, path or None):
        out.extend(mlflow_artifacts(client, run_id, a.path) if a.is_dir else [a.path])
    return sorted(out)

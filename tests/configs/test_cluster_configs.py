"""Cluster configs parse and pass Ray's own launcher validation (offline)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "configs" / "cluster"
LAUNCHER = sorted(CLUSTER.glob("*.yaml"))
KUBERAY = CLUSTER / "kuberay"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_passes_ray_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(path)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # raises jsonschema.ValidationError / ValueError
    gpu = prepared["available_node_types"]["gpu_worker"]
    assert prepared["head_node_type"] == "head"
    assert gpu["min_workers"] >= 1
    opts = " ".join(prepared["docker"]["run_options"])
    assert "--shm-size" in opts and "nofile" in opts
    # The dashboard must not be opened beyond loopback on a cloud VM.
    assert all("--dashboard-host=127.0.0.1" in c for c in prepared["head_start_ray_commands"] if "--head" in c)


def test_launcher_validation_rejects_a_broken_config():
    """Guards the test above: Ray's validation does reject a bad config here."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(LAUNCHER[0])
    config["head_node_type"] = "no_such_type"
    with pytest.raises(Exception):
        validate_config(prepare_config(config))


def _pod_specs(spec: dict):
    yield spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["template"]["spec"]


def _check_raycluster_spec(spec: dict, where: str):
    assert "headGroupSpec" in spec and "rayStartParams" in spec["headGroupSpec"], where
    assert spec["workerGroupSpecs"], where
    for group in spec["workerGroupSpecs"]:
        for key in ("groupName", "replicas", "rayStartParams", "template"):
            assert key in group, f"{where}: worker group lacks {key}"
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" in limits, f"{where}: worker group without GPUs"
    for pod in _pod_specs(spec):
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert "/mnt/shared" in mounts, f"{where}: shared storage not mounted"
        assert pod["containers"][0]["image"].startswith("rayproject/ray:")


def test_kuberay_raycluster():
    doc = _load(KUBERAY / "raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    _check_raycluster_spec(doc["spec"], "raycluster.yaml")


def test_kuberay_rayjob_runs_the_aida_job():
    doc = _load(KUBERAY / "rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    assert "jobs/aida_finetune.py" in doc["spec"]["entrypoint"]
    runtime_env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    assert "working_dir" in runtime_env
    _check_raycluster_spec(doc["spec"]["rayClusterSpec"], "rayjob.yaml")
    pvc = _load(KUBERAY / "shared-pvc.yaml")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

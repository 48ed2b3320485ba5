"""The KubeRay manifests (configs/cluster/kuberay/*.yaml) as the config tests read them."""
from __future__ import annotations

from pathlib import Path

import yaml

KUBERAY = Path(__file__).resolve().parents[2] / "configs" / "cluster" / "kuberay"
# Where each custom resource keeps its RayClusterSpec.
_SPEC_KEYS = {"RayCluster": (), "RayJob": ("rayClusterSpec",), "RayService": ("rayClusterConfig",)}


def docs() -> list[tuple[str, dict]]:
    """(file name, document) of every YAML document under configs/cluster/kuberay/."""
    out = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def cluster_specs() -> list[tuple[str, dict]]:
    """Every RayClusterSpec: a RayCluster's spec, a RayJob's rayClusterSpec, a RayService's rayClusterConfig."""
    out = []
    for name, doc in docs():
        if doc["kind"] in _SPEC_KEYS:
            spec = doc["spec"]
            for key in _SPEC_KEYS[doc["kind"]]:
                spec = spec[key]
            out.append((name, spec))
    return out

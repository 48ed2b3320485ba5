"""Cluster configs: what they let in, what they run, and that they are well-formed.

Security properties are asserted on the parsed configs: every Ray container authenticates
with the token from one Secret, nothing is exposed beyond the cluster, no host networking,
no placeholder values, the project's image everywhere. Kubernetes objects (the pod templates
inside the KubeRay CRDs, the PVC, the Secret of the documented recipe) are validated against
the Kubernetes OpenAPI schema offline with kubernetes-validate; launcher configs go through
Ray's own validation.
"""
from __future__ import annotations

import ast
import copy
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.configs.kuberay_manifests import cluster_specs as _cluster_specs
from tests.configs.kuberay_manifests import docs as _docs

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "configs" / "cluster"
LAUNCHER = sorted(CLUSTER.glob("*.yaml"))
KUBERAY = CLUSTER / "kuberay"
K8S_VERSION = "1.30"  # validate against a release most managed clusters still run
SECRET_KEY = "auth_token"  # KubeRay's key for the token inside the Secret
IMAGE_PATH = "/home/ray/dist-nce"  # where the image and the launcher put the checkout


def _setup_version() -> str:
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    return next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "version")


PROJECT_IMAGE = f"dist-nce:{_setup_version()}"
# The committed name, or the same name in a registry the user pushed it to.
IMAGE_RE = re.compile(r"^(?:[\w.\-]+(?::\d+)?/)*" + re.escape(PROJECT_IMAGE) + r"$")
PLACEHOLDER_RE = re.compile(
    r"YOUR[-_ ]|CHANGE[-_ ]?ME|REPLACE[-_ ]?ME|FIXME|\bTODO\b|\bXXX\b|<[A-Za-z][^<>]*>|example\.(?:com|org)",
    re.IGNORECASE)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


# ---------------------------------------------------------------- KubeRay manifests

def _pod_templates() -> list[tuple[str, dict]]:
    """Every pod template that runs Ray: head, worker groups, and the RayJob submitter."""
    out = []
    for name, spec in _cluster_specs():
        out.append((f"{name}:head", spec["headGroupSpec"]["template"]))
        for group in spec["workerGroupSpecs"]:
            out.append((f"{name}:{group['groupName']}", group["template"]))
    for name, doc in _docs():
        if doc["kind"] == "RayJob":
            assert "submitterPodTemplate" in doc["spec"], f"{name}: the submitter pod template must be explicit"
            out.append((f"{name}:submitter", doc["spec"]["submitterPodTemplate"]))
    return out


def _secret_recipes() -> list[tuple[str, list[str]]]:
    """The `kubectl create secret generic ...` command each manifest documents."""
    out = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        for line in path.read_text().splitlines():
            if line.lstrip("# ").startswith("kubectl create secret generic "):
                out.append((path.name, shlex.split(line.lstrip("# "))))
    return out


def _secret_name() -> str:
    names = {spec["authOptions"]["secretName"] for _, spec in _cluster_specs()}
    assert len(names) == 1, f"one token Secret for all manifests, found {names}"
    return names.pop()


def _validate(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _as_pod_template(where: str, template: dict) -> dict:
    """A core v1 PodTemplate around a CRD's embedded PodTemplateSpec, for schema validation."""
    name = re.sub(r"[^a-z0-9-]", "-", where.lower())
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def test_kuberay_manifests_cover_the_cluster_the_job_and_the_volume():
    kinds = sorted({(name, d["apiVersion"], d["kind"]) for name, d in _docs()})
    assert kinds == [("networkpolicy.yaml", "networking.k8s.io/v1", "NetworkPolicy"),
                     ("ray-tls.yaml", "v1", "ConfigMap"),
                     ("raycluster.yaml", "ray.io/v1", "RayCluster"), ("rayjob.yaml", "ray.io/v1", "RayJob"),
                     ("rayservice.yaml", "ray.io/v1", "RayService"),
                     ("shared-pvc.yaml", "v1", "PersistentVolumeClaim")]
    assert len(_pod_templates()) == 7  # 3 heads, 3 worker groups, 1 submitter


@pytest.mark.parametrize("where,template", _pod_templates(), ids=[w for w, _ in _pod_templates()])
def test_every_ray_container_authenticates_with_the_token_from_the_secret(where, template):
    secret = _secret_name()
    containers = template["spec"]["containers"]
    assert containers, where
    # Init containers run no Ray (ray-tls only writes the pod's certificate): they get no token.
    # KubeRay's own wait-gcs-ready init container copies the Ray container's env.
    for c in template["spec"].get("initContainers", []):
        assert "RAY_AUTH_TOKEN" not in {e["name"] for e in c.get("env", [])}, f"{where}/{c['name']}"
        assert "ray" not in " ".join(c.get("command", []) + c.get("args", [])).split(), f"{where}/{c['name']}"
    for c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}/{c['name']}: RAY_AUTH_MODE != token"
        token = env.get("RAY_AUTH_TOKEN", {})
        assert "value" not in token, f"{where}/{c['name']}: a literal token in the manifest"
        ref = token.get("valueFrom", {}).get("secretKeyRef")
        assert ref == {"name": secret, "key": SECRET_KEY}, f"{where}/{c['name']}: token not from Secret {secret}: {token}"
        assert not c.get("envFrom"), f"{where}/{c['name']}: envFrom could override the auth env"


def test_kuberay_operator_knows_the_token():
    """authOptions makes the operator send the token on its own dashboard calls (RayJob status)."""
    for name, spec in _cluster_specs():
        assert spec["authOptions"] == {"mode": "token", "secretName": _secret_name()}, name
        major, minor = (int(x) for x in spec["rayVersion"].split(".")[:2])
        assert (major, minor) >= (2, 52), f"{name}: Ray token auth needs Ray >= 2.52"


def test_the_documented_secret_recipe_matches_the_manifests_and_is_valid():
    recipes = _secret_recipes()
    assert {name for name, _ in recipes} == {"raycluster.yaml", "rayjob.yaml", "rayservice.yaml"}
    for name, argv in recipes:
        secret = argv[4]
        literal = next(a for a in argv if a.startswith("--from-literal="))
        key, value = literal[len("--from-literal="):].split("=", 1)
        assert (secret, key) == (_secret_name(), SECRET_KEY), name
        # A generated value, never one written into the repository.
        assert value.startswith("$(openssl rand "), f"{name}: the token must be generated, got {value!r}"
        _validate({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "type": "Opaque",
                   "stringData": {key: "generated"}})


def test_nothing_is_exposed_beyond_the_cluster():
    for name, doc in _docs():
        if doc["kind"] == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", name
    for name, spec in _cluster_specs():
        head = spec["headGroupSpec"]
        assert head.get("serviceType", "ClusterIP") == "ClusterIP", f"{name}: head Service {head.get('serviceType')}"
        assert not head.get("enableIngress"), f"{name}: Ingress to the head"
        ports = {p["containerPort"] for c in head["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert 10001 not in ports, f"{name}: Ray Client port on the head Service, and nothing uses Ray Client"
    for where, template in _pod_templates():
        spec = template["spec"]
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag), f"{where}: {flag}"
        for c in spec["containers"]:
            assert not any("hostPort" in p for p in c.get("ports", [])), f"{where}/{c['name']}: hostPort"
            assert c.get("securityContext", {}).get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}"
            assert not c.get("securityContext", {}).get("privileged"), f"{where}/{c['name']}: privileged"


def test_dashboard_binds_loopback_unless_the_operator_needs_it():
    """A plain RayCluster is reached by port-forward only; a RayJob's operator and submitter
    call the dashboard through the head Service, so it binds the pod address (token-guarded,
    asserted above)."""
    params = {name: spec["headGroupSpec"]["rayStartParams"] for name, spec in _cluster_specs()}
    assert params["raycluster.yaml"]["dashboard-host"] == "127.0.0.1"
    assert params["rayjob.yaml"]["dashboard-host"] == "0.0.0.0"
    # RayService: the operator deploys serveConfigV2 through the dashboard (networkpolicy.yaml fences it).
    assert params["rayservice.yaml"]["dashboard-host"] == "0.0.0.0"


def test_every_pod_runs_the_project_image():
    for where, template in _pod_templates():
        for c in template["spec"]["containers"]:
            assert IMAGE_RE.match(c["image"]), f"{where}/{c['name']}: image {c['image']!r} is not {PROJECT_IMAGE}"
    for path in LAUNCHER:
        assert IMAGE_RE.match(_rendered(path)["docker"]["image"].split("@sha256:")[0]), path.name
    assert IMAGE_RE.match("registry.internal:5000/ml/" + PROJECT_IMAGE)  # a pushed copy is accepted
    assert not IMAGE_RE.match("rayproject/ray:2.60.0-py311-gpu")


def test_rayjob_runs_the_aida_job_from_the_image_checkout():
    job = next(d for _, d in _docs() if d["kind"] == "RayJob")["spec"]
    assert job["entrypoint"].split()[:2] == ["python", "jobs/aida_finetune.py"]
    assert (REPO / "jobs" / "aida_finetune.py").is_file()
    runtime_env = yaml.safe_load(job["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == IMAGE_PATH
    assert job.get("submissionMode", "K8sJobMode") == "K8sJobMode"


def test_every_pod_mounts_the_shared_volume():
    pvc = next(d for _, d in _docs() if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, spec in _cluster_specs():
        groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
        for group in groups:
            pod = group["template"]["spec"]
            claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                      if "persistentVolumeClaim" in v}
            mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
            assert claims.get(mounts.get("/mnt/shared")) == pvc["metadata"]["name"], name
        if name == "rayservice.yaml":
            continue  # the linker's replicas run on CPUs (link.device cpu, as configs/serve/link.yaml)
        for group in spec["workerGroupSpecs"]:
            assert "nvidia.com/gpu" in group["template"]["spec"]["containers"][0]["resources"]["limits"], name


@pytest.mark.parametrize("where,template", _pod_templates(), ids=[w for w, _ in _pod_templates()])
def test_pod_templates_are_valid_kubernetes(where, template):
    _validate(_as_pod_template(where, template))


def test_pvc_is_valid_kubernetes():
    for name, doc in _docs():
        if doc["apiVersion"] == "v1":
            _validate(doc)


def test_schema_validation_rejects_broken_auth_wiring():
    """Guards the validation tests: the schema does catch a misspelt or incomplete env entry."""
    import kubernetes_validate

    where, template = _pod_templates()[0]
    no_key = copy.deepcopy(template)
    env = no_key["spec"]["containers"][0]["env"]
    del next(e for e in env if e["name"] == "RAY_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]["key"]
    misspelt = copy.deepcopy(template)
    misspelt["spec"]["containers"][0]["envv"] = misspelt["spec"]["containers"][0].pop("env")
    for broken in (no_key, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(_as_pod_template(where, broken))


# ---------------------------------------------------------------- placeholders

def test_no_placeholder_values():
    for path in LAUNCHER + sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for s in _strings(doc):
                assert not PLACEHOLDER_RE.search(s), f"{path.name}: placeholder in {s!r}"
    # The detector sees the placeholders these files used to carry.
    assert PLACEHOLDER_RE.search("https://github.com/YOUR-ORG/dist-nce/archive/main.zip")
    assert PLACEHOLDER_RE.search("YOUR-GCP-PROJECT")


# ---------------------------------------------------------------- Ray cluster launcher

# What an operator exports before scripts/cluster_up.py renders the launcher templates
# (the renderer's own checks: tests/configs/test_launchers.py).
LAUNCH_ENV = {
    "OPERATOR_CIDR": "10.8.0.0/24", "SHARED_NFS": "10.1.2.3:/kb",
    "DIST_NCE_IMAGE": f"registry.internal:5000/ml/{PROJECT_IMAGE}@sha256:{'0' * 64}",
    "AWS_REGION": "us-east-1", "AWS_SUBNET_ID": "subnet-0123456789abcdef0",
    "AWS_SECURITY_GROUP_ID": "sg-0123456789abcdef0",
    "AWS_HEAD_INSTANCE_PROFILE_ARN": "arn:aws:iam::123456789012:instance-profile/dist-nce-head",
    "AWS_WORKER_INSTANCE_PROFILE_ARN": "arn:aws:iam::123456789012:instance-profile/dist-nce-worker",
    "GCP_PROJECT": "ml-research-4711", "GCP_REGION": "us-central1", "GCP_ZONE": "us-central1-a",
    "GCP_SUBNETWORK": "dist-nce", "GCP_HEAD_SERVICE_ACCOUNT": "dist-nce-head@ml-research-4711.iam.gserviceaccount.com",
    "GCP_WORKER_SERVICE_ACCOUNT": "dist-nce-worker@ml-research-4711.iam.gserviceaccount.com",
}


def _rendered(path: Path) -> dict:
    """A launcher template as scripts/cluster_up.py renders it from LAUNCH_ENV."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cluster_up", REPO / "scripts" / "cluster_up.py")
    cluster_up = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cluster_up)
    cloud = path.name.split("-")[0]
    assert cluster_up.TEMPLATES[cloud] == path
    return yaml.safe_load(cluster_up.render(cloud, LAUNCH_ENV))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_passes_ray_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _rendered(path)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # raises jsonschema.ValidationError / ValueError
    gpu = prepared["available_node_types"]["gpu_worker"]
    assert prepared["head_node_type"] == "head"
    assert gpu["min_workers"] >= 1
    opts = " ".join(prepared["docker"]["run_options"])
    assert "--shm-size" in opts and "nofile" in opts
    assert "--ipc" not in opts, "--ipc=host shares the host's IPC namespace and makes --shm-size moot"


def test_launcher_validation_rejects_a_broken_config():
    """Guards the test above: Ray's validation does reject a bad config here."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _rendered(LAUNCHER[0])  # the config the test above passes, with this one fault
    config["head_node_type"] = "no_such_type"
    with pytest.raises(ValueError, match="`head_node_type` must be one of `available_node_types`"):
        validate_config(prepare_config(config))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_runs_ray_with_token_auth_and_a_loopback_dashboard(path):
    config = _load(path)
    docker = config["docker"]
    assert not any(k in docker for k in ("head_run_options", "worker_run_options", "head_image", "worker_image"))
    opts = [o.split() for o in docker["run_options"]]
    env = dict(o[1].split("=", 1) for o in opts if o[0] in ("--env", "-e"))
    assert env.get("RAY_AUTH_MODE") == "token", path.name
    token_path = env.get("RAY_AUTH_TOKEN_PATH")
    assert token_path and config["file_mounts"].get(token_path) == "~/.ray/auth_token", path.name
    assert "RAY_AUTH_TOKEN" not in env, f"{path.name}: a token value in the config"
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert not any("RAY_AUTH_MODE" in c for c in commands), f"{path.name}: a start command overrides the auth mode"
    heads = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert heads and all("--head" in c and "--dashboard-host=127.0.0.1" in c for c in heads), path.name


def _fake_tools(tmp_path: Path) -> tuple[dict, Path]:
    """sudo/mountpoint/mount.nfs stand-ins that log their arguments, so the mount step runs here."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    scripts = {"sudo": f'echo "sudo $*" >> {log}', "mountpoint": "exit 1",
               "mount.nfs": "exit 0", "mount.nfs4": "exit 0"}
    for name, body in scripts.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, log


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_shared_storage_step_mounts_or_stops(path, tmp_path):
    config = _load(path)
    assert "--volume /mnt/shared:/mnt/shared" in config["docker"]["run_options"], path.name
    (step,) = config["initialization_commands"]
    env, log = _fake_tools(tmp_path)

    # The template as committed (not rendered), or an empty export: the launch stops here,
    # saying what to set; so does a value that is not HOST:/PATH.
    assert step.count("SHARED_NFS='${SHARED_NFS}';") == 1
    for unset in (step, step.replace("SHARED_NFS='${SHARED_NFS}';", "SHARED_NFS='';"),
                  step.replace("SHARED_NFS='${SHARED_NFS}';", "SHARED_NFS='h:/kb x';")):
        done = subprocess.run(["bash", "-c", unset], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 1, done
        assert f"configs/cluster/{path.name}" in done.stderr and "SHARED_NFS" in done.stderr, done.stderr
        assert not log.exists(), "nothing may run before the check"

    # Rendered from the environment: the export is mounted at /mnt/shared.
    (configured,) = _rendered(path)["initialization_commands"]
    done = subprocess.run(["bash", "-c", configured], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done
    calls = log.read_text().splitlines()
    mounts = [c for c in calls if c.startswith("sudo mount ")]
    assert len(mounts) == 1 and mounts[0].endswith(" 10.1.2.3:/kb /mnt/shared"), calls

"""KubeRay manifests (configs/cluster/kuberay/): pod security, network reach, TLS, sizing, the linker.

- Every pod template (heads, worker groups, the RayJob submitter, the RayService's cluster) is
  checked against the rules of Kubernetes' "restricted" Pod Security Standard, implemented
  here from the standard (kubernetes.io/docs/concepts/security/pod-security-standards/,
  v1.30), and the checker itself is shown to flag templates that break each rule.
- The NetworkPolicies are evaluated with Kubernetes' ingress semantics on the pods the
  manifests create: which source pod reaches which pod on which port.
- TLS: the certificate script of ray-tls.yaml is run with openssl against a CA made with the
  documented command.
- Resource requests are compared with the allocatable CPU and memory of the machine types the
  launcher configs name.
- The RayService's Serve args go through the project's ServeConfig.
"""
from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.configs.kuberay_manifests import cluster_specs as _cluster_specs
from tests.configs.kuberay_manifests import docs as _docs

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "configs" / "cluster" / "kuberay"
LAUNCHER = sorted((REPO / "configs" / "cluster").glob("*.yaml"))
K8S_VERSION = "1.30"
HOME = "/home/ray"  # the image's user `ray` (uid 1000, gid 100), docker/Dockerfile's base image
UID, GID = 1000, 100
TLS_SECRET = "dist-nce-ray-tls"
TLS_SCRIPT_CONFIGMAP = "dist-nce-ray-tls-gen"
# Which deployment (app.kubernetes.io/instance) each manifest's pods belong to.
INSTANCES = {"raycluster.yaml": "dist-nce", "rayjob.yaml": "dist-nce-aida", "rayservice.yaml": "dist-nce-linker"}


# ---------------------------------------------------------------- manifests

def _ray_templates() -> list[tuple[str, str, str, dict]]:
    """(manifest, role, where, template) of every pod template that runs Ray; role is head or worker."""
    out = []
    for name, spec in _cluster_specs():
        out.append((name, "head", f"{name}:head", spec["headGroupSpec"]["template"]))
        for group in spec["workerGroupSpecs"]:
            out.append((name, "worker", f"{name}:{group['groupName']}", group["template"]))
    return out


def _submitter_templates() -> list[tuple[str, str, str, dict]]:
    return [(name, "submitter", f"{name}:submitter", doc["spec"]["submitterPodTemplate"])
            for name, doc in _docs() if doc["kind"] == "RayJob"]


ALL_TEMPLATES = _ray_templates() + _submitter_templates()
IDS = [where for _, _, where, _ in ALL_TEMPLATES]


def _containers(spec: dict) -> list[dict]:
    return [c for kind in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(kind, [])]


def _ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _validate(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_manifests_have_every_deployment():
    assert {name for name, _ in _cluster_specs()} == set(INSTANCES)
    assert len(_ray_templates()) == 6 and len(_submitter_templates()) == 1


# ---------------------------------------------------------------- the restricted Pod Security Standard

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def restricted_violations(template: dict) -> list[str]:
    """What keeps a pod template out of a namespace enforcing the "restricted" level (baseline
    rules included), one line per rule broken; empty when it is admitted."""
    meta, spec = template.get("metadata") or {}, template["spec"]
    psc = spec.get("securityContext") or {}
    bad = []
    # Baseline: host namespaces, HostProcess, hostPath (via the volume list below), sysctls,
    # AppArmor, SELinux, seccomp not Unconfined.
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            bad.append(f"spec.{flag}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("spec.securityContext.windowsOptions.hostProcess")
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"spec.securityContext.sysctls: {sysctl['name']}")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            bad.append(f"annotation {key}: {value}")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        bad.append("spec.securityContext.appArmorProfile: Unconfined")
    se = psc.get("seLinuxOptions") or {}
    if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        bad.append(f"spec.securityContext.seLinuxOptions: {se}")
    # Restricted: volume types, non-root, seccomp set.
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_non_root = psc.get("runAsNonRoot")
    if pod_non_root is False:
        bad.append("spec.securityContext.runAsNonRoot: false")
    if psc.get("runAsUser") == 0:
        bad.append("spec.securityContext.runAsUser: 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        bad.append("spec.securityContext.seccompProfile: Unconfined")
    for c in _containers(spec):
        where = f"container {c['name']}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{where}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{where}: windowsOptions.hostProcess")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{where}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{where}: capabilities.add {caps['add']}")
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{where}: capabilities.drop must include ALL")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(f"{where}: hostPort")
        if sc.get("procMount") not in (None, "Default"):
            bad.append(f"{where}: procMount {sc['procMount']}")
        c_se = sc.get("seLinuxOptions") or {}
        if c_se.get("type") not in SELINUX_TYPES or c_se.get("user") or c_se.get("role"):
            bad.append(f"{where}: seLinuxOptions {c_se}")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{where}: appArmorProfile Unconfined")
        c_seccomp = (sc.get("seccompProfile") or {}).get("type")
        if c_seccomp == "Unconfined" or (c_seccomp not in SECCOMP_OK and pod_seccomp not in SECCOMP_OK):
            bad.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost (pod or container)")
        if sc.get("runAsNonRoot") is False or (sc.get("runAsNonRoot") is not True and pod_non_root is not True):
            bad.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            bad.append(f"{where}: runAsUser 0")
    return bad


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_every_pod_is_admitted_under_the_restricted_profile(name, role, where, template):
    assert restricted_violations(template) == [], where


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_pods_run_as_the_image_user_with_the_shared_volume_group(name, role, where, template):
    psc = template["spec"]["securityContext"]
    assert (psc["runAsUser"], psc["runAsGroup"], psc["runAsNonRoot"]) == (UID, GID, True), where
    mounts_pvc = any("persistentVolumeClaim" in v for v in template["spec"].get("volumes", []))
    if mounts_pvc:  # files on the shared volume: group users, writable by every pod
        assert psc.get("fsGroup") == GID, where
    for c in _containers(template["spec"]):
        assert "runAsUser" not in (c.get("securityContext") or {}), f"{where}/{c['name']}: one uid per pod"


def _a_template() -> dict:
    return copy.deepcopy(next(t for n, r, _, t in ALL_TEMPLATES if n == "rayjob.yaml" and r == "worker"))


def _ray_sc(t):
    return t["spec"]["containers"][0].setdefault("securityContext", {})


def _init_sc(t):
    return t["spec"]["initContainers"][0].setdefault("securityContext", {})


BREAKS = {
    "privileged": lambda t: _ray_sc(t).update(privileged=True),
    "privileged init container": lambda t: _init_sc(t).update(privileged=True),
    "privilege escalation allowed": lambda t: _ray_sc(t).update(allowPrivilegeEscalation=True),
    "privilege escalation unset": lambda t: _init_sc(t).pop("allowPrivilegeEscalation"),
    "hostPath volume": lambda t: t["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/var/run"}}),
    "nfs volume": lambda t: t["spec"]["volumes"].append({"name": "n", "nfs": {"server": "10.0.0.2", "path": "/"}}),
    "host network": lambda t: t["spec"].update(hostNetwork=True),
    "host PID": lambda t: t["spec"].update(hostPID=True),
    "host port": lambda t: t["spec"]["containers"][0].setdefault("ports", []).append(
        {"containerPort": 6379, "hostPort": 6379}),
    "added capability": lambda t: _ray_sc(t)["capabilities"].update(add=["SYS_ADMIN"]),
    "capabilities not dropped": lambda t: _ray_sc(t)["capabilities"].update(drop=["NET_RAW"]),
    "no pod seccomp, none on a container": lambda t: t["spec"]["securityContext"].pop("seccompProfile"),
    "unconfined container seccomp": lambda t: _ray_sc(t).update(seccompProfile={"type": "Unconfined"}),
    "root uid": lambda t: _ray_sc(t).update(runAsUser=0),
    "runAsNonRoot false on a container": lambda t: _init_sc(t).update(runAsNonRoot=False),
    "runAsNonRoot unset everywhere": lambda t: t["spec"]["securityContext"].pop("runAsNonRoot"),
    "unsafe sysctl": lambda t: t["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "unmasked /proc": lambda t: _ray_sc(t).update(procMount="Unmasked"),
    "AppArmor unconfined": lambda t: _ray_sc(t).update(appArmorProfile={"type": "Unconfined"}),
    "AppArmor annotation unconfined": lambda t: t.setdefault("metadata", {}).setdefault("annotations", {}).update(
        {APPARMOR_ANNOTATION + "ray-worker": "unconfined"}),
    "SELinux user": lambda t: _ray_sc(t).update(seLinuxOptions={"user": "system_u"}),
    "privileged ephemeral container": lambda t: t["spec"].setdefault("ephemeralContainers", []).append(
        {"name": "debug", "image": "busybox", "securityContext": {"privileged": True}}),
}


@pytest.mark.parametrize("what", sorted(BREAKS))
def test_the_checker_refuses_a_template_breaking_a_rule(what):
    template = _a_template()
    assert restricted_violations(template) == []
    BREAKS[what](template)
    assert restricted_violations(template), f"{what}: not flagged"


def test_the_checker_reads_the_rules_not_the_keys():
    """Seccomp and runAsNonRoot may be set per container instead of per pod: still admitted."""
    template = _a_template()
    psc = template["spec"]["securityContext"]
    seccomp = psc.pop("seccompProfile")
    psc.pop("runAsNonRoot")
    for c in _containers(template["spec"]):
        c["securityContext"].update(seccompProfile=seccomp, runAsNonRoot=True)
    assert restricted_violations(template) == []
    template["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    assert restricted_violations(template) == []  # the one capability the profile allows


# ---------------------------------------------------------------- read-only root, writable paths

def _writes(env: dict[str, str], monkeypatch) -> dict[str, str]:
    """What a Ray container's processes write, where (env overrides applied)."""
    from dist_nce.kernels.build import cache_dir

    def at(var, default):
        return env.get(var) or default.replace("~", HOME)

    monkeypatch.setenv("HOME", HOME)
    monkeypatch.delenv("DIST_NCE_NATIVE_CACHE", raising=False)
    if env.get("DIST_NCE_NATIVE_CACHE"):
        monkeypatch.setenv("DIST_NCE_NATIVE_CACHE", env["DIST_NCE_NATIVE_CACHE"])
    return {
        "Ray's session dir (logs, sockets, spilling, unpacked working_dir)": "/tmp/ray",
        "temporary files (Python, gcc)": at("TMPDIR", "/tmp"),
        "Ray's object store, NCCL's shared memory": "/dev/shm",
        "Hugging Face cache": at("HF_HOME", "~/.cache/huggingface"),
        "torch hub": at("TORCH_HOME", "~/.cache/torch"),
        "DeepSpeed's op builds": at("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"),
        "Triton's kernel cache": at("TRITON_CACHE_DIR", "~/.triton/cache"),
        "CUDA's JIT cache": at("CUDA_CACHE_PATH", "~/.nv/ComputeCache"),
        "matplotlib's config": at("MPLCONFIGDIR", "~/.config/matplotlib"),
        "dist-nce's native kernels": str(cache_dir()),
    }


def _writable(path: str, container: dict, volumes: dict[str, dict]) -> bool:
    """Whether ``path`` lies on a writable emptyDir or PVC mount of ``container`` (else: the read-only root)."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return False
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = volumes[mount["name"]]
    return not mount.get("readOnly") and ("emptyDir" in volume or "persistentVolumeClaim" in volume)


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_root_filesystem_is_read_only_and_every_write_lands_on_a_volume(name, role, where, template, monkeypatch):
    spec = template["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in _containers(spec):
        assert c["securityContext"].get("readOnlyRootFilesystem") is True, f"{where}/{c['name']}"
    main = spec["containers"][0]
    if role == "submitter":  # `ray job submit` zips the working directory under /tmp
        writes = {"temporary files": "/tmp", "Ray's client state": f"{HOME}/.ray"}
    else:
        writes = _writes(_env(main), monkeypatch)
    for what, path in writes.items():
        assert _writable(path, main, volumes), f"{where}: {what} writes {path}, on the read-only root"
    assert _env(main).get("PYTHONDONTWRITEBYTECODE") == "1", f"{where}: .pyc writes into the image's checkout"
    # The checker sees a path left on the root filesystem.
    assert not _writable(f"{HOME}/.triton/cache", main, volumes)
    assert not _writable("/etc/ray/tls/tls.key", {"volumeMounts": [
        {"name": "t", "mountPath": "/etc/ray/tls", "readOnly": True}]}, {"t": {"emptyDir": {}}})


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_no_pod_gets_a_service_account_token(name, role, where, template):
    """Nothing in these pods calls the Kubernetes API: no in-tree autoscaler (see below)."""
    assert template["spec"].get("automountServiceAccountToken") is False, where


def test_group_sizes_are_fixed_without_an_autoscaler():
    """maxReplicas means nothing without in-tree autoscaling; the autoscaler would need the API token."""
    for name, spec in _cluster_specs():
        assert not spec.get("enableInTreeAutoscaling"), name
        for group in spec["workerGroupSpecs"]:
            assert group["minReplicas"] == group["replicas"] == group["maxReplicas"], f"{name}:{group['groupName']}"


# ---------------------------------------------------------------- TLS

TLS_ENV = {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "/etc/ray/tls/tls.crt",
           "RAY_TLS_SERVER_KEY": "/etc/ray/tls/tls.key", "RAY_TLS_CA_CERT": "/etc/ray/tls/ca.crt"}


def _tls_configmap() -> dict:
    return next(d for n, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == TLS_SCRIPT_CONFIGMAP)


@pytest.mark.parametrize("name,role,where,template", _ray_templates(), ids=[w for _, _, w, _ in _ray_templates()])
def test_every_ray_pod_speaks_tls_with_its_own_certificate(name, role, where, template):
    spec = template["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    main = spec["containers"][0]
    env = _env(main)
    assert {k: env.get(k) for k in TLS_ENV} == TLS_ENV, where
    # The generator runs first (KubeRay appends its wait-gcs-ready after it, and that one uses TLS).
    gen = spec["initContainers"][0]
    assert gen["name"] == "ray-tls" and gen["command"] == ["/bin/sh", "/etc/ray/tls-gen/gencert.sh"], where
    gen_mounts = {m["mountPath"]: m for m in gen["volumeMounts"]}
    main_mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    assert volumes[gen_mounts["/etc/ray/ca"]["name"]]["secret"]["secretName"] == TLS_SECRET, where
    assert volumes[gen_mounts["/etc/ray/tls-gen"]["name"]]["configMap"]["name"] == TLS_SCRIPT_CONFIGMAP, where
    assert "gencert.sh" in _tls_configmap()["data"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in gen["env"]} == {
        "POD_IP": "status.podIP", "POD_NAMESPACE": "metadata.namespace"}, where
    # Both see the same in-memory emptyDir; the Ray container only reads it.
    out = gen_mounts["/etc/ray/tls"]["name"]
    assert main_mounts["/etc/ray/tls"]["name"] == out and main_mounts["/etc/ray/tls"].get("readOnly") is True
    assert volumes[out]["emptyDir"].get("medium") == "Memory", f"{where}: the pod's key on the node's disk"
    # The CA's key never reaches the container that runs job code.
    secret_volumes = {n for n, v in volumes.items() if "secret" in v}
    for c in spec["containers"]:
        assert not {m["name"] for m in c["volumeMounts"]} & secret_volumes, f"{where}/{c['name']}: mounts the CA"


def _documented_ca_command() -> list[str]:
    for line in (KUBERAY / "ray-tls.yaml").read_text().splitlines():
        text = line.lstrip("# ")
        if text.startswith("openssl req -x509 "):
            return shlex.split(text)
    raise AssertionError("ray-tls.yaml documents no CA command")


def _make_ca(dirname: Path) -> Path:
    """The CA as documented, laid out as `kubectl create secret tls --cert=ca.crt --key=ca.key` mounts it."""
    dirname.mkdir()
    subprocess.run(_documented_ca_command(), cwd=dirname, check=True, capture_output=True, timeout=120)
    (dirname / "ca.crt").rename(dirname / "tls.crt")
    (dirname / "ca.key").rename(dirname / "tls.key")
    return dirname


def _gencert(tmp_path: Path, ca: Path, out: Path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "gencert.sh"
    script.write_text(_tls_configmap()["data"]["gencert.sh"])
    out.mkdir()
    run_env = {"PATH": os.environ["PATH"], "CA_DIR": str(ca), "TLS_DIR": str(out), **env}
    return subprocess.run(["/bin/sh", str(script)], env=run_env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_certificate_script_makes_a_pod_certificate_signed_by_the_ca(tmp_path):
    ca = _make_ca(tmp_path / "ca")
    out = tmp_path / "tls"
    done = _gencert(tmp_path, ca, out, POD_IP="10.4.2.7", POD_NAMESPACE="ml")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert (out / "tls.key").stat().st_mode & 0o077 == 0, "the pod's key is readable by others"
    text = subprocess.run(["openssl", "x509", "-in", str(out / "tls.crt"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    sans = re.search(r"Subject Alternative Name:.*?\n\s*(.+)", text).group(1)
    for name in ("IP Address:10.4.2.7", "IP Address:127.0.0.1", "DNS:localhost", "DNS:*.ml.svc.cluster.local"):
        assert name in sans, sans
    # Ray's gRPC is mutual: every pod's certificate serves and authenticates as a client.
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
    assert "CA:FALSE" in text
    verify = ["openssl", "verify", "-CAfile"]
    assert subprocess.run(verify + [str(out / "ca.crt"), str(out / "tls.crt")], capture_output=True).returncode == 0

    # Guards: a certificate from another CA does not verify against this one; no pod IP, no certificate.
    other_ca = _make_ca(tmp_path / "other-ca")
    other = tmp_path / "other"
    assert _gencert(tmp_path, other_ca, other, POD_IP="10.4.2.8", POD_NAMESPACE="ml").returncode == 0
    assert subprocess.run(verify + [str(out / "ca.crt"), str(other / "tls.crt")], capture_output=True).returncode != 0
    missing = _gencert(tmp_path, ca, tmp_path / "no-ip", POD_NAMESPACE="ml")
    assert missing.returncode != 0 and "POD_IP" in missing.stderr


def test_tls_objects_are_valid_kubernetes():
    _validate(_tls_configmap())
    # What `kubectl create secret tls` makes of the documented CA.
    _validate({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": TLS_SECRET}, "type": "kubernetes.io/tls",
               "stringData": {"tls.crt": "pem", "tls.key": "pem"}})
    assert "kubectl create secret tls " + TLS_SECRET + " --cert=ca.crt --key=ca.key" in (
        KUBERAY / "ray-tls.yaml").read_text()


# ---------------------------------------------------------------- NetworkPolicy

NAMESPACE = "ml"
OPERATOR_NAMESPACE = "kuberay-operator"
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}


def _policies() -> list[dict]:
    return [d for _, d in _docs() if d["kind"] == "NetworkPolicy"]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the evaluator reads matchLabels only: {selector}"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer(peer: dict, src: tuple[str, dict]) -> bool:
    assert set(peer) <= {"podSelector", "namespaceSelector"}, f"the evaluator reads pod and namespace peers: {peer}"
    namespace, labels = src
    if "namespaceSelector" in peer:
        in_namespace = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        in_namespace = namespace == NAMESPACE  # a podSelector alone means the policy's namespace
    return in_namespace and _selects(peer.get("podSelector") or {}, labels)


def _port(ports: list[dict] | None, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        assert p.get("protocol", "TCP") == "TCP" and isinstance(p.get("port", 0), int), p
        if "port" not in p or p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def admitted(policies: list[dict], dst: dict, src: tuple[str, dict], port: int) -> bool:
    """Kubernetes' ingress rule for a TCP connection to pod ``dst`` (labels, in NAMESPACE) from pod
    ``src`` (namespace, labels): allowed when no policy selects dst, else when a rule of one that does admits it."""
    selecting = [p["spec"] for p in policies
                 if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    return any((not rule.get("from") or any(_peer(peer, src) for peer in rule["from"])) and _port(rule.get("ports"), port)
               for spec in selecting for rule in spec.get("ingress") or [])


def _pod_labels(name: str, role: str, template: dict) -> dict:
    """The labels of a pod created from ``template``: its own plus those KubeRay adds."""
    labels = dict(template["metadata"]["labels"])
    if role in ("head", "worker"):
        labels.update({"ray.io/node-type": role, "ray.io/cluster": INSTANCES[name] + "-x7k2p", "ray.io/is-ray-node": "yes"})
    return labels


PORTS = {"gcs": 6379, "dashboard": 8265, "ray client": 10001, "serve": 8000, "dashboard agent": 52365,
         "metrics": 8080, "worker": 10005, "TCPStore": 29500, "NCCL": 47123}


def _sources() -> dict[str, tuple[str, dict]]:
    out = {}
    for name, role, _, template in ALL_TEMPLATES:
        out[f"{INSTANCES[name]} {role}"] = (NAMESPACE, _pod_labels(name, role, template))
    twin = out["dist-nce-aida worker"][1]
    out.update({
        "unlabelled pod": (NAMESPACE, {"app": "notebook"}),
        "same labels, other namespace": ("other", twin),
        "operator": (OPERATOR_NAMESPACE, OPERATOR),
        "operator's label, other namespace": ("other", OPERATOR),
        "linker client": (NAMESPACE, {"dist-nce-linker-client": "true"}),
        "linker client, other namespace": ("other", {"dist-nce-linker-client": "true"}),
    })
    return out


def _expected(name: str, role: str, source: str) -> set[int]:
    """The ports the source may reach on a pod of manifest ``name`` in ``role``."""
    instance = INSTANCES[name]
    if role == "submitter":
        return set()
    if source in (f"{instance} head", f"{instance} worker"):
        return set(PORTS.values())
    if source == "operator" and role == "head" and name in ("rayjob.yaml", "rayservice.yaml"):
        return {8265}
    if source == "dist-nce-aida submitter" and role == "head" and name == "rayjob.yaml":
        return {8265}
    if source == "linker client" and name == "rayservice.yaml":
        return {8000}
    return set()


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_network_policies_admit_only_the_deployments_own_pods(name, role, where, template):
    policies, dst = _policies(), _pod_labels(name, role, template)
    assert dst["app.kubernetes.io/instance"] == INSTANCES[name], where
    for source, src in _sources().items():
        reached = {port for port in PORTS.values() if admitted(policies, dst, src, port)}
        assert reached == _expected(name, role, source), f"{where} from {source}"


def test_the_policy_evaluator_sees_an_open_rule():
    """Guards the test above: a rule admitting any pod, or any namespace, is seen as such."""
    dst = _pod_labels("raycluster.yaml", "head", _ray_templates()[0][3])
    stranger, twin = _sources()["unlabelled pod"], _sources()["same labels, other namespace"]
    twin = (twin[0], {**twin[1], "app.kubernetes.io/instance": "dist-nce"})
    assert not admitted(_policies(), dst, stranger, 6379) and not admitted(_policies(), dst, twin, 6379)
    any_pod = {"spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]}}
    assert admitted(_policies() + [any_pod], dst, stranger, 6379)
    any_namespace = copy.deepcopy(next(p for p in _policies() if p["metadata"]["name"] == "dist-nce-ray-peers"))
    any_namespace["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
    assert admitted(_policies() + [any_namespace], dst, twin, 6379)
    assert admitted([], dst, stranger, 6379)  # no policy: Kubernetes lets everything in


def test_network_policies_are_valid_kubernetes():
    for policy in _policies():
        _validate(policy)
    names = [p["metadata"]["name"] for p in _policies()]
    assert len(names) == len(set(names))


def test_the_ray_client_port_is_not_published():
    for name, spec in _cluster_specs():
        ports = {p["containerPort"] for c in spec["headGroupSpec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        assert 10001 not in ports, name


# ---------------------------------------------------------------- resources against the machines named

GIB = 1024 ** 3
# Machine types: vCPUs, memory (GiB), GPUs, the platform whose kubelet reservation applies, and for EKS the
# VPC CNI's max pods. Sources: cloud.google.com/compute/docs/gpus and .../general-purpose-machines
# (GCE's memory figures are binary GB: memoryMb 696320 for a2-highgpu-8g); aws.amazon.com/ec2/instance-types
# (p4, p5, m6i); max pods from amazon-vpc-cni-k8s misc/eni-max-pods.txt (737 taken for the p instances, the
# larger figure, which only lowers allocatable).
MACHINES = {
    "n2-standard-16": {"cpu": 16, "memory_gib": 64, "gpus": 0, "platform": "gke"},
    "a2-highgpu-8g": {"cpu": 96, "memory_gib": 680, "gpus": 8, "platform": "gke"},
    "a3-highgpu-8g": {"cpu": 208, "memory_gib": 1872, "gpus": 8, "platform": "gke"},
    "m6i.4xlarge": {"cpu": 16, "memory_gib": 64, "gpus": 0, "platform": "eks", "max_pods": 234},
    "p4d.24xlarge": {"cpu": 96, "memory_gib": 1152, "gpus": 8, "platform": "eks", "max_pods": 737},
    "p5.48xlarge": {"cpu": 192, "memory_gib": 2048, "gpus": 8, "platform": "eks", "max_pods": 737},
}
# What the node's own pods (CNI, kube-proxy, logging, the GPU device plugin) may take on top of the
# kubelet's reservation: requests must leave this share of allocatable free.
DAEMON_SHARE = 0.05


def _tiers(amount: float, tiers: list[tuple[float, float]]) -> float:
    """Sum of rate x the part of ``amount`` in each (width, rate) tier; the last width may be inf."""
    total, start = 0.0, 0.0
    for width, rate in tiers:
        total += rate * max(0.0, min(amount, start + width) - start)
        start += width
    return total


def allocatable(machine: str) -> tuple[float, float]:
    """(vCPUs, bytes) the kubelet offers pods on ``machine``. CPU, GKE and EKS alike: 6% of the first core,
    1% of the second, 0.5% of the next two, 0.25% above four. Memory, GKE: 25% of the first 4 GiB, 20% of the
    next 4, 10% of the next 8, 6% of the next 112, 2% above 128 GiB; EKS: 11 MiB per pod the node may run
    plus 255 MiB. Both evict at 100 MiB free."""
    m = MACHINES[machine]
    cpu = m["cpu"] - _tiers(m["cpu"], [(1, .06), (1, .01), (2, .005), (float("inf"), .0025)])
    if m["platform"] == "gke":
        reserved = _tiers(m["memory_gib"], [(4, .25), (4, .20), (8, .10), (112, .06), (float("inf"), .02)]) * GIB
    else:
        reserved = (11 * m["max_pods"] + 255) * 2 ** 20
    return cpu, m["memory_gib"] * GIB - reserved - 100 * 2 ** 20


def test_allocatable_follows_the_reservation_tiers():
    """n2-standard-16 by hand: CPU 0.06 + 0.01 + 2 x 0.005 + 12 x 0.0025 = 0.11 reserved; memory 1 + 0.8 +
    0.8 + 48 x 0.06 = 5.48 GiB reserved, plus the 100 MiB eviction threshold."""
    cpu, memory = allocatable("n2-standard-16")
    assert cpu == pytest.approx(15.89)
    assert memory / GIB == pytest.approx(64 - 5.48 - 0.1, abs=0.01)


_QUANTITY = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3, "": 1}


def quantity(value) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * _QUANTITY[unit]


def _pod_requests(spec: dict) -> dict[str, float]:
    """The pod's effective requests: the larger of its containers' sum and its largest init container."""
    def req(c, key):
        return quantity((c.get("resources") or {}).get("requests", {}).get(key, 0))
    keys = ("cpu", "memory", "nvidia.com/gpu")
    return {k: max(sum(req(c, k) for c in spec["containers"]),
                   max((req(c, k) for c in spec.get("initContainers", [])), default=0)) for k in keys}


def _named_machines() -> tuple[set[str], set[str]]:
    """(head machines, GPU worker machines) the launcher configs name."""
    heads, workers = set(), set()
    for path in LAUNCHER:
        config = yaml.safe_load(path.read_text())
        for node_name, node in config["available_node_types"].items():
            machine = node["node_config"].get("machineType") or node["node_config"].get("InstanceType")
            (heads if node_name == config["head_node_type"] else workers).add(machine)
    assert heads and workers, "the launcher configs name no machines"
    assert heads | workers <= set(MACHINES), f"add {sorted(heads | workers - set(MACHINES))} to MACHINES"
    return heads, {m for m in workers if MACHINES[m]["gpus"]}


@pytest.mark.parametrize("name,role,where,template", ALL_TEMPLATES, ids=IDS)
def test_every_pod_fits_the_machines_named(name, role, where, template):
    heads, gpus = _named_machines()
    assert len(heads) == len(gpus) == len(LAUNCHER) == 2  # a head type and an 8-GPU type per cloud
    spec = template["spec"]
    need = _pod_requests(spec)
    for c in spec["containers"]:
        res = c["resources"]
        if role != "submitter":  # Ray sizes itself from the limits: requests = limits, a Guaranteed pod
            assert res["requests"] == res["limits"], f"{where}/{c['name']}"
    for machine in sorted(gpus if need["nvidia.com/gpu"] else heads):
        cpu, memory = allocatable(machine)
        assert need["cpu"] <= (1 - DAEMON_SHARE) * cpu, f"{where}: {need['cpu']} CPUs on {machine} ({cpu:.2f})"
        assert need["memory"] <= (1 - DAEMON_SHARE) * memory, (
            f"{where}: {need['memory'] / GIB:.0f} GiB on {machine} ({memory / GIB:.1f} GiB allocatable)")
        assert need["nvidia.com/gpu"] <= MACHINES[machine]["gpus"], f"{where} on {machine}"


def test_the_old_worker_request_did_not_fit():
    """Guards the test above: 900Gi on an a2-highgpu-8g is refused, as the issue found."""
    _, memory = allocatable("a2-highgpu-8g")
    assert quantity("900Gi") > memory and quantity("580Gi") <= (1 - DAEMON_SHARE) * memory


def _cluster_groups():
    for name, spec in _cluster_specs():
        yield f"{name}:head", spec["headGroupSpec"]
        for group in spec["workerGroupSpecs"]:
            yield f"{name}:{group['groupName']}", group


@pytest.mark.parametrize("where,group", list(_cluster_groups()), ids=[w for w, _ in _cluster_groups()])
def test_shared_memory_fits_the_memory_limit_and_holds_the_object_store(where, group):
    spec = group["template"]["spec"]
    main = spec["containers"][0]
    shm_mount = next(m for m in main["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm = next(v for v in spec["volumes"] if v["name"] == shm_mount["name"])["emptyDir"]
    assert shm["medium"] == "Memory", where
    size, limit = quantity(shm["sizeLimit"]), quantity(main["resources"]["limits"]["memory"])
    assert size <= limit / 2, f"{where}: /dev/shm {shm['sizeLimit']} counts against the memory limit"
    store = group["rayStartParams"].get("object-store-memory")
    if store is not None:  # else Ray takes min(30% of memory, 95% of /dev/shm)
        assert int(store) <= 0.95 * size, f"{where}: the object store would not fit /dev/shm and fall back to /tmp"


# ---------------------------------------------------------------- the linker's RayService

def _service() -> dict:
    return next(d for _, d in _docs() if d["kind"] == "RayService")


def test_the_rayservice_serves_the_linker_with_args_serveconfig_accepts():
    from dist_nce.core.config import from_dict
    from dist_nce.link.config import ServeConfig

    serve = yaml.safe_load(_service()["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "dist_nce.link.serve:build_app"
    cfg = from_dict(ServeConfig, app["args"], "rayservice.yaml serveConfigV2")
    assert cfg.run.startswith("/mnt/shared/"), "the run must be on the volume every pod mounts"
    # The serve Service reaches the proxies on the pod address; networkpolicy.yaml fences port 8000.
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}
    cluster = _service()["spec"]["rayClusterConfig"]
    cpus = sum(quantity(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) * g["replicas"]
               for g in cluster["workerGroupSpecs"])
    replicas = cfg.encoder_replicas + cfg.ingress_replicas + getattr(cfg, "searcher_replicas", 0)
    assert replicas * cfg.replica_cpus <= cpus, "the replicas cannot all be placed"
    for group in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        ports = {p["containerPort"] for p in group["template"]["spec"]["containers"][0].get("ports", [])}
        assert 8000 in ports


def test_serveconfig_refuses_an_unknown_key():
    """Guards the test above: a misspelt arg in serveConfigV2 would be caught."""
    from dist_nce.core.config import ConfigError, from_dict
    from dist_nce.link.config import ServeConfig

    args = dict(yaml.safe_load(_service()["spec"]["serveConfigV2"])["applications"][0]["args"])
    args["encoder_replica"] = args.pop("encoder_replicas")
    with pytest.raises(ConfigError):
        from_dict(ServeConfig, args, "rayservice.yaml")


def test_the_rayservice_pod_templates_are_valid_kubernetes():
    cluster = _service()["spec"]["rayClusterConfig"]
    for i, group in enumerate([cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]):
        _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"linker-{i}"},
                   "template": group["template"]})

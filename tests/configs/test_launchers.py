"""scripts/cluster_up.py: the launcher templates rendered from the environment, and what the
rendered configs and the one-time cloud commands let in.

Security properties are asserted on the rendered configs: no public address on any node, one
pre-made security group (AWS) or tagged firewall rules (GCP) with SSH only from OPERATOR_CIDR,
explicit and separate head/worker identities; and on the printed setup commands and IAM policies.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cluster_up", REPO / "scripts" / "cluster_up.py")
cluster_up = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cluster_up)

IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/dist-nce:0.1.0@sha256:{'a' * 64}"
COMMON = {"OPERATOR_CIDR": "10.8.0.0/24", "SHARED_NFS": "fs-0123456789abcdef0.efs.us-east-1.amazonaws.com:/",
          "DIST_NCE_IMAGE": IMAGE}
ENV = {
    "aws": {**COMMON, "AWS_REGION": "us-east-1", "AWS_SUBNET_ID": "subnet-0123456789abcdef0",
            "AWS_SECURITY_GROUP_ID": "sg-0123456789abcdef0",
            "AWS_HEAD_INSTANCE_PROFILE_ARN": "arn:aws:iam::123456789012:instance-profile/dist-nce-head",
            "AWS_WORKER_INSTANCE_PROFILE_ARN": "arn:aws:iam::123456789012:instance-profile/dist-nce-worker"},
    "gcp": {**COMMON, "SHARED_NFS": "10.0.0.2:/dist_nce", "GCP_PROJECT": "ml-research-4711",
            "GCP_REGION": "us-central1", "GCP_ZONE": "us-central1-a", "GCP_SUBNETWORK": "dist-nce",
            "GCP_HEAD_SERVICE_ACCOUNT": "dist-nce-head@ml-research-4711.iam.gserviceaccount.com",
            "GCP_WORKER_SERVICE_ACCOUNT": "dist-nce-worker@ml-research-4711.iam.gserviceaccount.com"},
}
PREREQ_ENV = {
    "aws": {"OPERATOR_CIDR": "10.8.0.0/24", "AWS_REGION": "us-east-1", "AWS_ACCOUNT_ID": "123456789012",
            "AWS_VPC_ID": "vpc-0123456789abcdef0", "DIST_NCE_BUCKET": "ml-runs"},
    "gcp": {"OPERATOR_CIDR": "10.8.0.0/24", "GCP_PROJECT": "ml-research-4711", "GCP_NETWORK": "dist-nce-vpc",
            "DIST_NCE_BUCKET": "ml-runs"},
}
CLOUDS = sorted(ENV)


def _render(cloud: str, **changes) -> dict:
    env = {k: v for k, v in {**ENV[cloud], **changes}.items() if v is not None}
    return yaml.safe_load(cluster_up.render(cloud, env))


def _nodes(config: dict) -> dict:
    return {name: t["node_config"] for name, t in config["available_node_types"].items()}


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_template_variable_is_checked_and_filled(cloud):
    template = cluster_up.TEMPLATES[cloud].read_text()
    used = set(cluster_up.PLACEHOLDER.findall(template))
    assert used == set(cluster_up.SETTINGS[cloud]), "template and settings table disagree"
    text = cluster_up.render(cloud, ENV[cloud])
    assert not cluster_up.PLACEHOLDER.search(text)
    config = yaml.safe_load(text)
    assert config["docker"]["image"] == IMAGE
    assert f"SHARED_NFS='{ENV[cloud]['SHARED_NFS']}';" in config["initialization_commands"][0]


@pytest.mark.parametrize("cloud", CLOUDS)
@pytest.mark.parametrize("name", ["SHARED_NFS", "DIST_NCE_IMAGE"])
def test_a_missing_setting_is_named_and_nothing_is_written(cloud, name, tmp_path, capsys):
    env = {k: v for k, v in ENV[cloud].items() if k != name}
    out = tmp_path / "cluster.yaml"
    assert cluster_up.main([cloud, "--out", str(out)], env=env) == 2
    assert f"{name} is not set" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("cloud,name,value,why", [
    ("aws", "OPERATOR_CIDR", "0.0.0.0/0", "opens SSH to 4294967296 addresses"),
    ("aws", "OPERATOR_CIDR", "10.0.0.0/8", "want /16 or narrower"),
    ("aws", "OPERATOR_CIDR", "10.8.0.1/24", "host bits set"),
    ("gcp", "OPERATOR_CIDR", "2001:db8::/64", "IPv4"),
    ("gcp", "OPERATOR_CIDR", "my-laptop", "CIDR"),
    ("aws", "SHARED_NFS", "fs.efs:/; rm -rf /", "HOST:/PATH"),
    ("gcp", "SHARED_NFS", "10.0.0.2:/x'y", "HOST:/PATH"),
    ("aws", "DIST_NCE_IMAGE", "rayproject/ray:2.60.0-py311-gpu", "project image"),
    ("gcp", "DIST_NCE_IMAGE", "ghcr.io/x/dist-nce:latest", "project image"),
    ("aws", "AWS_SUBNET_ID", "subnet-xyz", "subnet id"),
    ("aws", "AWS_SECURITY_GROUP_ID", "default", "security group id"),
    ("aws", "AWS_WORKER_INSTANCE_PROFILE_ARN", "arn:aws:iam::123456789012:instance-profile/dist-nce-head",
     "the same as the head's"),
    ("aws", "AWS_HEAD_INSTANCE_PROFILE_ARN", "arn:aws:iam::123456789012:role/admin", "instance profile ARN"),
    ("gcp", "GCP_ZONE", "europe-west4-a", "not a zone of GCP_REGION"),
    ("gcp", "GCP_HEAD_SERVICE_ACCOUNT", "123-compute@developer.gserviceaccount.com", "service account"),
])
def test_an_invalid_setting_is_refused_naming_it(cloud, name, value, why):
    with pytest.raises(cluster_up.SettingError) as e:
        if name in cluster_up.SETTINGS[cloud]:
            _render(cloud, **{name: value})
        else:
            cluster_up.prereqs(cloud, {**PREREQ_ENV[cloud], name: value})
    assert str(e.value).startswith(f"{name}={value}: ") and why in str(e.value), str(e.value)


def test_broad_ssh_needs_an_explicit_opt_in():
    (ssh, _) = [c for c in _prereq_commands("aws", OPERATOR_CIDR="0.0.0.0/0", DIST_NCE_ALLOW_BROAD_SSH="1")
                if "authorize-security-group-ingress" in c]
    assert "CidrIp=0.0.0.0/0" in ssh[ssh.index("--ip-permissions") + 1]


def test_a_tag_only_image_is_accepted_with_a_warning(capsys):
    tagged = IMAGE.split("@")[0]
    assert _render("aws", DIST_NCE_IMAGE=tagged)["docker"]["image"] == tagged
    assert "tag only" in capsys.readouterr().err


def test_main_writes_a_temporary_config_and_prints_ray_up(capsys):
    assert cluster_up.main(["gcp"], env=ENV["gcp"]) == 0
    out = capsys.readouterr().out.splitlines()
    command = shlex.split(out[-1])
    assert command[:2] == ["ray", "up"]
    rendered = Path(command[2])
    try:
        assert yaml.safe_load(rendered.read_text())["provider"]["project_id"] == "ml-research-4711"
    finally:
        rendered.unlink()


def test_aws_nodes_have_no_public_ip_the_given_group_and_separate_profiles():
    config = _render("aws")
    assert config["provider"]["use_internal_ips"] is True
    assert "security_group" not in config["provider"], "Ray would add SSH from 0.0.0.0/0 to a group it creates"
    profiles = {}
    for name, node in _nodes(config).items():
        (nic,) = node["NetworkInterfaces"]
        assert nic["AssociatePublicIpAddress"] is False, name
        assert nic["Groups"] == ["sg-0123456789abcdef0"] and nic["SubnetId"] == "subnet-0123456789abcdef0", name
        assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & node.keys(), name
        profiles[name] = node["IamInstanceProfile"]["Arn"]
    assert profiles == {"head": ENV["aws"]["AWS_HEAD_INSTANCE_PROFILE_ARN"],
                        "gpu_worker": ENV["aws"]["AWS_WORKER_INSTANCE_PROFILE_ARN"]}


def test_gcp_nodes_have_no_external_ip_the_firewall_tag_and_narrow_service_accounts():
    config = _render("gcp")
    assert config["provider"]["use_internal_ips"] is True
    accounts = {}
    for name, node in _nodes(config).items():
        (nic,) = node["networkInterfaces"]
        assert "accessConfigs" not in nic, f"{name}: an external IP"
        assert nic["subnetwork"] == "projects/ml-research-4711/regions/us-central1/subnetworks/dist-nce"
        assert node["tags"]["items"] == [cluster_up.NAME], name
        (account,) = node["serviceAccounts"]
        assert "https://www.googleapis.com/auth/cloud-platform" not in account["scopes"], name
        accounts[name] = account
    assert accounts["head"]["email"] != accounts["gpu_worker"]["email"]
    assert "https://www.googleapis.com/auth/compute" in accounts["head"]["scopes"]
    assert not any("compute" in s for s in accounts["gpu_worker"]["scopes"]), "workers start no instances"


def _statements(role: str, values: dict) -> list[dict]:
    return json.loads(cluster_up.substitute(cluster_up.AWS_POLICIES[role].read_text(), values))["Statement"]


def test_aws_policies_are_scoped():
    values = cluster_up.check(cluster_up.PREREQ_SETTINGS["aws"], PREREQ_ENV["aws"])
    for role in ("head", "worker"):
        for st in _statements(role, values):
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            assert st["Effect"] == "Allow" and not any(a.endswith("*") for a in actions), st
            if any(a.startswith("s3:") for a in actions):
                assert st["Resource"] in ("arn:aws:s3:::ml-runs", "arn:aws:s3:::ml-runs/dist-nce/*"), st
            if st["Resource"] == "*":
                assert set(actions) <= {"ecr:GetAuthorizationToken"} or "Condition" in st, st
    worker_actions = {a for st in _statements("worker", values)
                      for a in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])}
    assert not {a for a in worker_actions if a.startswith(("ec2:", "iam:"))}, "workers start nothing"
    head = _statements("head", values)
    (pass_role,) = [st for st in head if st["Action"] == "iam:PassRole"]
    assert pass_role["Resource"] == "arn:aws:iam::123456789012:role/dist-nce-worker"
    (terminate,) = [st for st in head if "ec2:TerminateInstances" in st["Action"]]
    assert terminate["Condition"] == {"StringEquals": {"ec2:ResourceTag/ray-cluster-name": "dist-nce"}}
    assert yaml.safe_load(cluster_up.TEMPLATES["aws"].read_text())["cluster_name"] == "dist-nce"


def _prereq_commands(cloud: str, **changes) -> list[list[str]]:
    script = cluster_up.prereqs(cloud, {**PREREQ_ENV[cloud], **changes})
    return [shlex.split(line) for line in script.splitlines() if line and not line.startswith(("#", "set "))]


def test_aws_setup_opens_ssh_to_the_operator_only():
    commands = _prereq_commands("aws")
    ingress = [c for c in commands if c[:3] == ["aws", "ec2", "authorize-security-group-ingress"]]
    rules = [c[c.index("--ip-permissions") + 1] for c in ingress]
    assert len(rules) == 2
    assert "FromPort=22,ToPort=22" in rules[0] and "CidrIp=10.8.0.0/24" in rules[0]
    assert "UserIdGroupPairs=[{GroupId=$sg}]" in rules[1] and "CidrIp" not in rules[1]
    assert not any("0.0.0.0/0" in " ".join(c) for c in commands)
    roles = [c[c.index("--role-name") + 1] for c in commands if c[:3] == ["aws", "iam", "put-role-policy"]]
    assert roles == ["dist-nce-head", "dist-nce-worker"]


def test_gcp_setup_opens_ssh_to_the_operator_only_and_refuses_the_default_network():
    commands = _prereq_commands("gcp")
    rules = {c[4]: c for c in commands if c[:4] == ["gcloud", "compute", "firewall-rules", "create"]}
    assert set(rules) == {"dist-nce-ssh", "dist-nce-internal"}
    ssh, internal = rules["dist-nce-ssh"], rules["dist-nce-internal"]
    assert ssh[ssh.index("--rules") + 1] == "tcp:22"
    assert ipaddress.ip_network(ssh[ssh.index("--source-ranges") + 1]) == ipaddress.ip_network("10.8.0.0/24")
    assert "--source-ranges" not in internal and internal[internal.index("--source-tags") + 1] == "dist-nce"
    for rule in rules.values():
        assert rule[rule.index("--target-tags") + 1] == "dist-nce" and rule[rule.index("--network") + 1] == "dist-nce-vpc"
    roles = {c[c.index("--role") + 1] for c in commands if "--role" in c}
    assert roles == {"roles/compute.instanceAdmin.v1", "roles/iam.serviceAccountUser", "roles/storage.objectUser",
                     "roles/artifactregistry.reader"}, "no owner/editor/admin roles"
    with pytest.raises(cluster_up.SettingError, match="GCP_NETWORK=default"):
        cluster_up.prereqs("gcp", {**PREREQ_ENV["gcp"], "GCP_NETWORK": "default"})

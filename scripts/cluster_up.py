#!/usr/bin/env python3
"""Render a Ray cluster launcher config of configs/cluster/ from the environment, then `ray up`.

configs/cluster/{aws,gcp}-gpu.yaml are templates: every site-specific value is a ${NAME} that
this script fills from the environment variable of that name, after checking it. A missing or invalid
value stops it with one line naming the variable; nothing is rendered half-way.

    scripts/cluster_up.py aws|gcp               # render to a temporary file, print `ray up FILE`
    scripts/cluster_up.py aws|gcp --out FILE    # render to FILE
    scripts/cluster_up.py aws|gcp --run         # render, then run `ray up FILE`
    scripts/cluster_up.py aws|gcp --prereqs     # print the one-time cloud commands (security
                                                # group or firewall rules, IAM), as a script

OPERATOR_CIDR (for --prereqs) is the one network SSH is opened to: the VPN or bastion range
`ray up` runs from (no node has a public address). Networks broader than /16 are refused unless
DIST_NCE_ALLOW_BROAD_SSH=1.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Mapping

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "configs" / "cluster"
TEMPLATES = {"aws": CLUSTER / "aws-gpu.yaml", "gcp": CLUSTER / "gcp-gpu.yaml"}
AWS_POLICIES = {"head": CLUSTER / "aws-iam" / "head-policy.json",
                "worker": CLUSTER / "aws-iam" / "worker-policy.json"}
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
BROADEST_SSH_PREFIX = 16
NAME = "dist-nce"  # cluster name, security group, roles, service accounts, firewall tag


class SettingError(ValueError):
    """One environment variable is missing or invalid; the message names it."""


def _version() -> str:
    return re.search(r'version="([^"]+)"', (REPO / "setup.py").read_text()).group(1)


def _pattern(regex: str, what: str) -> Callable[[str, Mapping[str, str]], str]:
    def check(value: str, env: Mapping[str, str]) -> str:
        if not re.fullmatch(regex, value):
            raise ValueError(f"want {what}")
        return value
    return check


def _cidr(value: str, env: Mapping[str, str]) -> str:
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError as e:
        raise ValueError(f"not a network in CIDR form ({e})") from None
    if net.version != 4:
        raise ValueError("want an IPv4 network (the security rules here are IPv4)")
    if net.prefixlen < BROADEST_SSH_PREFIX and env.get("DIST_NCE_ALLOW_BROAD_SSH") != "1":
        raise ValueError(f"opens SSH to {net.num_addresses} addresses; want /{BROADEST_SSH_PREFIX} or "
                         "narrower (your VPN or bastion range), or set DIST_NCE_ALLOW_BROAD_SSH=1")
    return str(net)


def _image(value: str, env: Mapping[str, str]) -> str:
    tag = f"{NAME}:{_version()}"
    if not re.fullmatch(r"(?:[A-Za-z0-9.\-]+(?::\d+)?/)*" + re.escape(tag) + r"(?:@sha256:[0-9a-f]{64})?", value):
        raise ValueError(f"want the pushed project image, <registry>/{tag}@sha256:<digest>")
    if "@sha256:" not in value:
        print(f"scripts/cluster_up.py: DIST_NCE_IMAGE={value} is a tag only; nodes started after it is "
              "pushed again would run another image (append @sha256:<digest>)", file=sys.stderr)
    return value


_profile = _pattern(r"arn:aws[a-z\-]*:iam::\d{12}:instance-profile/[\w+=,.@/\-]+", "an instance profile ARN")


def _worker_profile(value: str, env: Mapping[str, str]) -> str:
    _profile(value, env)
    if value == env.get("AWS_HEAD_INSTANCE_PROFILE_ARN"):
        raise ValueError("the same as the head's; the workers need their own (only the head may start instances)")
    return value


def _zone(value: str, env: Mapping[str, str]) -> str:
    _pattern(r"[a-z]+-[a-z]+\d+-[a-z]", "a zone such as us-central1-a")(value, env)
    if not value.startswith(env.get("GCP_REGION", "") + "-"):
        raise ValueError(f"not a zone of GCP_REGION={env.get('GCP_REGION')}")
    return value


_SA = r"[a-z][a-z0-9\-]{4,28}[a-z0-9]@[a-z][a-z0-9\-]{4,28}[a-z0-9]\.iam\.gserviceaccount\.com"
# OPERATOR_CIDR is not among these: the rendered config names the security group (AWS) or the
# network tag (GCP) whose rules `--prereqs` creates from it; Ray cannot restrict SSH itself.
COMMON = {
    # Goes into a shell command on every node: a host and an absolute path, nothing else.
    "SHARED_NFS": _pattern(r"[A-Za-z0-9][A-Za-z0-9.\-]*:/[A-Za-z0-9._/\-]*", "HOST:/PATH of the NFS export"),
    "DIST_NCE_IMAGE": _image,
}
SETTINGS: dict[str, dict[str, Callable[[str, Mapping[str, str]], str]]] = {
    "aws": {
        **COMMON,
        "AWS_REGION": _pattern(r"[a-z]{2}(?:-[a-z]+)+-\d", "a region such as us-east-1"),
        "AWS_SUBNET_ID": _pattern(r"subnet-[0-9a-f]{8,17}", "a subnet id (subnet-...)"),
        "AWS_SECURITY_GROUP_ID": _pattern(r"sg-[0-9a-f]{8,17}", "a security group id (sg-...)"),
        "AWS_HEAD_INSTANCE_PROFILE_ARN": _profile,
        "AWS_WORKER_INSTANCE_PROFILE_ARN": _worker_profile,
    },
    "gcp": {
        **COMMON,
        "GCP_PROJECT": _pattern(r"[a-z][a-z0-9\-]{4,28}[a-z0-9]", "a project id"),
        "GCP_REGION": _pattern(r"[a-z]+-[a-z]+\d+", "a region such as us-central1"),
        "GCP_ZONE": _zone,
        "GCP_SUBNETWORK": _pattern(r"[a-z](?:[a-z0-9\-]{0,61}[a-z0-9])?", "a subnetwork name"),
        "GCP_HEAD_SERVICE_ACCOUNT": _pattern(_SA, "a service account email"),
        "GCP_WORKER_SERVICE_ACCOUNT": _pattern(_SA, "a service account email"),
    },
}
PREREQ_SETTINGS: dict[str, dict[str, Callable[[str, Mapping[str, str]], str]]] = {
    "aws": {
        "OPERATOR_CIDR": _cidr,
        "AWS_REGION": SETTINGS["aws"]["AWS_REGION"],
        "AWS_ACCOUNT_ID": _pattern(r"\d{12}", "a 12-digit account id"),
        "AWS_VPC_ID": _pattern(r"vpc-[0-9a-f]{8,17}", "a VPC id (vpc-...)"),
        "DIST_NCE_BUCKET": _pattern(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", "a bucket name"),
    },
    "gcp": {
        "OPERATOR_CIDR": _cidr,
        "GCP_PROJECT": SETTINGS["gcp"]["GCP_PROJECT"],
        "GCP_NETWORK": _pattern(r"(?!default$)[a-z](?:[a-z0-9\-]{0,61}[a-z0-9])?",
                                "a dedicated network's name (the default network's rules open SSH to everyone)"),
        "DIST_NCE_BUCKET": _pattern(r"[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9]", "a bucket name"),
    },
}


def check(settings: Mapping[str, Callable[[str, Mapping[str, str]], str]], env: Mapping[str, str]) -> dict[str, str]:
    """The checked values; SettingError on the first one missing or invalid."""
    out = {}
    for name, validate in settings.items():
        value = env.get(name, "").strip()
        if not value:
            raise SettingError(f"{name} is not set")
        try:
            out[name] = validate(value, env)
        except ValueError as e:
            raise SettingError(f"{name}={value}: {e}") from None
    return out


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Every ${NAME} of text replaced; a name without a value is an error (the template and the
    settings table disagree), so nothing half-rendered comes out."""
    unknown = sorted(set(PLACEHOLDER.findall(text)) - set(values))
    if unknown:
        raise SettingError(f"the template uses {', '.join(unknown)}, which this script does not set")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render(cloud: str, env: Mapping[str, str]) -> str:
    return substitute(TEMPLATES[cloud].read_text(), check(SETTINGS[cloud], env))


def _aws_prereqs(v: Mapping[str, str]) -> list[str]:
    q = shlex.quote
    region = f"--region {q(v['AWS_REGION'])}"
    ssh = f"IpProtocol=tcp,FromPort=22,ToPort=22,IpRanges=[{{CidrIp={v['OPERATOR_CIDR']},Description=operator SSH}}]"
    trust = json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]})
    lines = [
        "# Security group: SSH only from OPERATOR_CIDR, everything else only between members.",
        f"sg=$(aws ec2 create-security-group {region} --vpc-id {q(v['AWS_VPC_ID'])} --group-name {NAME} "
        f"--description 'dist-nce Ray cluster' --query GroupId --output text)",
        f"aws ec2 authorize-security-group-ingress {region} --group-id \"$sg\" --ip-permissions {q(ssh)}",
        f"aws ec2 authorize-security-group-ingress {region} --group-id \"$sg\" "
        "--ip-permissions \"IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]\"",
        'echo "export AWS_SECURITY_GROUP_ID=$sg"',
        "# Roles and instance profiles: the head starts this cluster's workers, the workers only",
        f"# use s3://{v['DIST_NCE_BUCKET']}/dist-nce/ and pull the image (configs/cluster/aws-iam/).",
    ]
    for role, path in AWS_POLICIES.items():
        name = f"{NAME}-{role}"
        policy = json.dumps(json.loads(substitute(path.read_text(), v)), separators=(",", ":"))
        lines += [
            f"aws iam create-role --role-name {name} --assume-role-policy-document {q(trust)}",
            f"aws iam put-role-policy --role-name {name} --policy-name {name} --policy-document {q(policy)}",
            f"aws iam create-instance-profile --instance-profile-name {name}",
            f"aws iam add-role-to-instance-profile --instance-profile-name {name} --role-name {name}",
            f"echo \"export AWS_{role.upper()}_INSTANCE_PROFILE_ARN="
            f"arn:aws:iam::{v['AWS_ACCOUNT_ID']}:instance-profile/{name}\"",
        ]
    return lines


def _gcp_prereqs(v: Mapping[str, str]) -> list[str]:
    q = shlex.quote
    project, network = q(v["GCP_PROJECT"]), q(v["GCP_NETWORK"])
    head, worker = (f"{NAME}-{r}@{v['GCP_PROJECT']}.iam.gserviceaccount.com" for r in ("head", "worker"))
    bucket = q(f"gs://{v['DIST_NCE_BUCKET']}")
    rule = f"--project {project} --network {network} --direction INGRESS --action ALLOW"
    return [
        "# Firewall: SSH to the nodes' tag only from OPERATOR_CIDR, everything else only between them.",
        f"gcloud compute firewall-rules create {NAME}-ssh {rule} --rules tcp:22 "
        f"--source-ranges {q(v['OPERATOR_CIDR'])} --target-tags {NAME}",
        f"gcloud compute firewall-rules create {NAME}-internal {rule} --rules tcp,udp,icmp "
        f"--source-tags {NAME} --target-tags {NAME}",
        "# Service accounts: the head manages instances and may run them as the worker account; both",
        "# use the bucket and pull the image, nothing else.",
        f"gcloud iam service-accounts create {NAME}-head --project {project}",
        f"gcloud iam service-accounts create {NAME}-worker --project {project}",
        f"gcloud projects add-iam-policy-binding {project} --member serviceAccount:{head} "
        "--role roles/compute.instanceAdmin.v1 --condition None",
        f"gcloud iam service-accounts add-iam-policy-binding {worker} --project {project} "
        f"--member serviceAccount:{head} --role roles/iam.serviceAccountUser",
        *(f"gcloud storage buckets add-iam-policy-binding {bucket} --member serviceAccount:{sa} "
          "--role roles/storage.objectUser" for sa in (head, worker)),
        *(f"gcloud projects add-iam-policy-binding {project} --member serviceAccount:{sa} "
          "--role roles/artifactregistry.reader --condition None" for sa in (head, worker)),
        f'echo "export GCP_HEAD_SERVICE_ACCOUNT={head} GCP_WORKER_SERVICE_ACCOUNT={worker}"',
    ]


def prereqs(cloud: str, env: Mapping[str, str]) -> str:
    values = check(PREREQ_SETTINGS[cloud], env)
    body = (_aws_prereqs if cloud == "aws" else _gcp_prereqs)(values)
    return "\n".join(["#!/usr/bin/env bash", f"# One-time {cloud} setup for configs/cluster/{cloud}-gpu.yaml "
                      "(scripts/cluster_up.py --prereqs). Review, then run.", "set -euo pipefail", *body]) + "\n"


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster_up.py", description=__doc__.split("\n")[0])
    parser.add_argument("cloud", choices=sorted(TEMPLATES))
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--run", action="store_true", help="run `ray up` on the rendered config")
    what.add_argument("--prereqs", action="store_true", help="print the one-time cloud setup commands")
    parser.add_argument("--out", type=Path, help="where to write the rendered config (default: a temporary file)")
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    try:
        if args.prereqs:
            sys.stdout.write(prereqs(args.cloud, env))
            return 0
        text = render(args.cloud, env)
    except SettingError as e:
        print(f"scripts/cluster_up.py: {e}", file=sys.stderr)
        return 2
    if args.out:
        out = args.out
        out.write_text(text)
    else:
        fd, name = tempfile.mkstemp(prefix=f"{NAME}-{args.cloud}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        out = Path(name)
    command = ["ray", "up", str(out)]
    print(f"rendered configs/cluster/{args.cloud}-gpu.yaml -> {out}\n{shlex.join(command)}")
    if args.run:
        # From the checkout: file_mounts sync "." (this repository) to the nodes.
        return subprocess.run(command, cwd=REPO).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())

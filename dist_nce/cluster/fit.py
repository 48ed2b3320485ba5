"""Refuse a run whose actors the Ray cluster cannot hold, before any encoding starts.

Shard actors and Ray Train workers live side by side for the whole run, so the run
needs the SUM of their requests at once. When that sum exceeds the cluster, Ray does
not fail: the shards encode the KB, then Ray Train waits for a worker group that can
never be placed and times out a minute later. :func:`check_fits` compares the sum with
``ray.cluster_resources()`` right after Ray starts and names every resource that does
not fit, with the arithmetic and the config keys to change.

It checks totals over the cluster. A request that fits the total but no single node
(one worker asking for 4 GPUs on a cluster of 2-GPU nodes) still waits in Ray; the
Train controller itself takes no resources (Ray Train V2).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from dist_nce.core.config import ConfigError

_EPS = 1e-9


class DoesNotFit(ConfigError):
    """The configured actors need more of a resource than the cluster has."""


class Request(NamedTuple):
    """``count`` actors of one kind, each needing ``each`` (resource -> amount); ``keys``
    names the config field behind each resource, for the message."""

    what: str
    count: int
    each: Mapping[str, float]
    keys: Mapping[str, str]


def _num(x: float) -> str:
    return f"{x:g}"


def check_fits(requests: Sequence[Request], cluster_resources: Mapping[str, float]) -> None:
    """Raise :class:`DoesNotFit` listing each resource whose total request exceeds the cluster's."""
    need: dict[str, list[tuple[Request, float]]] = {}
    for r in requests:
        for resource, amount in r.each.items():
            if amount > 0 and r.count > 0:
                need.setdefault(resource, []).append((r, amount))
    problems = []
    for resource, parts in need.items():
        total = sum(r.count * amount for r, amount in parts)
        have = float(cluster_resources.get(resource, 0.0))
        if total > have + _EPS:
            terms = " + ".join(f"{r.count} {r.what} x {_num(amount)} ({r.keys.get(resource, 'resources')})"
                               for r, amount in parts)
            problems.append(f"{resource}: {terms} = {_num(total)} > {_num(have)} in the cluster")
    if problems:
        raise DoesNotFit("the Ray cluster cannot hold this run's actors at once:\n  " + "\n  ".join(problems)
                         + "\n  lower these settings, or run on a cluster with more of these resources")


class ShardRequest(Protocol):
    """What the service config (``dist_nce.actors.config.ServiceConfig``) asks Ray for."""

    num_shards: int
    num_cpus: float
    num_gpus: float
    resources: Mapping[str, float]


def service_request(service: ShardRequest) -> Request:
    """The shard actors of a ``ServiceConfig`` (all of them live for the whole run)."""
    each = {"CPU": service.num_cpus, "GPU": service.num_gpus, **service.resources}
    keys = {"CPU": "service.num_cpus", "GPU": "service.num_gpus",
            **{k: f"service.resources.{k}" for k in service.resources}}
    return Request("shards", service.num_shards, each, keys)


def worker_resources(run: Any, gpu: bool) -> dict[str, float]:
    """What one training worker asks Ray for (``run``: a WorkerRunConfig): CPUs, GPUs on a GPU
    run, custom resources (``run.resources_per_worker``, e.g. {trainer: 1} for trainer nodes)."""
    return {"CPU": run.cpus_per_worker, **({"GPU": run.gpus_per_worker} if gpu else {}),
            **run.resources_per_worker}


def workers_request(run: Any, gpu: bool) -> Request:
    """The Ray Train workers of a run config (``gpu``: whether they are given GPUs)."""
    each = worker_resources(run, gpu)  # exactly what the TorchTrainer will ask for
    keys = {"CPU": "run.cpus_per_worker", "GPU": "run.gpus_per_worker",
            **{k: f"run.resources_per_worker.{k}" for k in run.resources_per_worker}}
    return Request("training workers", run.num_workers, each, keys)

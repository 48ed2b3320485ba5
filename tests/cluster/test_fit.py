"""dist_nce.cluster.fit: a run the cluster cannot hold is refused with the arithmetic."""
from __future__ import annotations

import pytest

from dist_nce.cluster.fit import DoesNotFit, Request, check_fits, service_request, workers_request
from dist_nce.core.config import ConfigError, from_dict
from dist_nce.train.config import TrainJobConfig


def _cfg(**sections) -> TrainJobConfig:
    return from_dict(TrainJobConfig, sections)


def test_fits_exactly():
    cfg = _cfg(service={"num_shards": 2, "num_cpus": 0.5}, run={"num_workers": 1, "cpus_per_worker": 1.0})
    check_fits([service_request(cfg.service), workers_request(cfg.run, gpu=False)], {"CPU": 2.0, "memory": 1e9})


def test_one_cpu_cluster_is_refused_with_the_arithmetic():
    cfg = _cfg(service={"num_shards": 2, "num_cpus": 0.5}, run={"num_workers": 1, "cpus_per_worker": 1.0})
    with pytest.raises(DoesNotFit) as e:
        check_fits([service_request(cfg.service), workers_request(cfg.run, gpu=False)], {"CPU": 1.0})
    assert isinstance(e.value, ConfigError)
    assert ("CPU: 2 shards x 0.5 (service.num_cpus) + 1 training workers x 1 (run.cpus_per_worker) = 2 > 1 "
            "in the cluster") in str(e.value)


def test_gpus_and_custom_resources_are_counted_and_each_excess_named():
    cfg = _cfg(service={"num_shards": 4, "num_cpus": 0.25, "num_gpus": 0.5, "resources": {"kb_shard": 1}},
               run={"num_workers": 2, "cpus_per_worker": 1, "gpus_per_worker": 1,
                    "resources_per_worker": {"trainer": 1}})
    reqs = [service_request(cfg.service), workers_request(cfg.run, gpu=True)]
    check_fits(reqs, {"CPU": 3, "GPU": 4, "kb_shard": 4, "trainer": 2})
    with pytest.raises(DoesNotFit) as e:
        check_fits(reqs, {"CPU": 8, "GPU": 3, "kb_shard": 2})
    lines = str(e.value).splitlines()
    assert "  GPU: 4 shards x 0.5 (service.num_gpus) + 2 training workers x 1 (run.gpus_per_worker) = 4 > 3 in the " \
           "cluster" in lines
    assert "  kb_shard: 4 shards x 1 (service.resources.kb_shard) = 4 > 2 in the cluster" in lines
    assert "  trainer: 2 training workers x 1 (run.resources_per_worker.trainer) = 2 > 0 in the cluster" in lines
    assert not any(line.startswith("  CPU") for line in lines)


def test_workers_without_gpu_ask_for_none():
    cfg = _cfg(run={"num_workers": 2, "cpus_per_worker": 0.5, "gpus_per_worker": 1})
    check_fits([workers_request(cfg.run, gpu=False)], {"CPU": 1})


def test_zero_requests_and_plain_requests():
    check_fits([Request("things", 0, {"CPU": 5}, {}), Request("others", 3, {"CPU": 0}, {})], {})
    with pytest.raises(DoesNotFit, match=r"CPU: 3 things x 0.5 \(resources\) = 1.5 > 1 in the cluster"):
        check_fits([Request("things", 3, {"CPU": 0.5}, {})], {"CPU": 1})

"""The live bias monitor against real shards (2 EntityShard actors on a local Ray).

The shards' merged d/dq LSE equals the flat in-process computation over the persisted
embeddings; the monitor's estimate is finite with a positive standard error; and on a model
whose softmax is peaked on the gold (what training does to its training mentions) hard
negatives bias the gradient less than random ones, by more than the standard errors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.bias.gradbias import lse_grad_all, lse_grad_rows
from dist_nce.bias.monitor import BiasMonitor
from dist_nce.modeling.scoring import Reps
from dist_nce.train.plan import sampling
from tests.train.tinyrun import prepare_tiny, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(ray_local, tmp_path_factory, tiny_model_dir):
    import ray

    from dist_nce.actors.service import NegativeService
    from dist_nce.index.versions import PersistedVersions, shard_dir_name
    from dist_nce.train.model import build_retriever

    root = tmp_path_factory.mktemp("bias_kb")
    prepare_tiny(root, tiny_model_dir)
    cfg = tiny_config(root, tiny_model_dir, root / "run", "service.index.backend=torch")
    service = NegativeService.create(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, cfg.run.output_dir)
    service.ensure_encoded(ray.put(build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state()))
    shards = root / "run" / "out" / "shards"
    vecs = torch.cat([PersistedVersions(shards / shard_dir_name(i, 2), {}).load(0)[0].vecs for i in range(2)])
    yield service, cfg, vecs.float()
    service.shutdown()


def test_sharded_lse_gradients_equal_the_flat_ones(served):
    service, cfg, vecs = served
    spec = cfg.model.retriever.spec()
    q = torch.randn(4, vecs.shape[1], generator=torch.Generator().manual_seed(0))
    full = service.lse_grad(q).result()
    ref = lse_grad_all(spec, Reps(q), Reps(vecs), dtype=torch.float64)
    assert full.version == 0
    torch.testing.assert_close(full.lse, ref.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full.grad, ref.grad, rtol=1e-4, atol=1e-5)
    rows = torch.tensor([[[0, 199, 200, 399]], [[5, 6, 7, 8]], [[210, 220, 230, 240]], [[1, 300, 2, 301]]])
    sets = service.lse_grad(q, rows=rows, version=0).result()
    ref = lse_grad_rows(spec, Reps(q), Reps(vecs), rows, dtype=torch.float64)
    torch.testing.assert_close(sets.lse, ref.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sets.grad, ref.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rows must be in"):
        service.lse_grad(q, rows=rows + 400)


def monitor(service, cfg, vecs, mode: str, gold: torch.Tensor, draws: int = 64) -> dict[str, float]:
    """The monitor on a model that ranks each probe mention's gold first with a clear margin:
    q = margin * d / |d|^2 with d = f_gold - mean f scores the gold ``margin`` above the KB's mean
    (the random tiny BERT's entity vectors are nearly parallel, so the direction must be d)."""
    d = vecs[gold] - vecs.mean(dim=0)
    reps = Reps(8.0 * d / d.pow(2).sum(dim=1, keepdim=True))
    probe = np.arange(len(gold))
    s = sampling(mode, 50.0, cfg.negatives.num_candidates)
    return BiasMonitor(service, s, lambda idx: Reps(reps.vecs[idx]), probe, gold, draws, seed=0).measure(step=7)


def test_hard_negatives_bias_the_gradient_less_than_random_ones_on_a_peaked_model(served):
    service, cfg, vecs = served
    gold = torch.tensor([3, 77, 150, 260, 333, 390])
    out = {mode: monitor(service, cfg, vecs, mode, gold) for mode in ("random", "mixed", "hard")}
    for mode, m in out.items():
        assert np.isfinite(m["bias/norm"]) and m["bias/norm_se"] > 0 and m["bias/version"] == 0, (mode, m)
        assert m["bias/seconds"] > 0
    # Appendix C's ordering, clear of the standard errors: random > mixed > hard
    gap = lambda a, b: out[a]["bias/norm"] - out[b]["bias/norm"] - 3 * (  # noqa: E731
        out[a]["bias/norm_se"] + out[b]["bias/norm_se"])
    assert gap("random", "mixed") > 0 and gap("mixed", "hard") > 0, out

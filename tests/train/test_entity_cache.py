"""model.entity_cache: a frozen entity tower's reps encoded once, against re-encoding every step.

The reference is the plain path: the training step re-encodes its B x K candidates. With a
dropout-free model (the tiny BERT) and a frozen entity tower both paths must give the same scores,
so the same losses and the same trained weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.core.config import load_config
from dist_nce.modeling.retriever import Retriever, RetrieverConfig
from dist_nce.modeling.scoring import Reps
from dist_nce.train.config import TrainJobConfig
from dist_nce.train.entity_cache import FrozenEntityCache, gather_reps
from dist_nce.train.loop import Worker
from tests.train.local_service import LocalService
from tests.train.tinyrun import TEST_CONFIG, tiny_config

FROZEN = ("model.freeze_entity_encoder=true", "refresh.mode=never", "run.num_workers=1", "run.export=false",
          "run.evaluate_before=false", "deepspeed.config=configs/deepspeed/zero0_fp32.json",
          "optim.max_steps=4", "run.checkpoint_every_steps=0")


def test_gather_reps_takes_rows_of_vecs_and_mask():
    vecs, mask = torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 3, 2), torch.rand(5, 3) > 0.5
    rows = torch.tensor([[4, 0], [2, 2]])
    got = gather_reps(Reps(vecs, mask), rows)
    assert got.vecs.shape == (2, 2, 3, 2) and got.mask.shape == (2, 2, 3)
    assert torch.equal(got.vecs[0, 0], vecs[4]) and torch.equal(got.mask[1, 1], mask[2])
    assert gather_reps(Reps(vecs[:, 0]), rows).mask is None


class _Store:
    """What encode_rows reads of an EntityStore: random token ids with ragged lengths."""

    def __init__(self, n: int, max_len: int, seed: int):
        rng = np.random.default_rng(seed)
        self.num_entities, self.max_len = n, max_len
        self._lengths = rng.integers(3, max_len + 1, n).astype(np.int32)
        self._ids = rng.integers(1000, 2000, (n, max_len)).astype(np.int32)
        self._ids[:, 0] = 101  # [CLS]
        for i, n_real in enumerate(self._lengths):
            self._ids[i, n_real:] = 0

    def lengths(self, rows):
        return self._lengths[rows]

    def token_ids(self, rows):
        return self._ids[rows]


@pytest.mark.parametrize("preset,m", [("dual", None), ("multi", 3), ("som", None)])
def test_cached_candidates_score_as_the_entity_tower_does(tiny_model_dir, preset, m):
    torch.manual_seed(0)
    model = Retriever.build(RetrieverConfig(preset=preset, m=m, mention_model=tiny_model_dir, storage_dtype="float32"))
    model.train()  # as inside the engine: the cache must still encode in eval mode and leave the mode alone
    store = _Store(20, 12, seed=1)
    cache = FrozenEntityCache(model.entity_side, batch_size=7, device="cpu")
    rows = torch.tensor([[3, 0, 19, 3], [5, 11, 2, 8]])
    mention_ids = torch.randint(1000, 2000, (2, 9))
    mention_ids[:, 0] = 101
    mention_mask = torch.ones_like(mention_ids, dtype=torch.bool)
    with torch.no_grad():
        cached = model(mention_ids, mention_mask, cand_reps=cache.candidates(store, rows))
        model.eval()
        ids = torch.from_numpy(store.token_ids(rows.numpy())).long()
        mask = torch.arange(ids.shape[-1]) < torch.from_numpy(store.lengths(rows.numpy()))[..., None]
        plain = model(mention_ids, mention_mask, ids, mask)
    assert model.entity_side.training is False and cache.side is model.entity_side
    torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-5)
    assert cache.encodes == 1
    cache.candidates(store, rows)
    assert cache.encodes == 1, "the same store is encoded once"
    cache.candidates(_Store(20, 12, seed=2), rows)
    assert cache.encodes == 2, "a new store (a followed KB version) is encoded again"


def test_forward_rejects_cand_reps_of_another_batch(tiny_model_dir):
    model = Retriever.build(RetrieverConfig(mention_model=tiny_model_dir, storage_dtype="float32"))
    ids = torch.randint(1000, 2000, (2, 5))
    with pytest.raises(ValueError, match=r"cand_reps.vecs \[B, K, \.\.\.\] with B=2"):
        model(ids, torch.ones_like(ids, dtype=torch.bool), cand_reps=Reps(torch.zeros(3, 4, 32)))
    with pytest.raises(ValueError, match=r"cand_ids \[B, K, L\] with B=2, got None"):
        model(ids, torch.ones_like(ids, dtype=torch.bool))


def test_config_needs_a_frozen_entity_tower():
    with pytest.raises(ValueError, match="model.entity_cache needs model.freeze_entity_encoder"):
        load_config(TrainJobConfig, TEST_CONFIG, ["model.entity_cache=true"])


@pytest.fixture(scope="module")
def process_group(dist_env):
    # left in place afterwards, as DeepSpeed leaves its own (see tests/train/test_learning.py)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield


class _Run(Worker):
    """A training worker that keeps its final weights and writes no checkpoints."""

    def save_checkpoint(self, metrics, suffix: str = "") -> None:
        pass

    def finish(self):
        out = super().finish()
        out["weights"] = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        out["losses"] = list(self.losses)
        return out

    def train_step(self, step: int):
        metrics = super().train_step(step)
        self.losses = [*getattr(self, "losses", []), metrics["train/loss"]]
        return metrics


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dual", "som"])
def test_training_with_the_cache_equals_re_encoding(tmp_path, tiny_model_dir, process_group, preset):
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever

    backend = "torch" if preset == "som" else "flat"  # SOM is not an inner product: exact torch search
    sets = (*FROZEN, f"model.retriever.preset={preset}", f"service.index.backend={backend}")
    base = tiny_config(tmp_path, tiny_model_dir, tmp_path / "prep", *sets)
    ensure_prepared(base.data, tiny_model_dir, log=lambda s: None)
    service = LocalService(base.data.prepared_dir, base.model.retriever, base.service, str(tmp_path / "shards"),
                           build_retriever(base.model, base.optim.seed).entity_encoder_state())
    outs = {}
    for cache in (False, True):
        cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / f"cache_{cache}", *sets, f"model.entity_cache={cache}")
        outs[cache] = _Run(cfg, service, 0, 1, "cpu").run()
    plain, cached = outs[False], outs[True]
    assert plain["done"] and cached["done"] and len(plain["losses"]) == 4
    np.testing.assert_allclose(cached["losses"], plain["losses"], rtol=1e-4, atol=1e-5)
    for name, w in plain["weights"].items():
        torch.testing.assert_close(cached["weights"][name], w, rtol=1e-4, atol=1e-5, msg=name)
    start = build_retriever(base.model, base.optim.seed).state_dict()
    moved = [n for n, w in plain["weights"].items() if not torch.equal(w, start[n])]
    assert moved and all(not n.startswith("entity_side") for n in moved), moved  # trained, tower frozen

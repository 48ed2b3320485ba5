"""Exact save/restore: DeepSpeed engine (weights_only loads), RNG, loop state."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.train import checkpoint
from dist_nce.train.pipeline import EpochNegatives
from dist_nce.train.refresh import RefreshBook
from dist_nce.worker.engine import build_engine, load_deepspeed_config

DS_DIR = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
PLAN = {"num_workers": 1, "per_worker_batch": 4, "global_batch": 4, "steps_per_epoch": 3, "total_steps": 6,
        "train_mentions": 12, "num_candidates": 8, "n_hard": 4, "n_random": 3, "seed": 0, "data_fingerprint": "aa"}


def draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_round_trip():
    state = checkpoint.capture_rng()
    first = draws()
    draws()
    checkpoint.restore_rng(state)
    assert draws() == first


def test_train_state_json_round_trip():
    book = RefreshBook()
    book.record(3, 40)
    s = checkpoint.TrainState(step=41, book=book, dev_before={"accuracy": 0.5}, kb_version=1, index_version=4,
                              followed=[[1, 4], [0, 3]])
    assert checkpoint.TrainState.from_json(json.loads(json.dumps(s.to_json()))) == s
    # a checkpoint written before the per-rank record: none (its rerun follows the served KB, as it did)
    old = {k: v for k, v in s.to_json().items() if k != "followed"}
    assert checkpoint.TrainState.from_json(old).followed == []


def engine(cfg_name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ds = load_deepspeed_config(DS_DIR / cfg_name, micro_batch=4, world_size=1, grad_clip=1.0)
    eng, _, _ = build_engine(model, ds, lr=1e-2, weight_decay=0.01, total_steps=6, warmup_proportion=0.3,
                             dist_init_required=True)
    checkpoint.install_weights_only_loading(eng)
    return eng


def steps(eng, n, start):
    losses = []
    for t in range(start, start + n):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        dtype = torch.bfloat16 if eng.bfloat16_enabled() else torch.float32
        # dropout-like noise from the global RNG: restored RNG must reproduce it
        loss = torch.nn.functional.cross_entropy(eng(x.to(dtype) + 0.01 * torch.randn(4, 6).to(dtype)).float(), y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("cfg_name", ["zero0_fp32.json", "zero2_fp32.json", "zero2_bf16.json"])
def test_resume_continues_exactly_and_loads_weights_only(tmp_path, dist_env, cfg_name):
    eng = engine(cfg_name)
    steps(eng, 3, 0)
    neg = EpochNegatives(torch.arange(6).view(1, 2, 3), torch.zeros(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool),
                         torch.tensor([2]), epoch=1)
    state = checkpoint.TrainState(step=3, book=RefreshBook(2, {0: 0, 1: 1, 2: 3}))
    checkpoint.save(eng, tmp_path, state, rank=0, plan=PLAN, epoch_negatives=neg)
    straight = steps(eng, 3, 3)

    fresh = engine(cfg_name)
    steps(fresh, 1, 99)  # move weights, optimizer, scheduler and RNG away from the checkpoint
    got, got_neg = checkpoint.load(fresh, tmp_path, rank=0, plan=PLAN)
    assert got == state and got_neg.epoch == 1 and torch.equal(got_neg.ids, neg.ids)
    assert steps(fresh, 3, 3) == straight  # bit-identical continuation (optimizer, LR schedule, RNG)

    pickles = list(tmp_path.rglob("*.pt"))
    assert pickles
    for f in pickles:  # every DeepSpeed file loads without arbitrary unpickling
        checkpoint.weights_only_load(f, map_location="cpu")


def test_resume_refuses_another_plan(tmp_path):
    from dist_nce.core.artifacts import read_manifest, write_manifest
    from dist_nce.worker import checkpoint as base  # the resume check every worker's checkpoint makes

    write_manifest(tmp_path, checkpoint.KIND, checkpoint.SCHEMA_VERSION, step=3, plan=PLAN, deepspeed_tag="step3")
    manifest = read_manifest(tmp_path)
    with pytest.raises(ValueError, match="global_batch: checkpoint 4, now 8"):
        base.check_resumable(manifest, {**PLAN, "global_batch": 8}, str(tmp_path))
    # The same shapes over a store prepared again (other synthetic data, say) is another run.
    with pytest.raises(ValueError, match="data_fingerprint: checkpoint 'aa', now 'bb'"):
        base.check_resumable(manifest, {**PLAN, "data_fingerprint": "bb"}, str(tmp_path))
    # the settings the trainer records (train.plan.RESUME_SETTINGS), each difference named; one the checkpoint
    # lacks (written before a later version recorded it) is not compared
    settings = {"optim.lr": 5e-4, "model.retriever.preset": "dual"}
    manifest = {**manifest, "plan": {**PLAN, "settings": settings}}
    base.check_resumable(manifest, {**PLAN, "settings": settings}, str(tmp_path))
    with pytest.raises(ValueError, match=r"optim.lr: checkpoint 0.0005, now 0.01\); use another run.name"):
        base.check_resumable(manifest, {**PLAN, "settings": {**settings, "optim.lr": 0.01}}, str(tmp_path))
    base.check_resumable(manifest, {**PLAN, "settings": {**settings, "negatives.temperature": 0.5}}, "x")
    # one the checkpoint recorded and the rerun does not (a later version dropped it) still counts
    with pytest.raises(ValueError, match="model.retriever.preset: checkpoint 'dual', now None"):
        base.check_resumable(manifest, {**PLAN, "settings": {"optim.lr": 5e-4}}, "x")
    # a checkpoint from before settings were recorded resumes on the plan's fields alone
    base.check_resumable({**manifest, "plan": PLAN}, {**PLAN, "settings": settings}, str(tmp_path))

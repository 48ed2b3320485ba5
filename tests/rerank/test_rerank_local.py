"""``run.backend: local``: the reranker worker on a plain torch engine takes the steps the
DeepSpeed worker takes (fp32, CPU), and the job runs it where Ray and DeepSpeed cannot be imported.

The data is tests/rerank/test_rerank_data.py's (synthetic Zeshel, the random tiny BERT).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_nce.rerank.loop import LocalRerankWorker, RerankWorker
from dist_nce.worker.tb import read_metrics
from tests.rerank.test_rerank_data import config, setup  # noqa: F401  (setup: a fixture)

REPO = Path(__file__).resolve().parents[2]


def small_config(root, model_dir, out):
    cfg = config(root)
    cfg.model.reranker.model, cfg.model.reranker.head, cfg.model.reranker.dropout = model_dir, "cls", 0.0
    cfg.model.reranker.max_len, cfg.optim.epochs = 48, 4
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_proportion, cfg.optim.grad_clip = 5e-3, 0.01, 0.25, 0.5
    cfg.deepspeed.config = str(REPO / "configs" / "deepspeed" / "zero0_fp32.json")  # clips at optim.grad_clip
    cfg.run.output_dir, cfg.run.progress, cfg.run.eval_batch_size = str(out), False, 4
    return cfg


def _recording(base):
    class Run(base):
        """Keeps its losses and final weights; writes no checkpoints (no Ray Train here)."""

        def save_checkpoint(self, metrics, suffix: str = "") -> None:
            pass

        def train_step(self, step: int):
            # every module in train mode (from_pretrained hands the encoder over in eval mode: dropout off)
            self.modes = [*getattr(self, "modes", []), all(m.training for m in self.module.modules())]
            metrics = super().train_step(step)
            self.losses = [*getattr(self, "losses", []), metrics["train/loss"]]
            return metrics

        def finish(self):
            out = super().finish()
            out["losses"], out["modes"] = list(self.losses), list(self.modes)
            out["weights"] = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
            return out

    return Run


@pytest.fixture(scope="module")
def process_group(dist_env):
    # left in place afterwards, as DeepSpeed leaves its own (see tests/train/test_learning.py)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield


@pytest.mark.slow
def test_local_worker_takes_the_deepspeed_workers_steps(setup, tiny_model_dir, tmp_path, process_group):  # noqa: F811
    outs = {}
    for name, base in (("deepspeed", RerankWorker), ("local", LocalRerankWorker)):
        cfg = small_config(setup, tiny_model_dir, tmp_path / name)
        outs[name] = _recording(base)(cfg, 0, 1, "cpu").run()
    ds, local = outs["deepspeed"], outs["local"]
    assert ds["done"] and local["done"] and len(local["losses"]) == ds["plan"]["total_steps"] >= 8
    assert all(ds["modes"]) and all(local["modes"]) and len(local["modes"]) == len(local["losses"])
    # Warm-up, decay, weight decay and clipping at 0.5 (it binds) must all match for these to.
    np.testing.assert_allclose(local["losses"], ds["losses"], rtol=1e-6, atol=1e-7)
    # These get no gradient in exact arithmetic: a key bias adds the same amount to every score of
    # a query's softmax, and the score's bias and the last LayerNorm's bias (under the CLS head)
    # the same amount to all 64 candidates of the loss's softmax. Adam scales their rounding noise
    # into lr-sized steps, whose signs follow each engine's summation order (which differ on
    # AVX512 CPUs), so they are left out. They change no prediction (the eval check below).
    last = max(int(k.split(".")[3]) for k in ds["weights"] if k.startswith("model.encoder.layer."))
    shift_invariant = {"score_layer.bias", f"model.encoder.layer.{last}.output.LayerNorm.bias"} | {
        k for k in ds["weights"] if k.endswith("attention.self.key.bias")}
    assert len(shift_invariant) == last + 3 and shift_invariant <= set(ds["weights"])
    for k, w in ds["weights"].items():
        if k not in shift_invariant:
            torch.testing.assert_close(local["weights"][k], w, rtol=1e-6, atol=1e-7, msg=k)
    # same predictions on val and test: the reports, and the choice per mention each wrote to its own run
    files = {name: {s: Path(r.pop("predictions_file")) for s, r in outs[name]["eval"].items()} for name in outs}
    assert local["eval"] == ds["eval"] and set(files["local"]) == {"val", "test"}
    for split, path in files["local"].items():
        assert path.parent == tmp_path / "local" / "predictions"
        assert path.read_text() == files["deepspeed"][split].read_text() != ""
    assert local["engine"]["backend"] == "local" and local["engine"]["accelerator"] is None
    assert local["losses"][-1] < local["losses"][0]


# Runs the job with Ray, DeepSpeed and faiss made unimportable (the GPU machine that ran the MiniLM
# Table 2 has none of them): the local backend must not need them.
BLOCKED = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "deepspeed", "faiss"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_job_runs_locally_without_ray_deepspeed_or_faiss(setup, tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "job"
    sets = [f"data.train_store={setup / 'train'}", f"data.eval_store={setup / 'eval'}",
            f"data.candidates_dir={setup / 'cands'}", "data.num_candidates=6", f"model.reranker.model={tiny_model_dir}",
            f"run.output_dir={out}", "run.backend=local", "run.use_gpu=false", "optim.epochs=2"]
    cmd = [sys.executable, "-c", BLOCKED, str(REPO / "jobs" / "zeshel_reranker.py"),
           "--config", str(REPO / "configs" / "zeshel" / "reranker_test_tiny.yaml"), *(a for s in sets for a in ("--set", s))]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "local: this process, plain torch" in r.stdout and "plain torch (no DeepSpeed), fp32 on CPU" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] and summary["step"] == summary["plan"]["total_steps"]
    assert summary["engine"]["backend"] == "local" and summary["engine"]["device"] == "cpu"
    assert set(summary["eval"]) == {"val", "test"} and "retriever_recall@1" in summary["eval"]["val"]
    assert (out / "reranker" / "manifest.json").exists()
    losses = [m["train/loss"] for _, m in sorted(read_metrics(out / "metrics.jsonl").items()) if "train/loss" in m]
    assert len(losses) == summary["plan"]["total_steps"]


def test_local_backend_needs_one_worker():
    from dist_nce.core.config import ConfigError, load_config
    from dist_nce.rerank.config import RerankJobConfig

    with pytest.raises((ValueError, ConfigError), match="run.backend=local trains in one process"):
        load_config(RerankJobConfig, str(REPO / "configs" / "zeshel" / "reranker_test_tiny.yaml"),
                    ["run.backend=local", "run.num_workers=2", "optim.batch_size=4"])

"""A real DeepSpeed engine on the CPU accelerator, built from the project's JSON configs."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dist_nce.core.config import ConfigError
from dist_nce.worker.engine import build_engine, linear_warmup_decay, load_deepspeed_config

DS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepspeed")


def _toy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train(cfg_name, steps=6, **overrides):
    ds = load_deepspeed_config(os.path.join(DS_DIR, cfg_name), micro_batch=8, world_size=1, grad_clip=1.0,
                               **overrides)
    engine, _, sched = build_engine(_toy(), ds, lr=1e-2, weight_decay=0.0, total_steps=steps,
                                    warmup_proportion=0.0, dist_init_required=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g)
    y = x[:, :1] * 2.0
    losses = []
    for _ in range(steps):
        dtype = torch.bfloat16 if ds["bf16"]["enabled"] else torch.float32
        out = engine(x.to(dtype)).float()
        loss = torch.nn.functional.mse_loss(out, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


@pytest.mark.slow
def test_zero0_fp32_and_zero2_bf16_train_and_agree(dist_env):
    import deepspeed.comm.comm as ds_comm

    fp32, engine = _train("zero0_fp32.json")
    assert fp32[-1] < fp32[0]
    # build_engine kept deepspeed.comm from JIT-building its CPU shm op (unused by training; 1-2 min)
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert engine.zero_optimization_stage() == 0
    bf16, engine2 = _train("zero2_bf16.json")
    assert engine2.zero_optimization_stage() == 2 and engine2.bfloat16_enabled()
    assert bf16[-1] < bf16[0]
    # bf16 (8-bit mantissa) follows fp32 closely over a few steps of the same problem.
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.15, abs=1e-2)


def test_building_an_engine_imports_no_compiler(tmp_path):
    """In a fresh process: build_engine with ZeRO-2 trains without importing inductor (DeepSpeed's Muon
    module, which its ZeRO step imports, compiles on first use instead), and Muon's kernels still
    compute what their eager code does. Nor does it import mlflow (installed here: the dev extra has
    it), which DeepSpeed's autotuner imports when it can (runtime.import_deepspeed); mlflow still
    imports afterwards, as tracking needs."""
    import importlib.util

    assert importlib.util.find_spec("mlflow") is not None
    script = (
        "import os, sys, torch\n"
        "from dist_nce.cluster.runtime import single_process_dist_env\n"
        "os.environ.update(single_process_dist_env())\n"
        "from dist_nce.worker.engine import build_engine, load_deepspeed_config\n"
        f"ds = load_deepspeed_config({os.path.join(DS_DIR, 'zero2_fp32.json')!r}, micro_batch=2, world_size=1,"
        " grad_clip=1.0)\n"
        "engine, _, _ = build_engine(torch.nn.Linear(4, 1), ds, lr=1e-2, weight_decay=0.0, total_steps=1,"
        " warmup_proportion=0.0, dist_init_required=True)\n"
        "engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()\n"
        "from deepspeed.runtime.zero.muon import original_muon as m\n"
        "print(engine.zero_optimization_stage(), 'torch._inductor.compile_fx' in sys.modules)\n"
        "print('mlflow' in sys.modules, __import__('mlflow').__name__)\n"
        "g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))\n"
        "eager = m.zeropower_via_newtonschulz5.__wrapped__(g, 5)\n"
        # bf16 throughout: fused and eager round differently over the 5 iterations (0.03 seen, of 0.8)
        "print(torch.allclose(m.zeropower_via_newtonschulz5(g, 5), eager, atol=6e-2),"
        " 'torch._inductor.compile_fx' in sys.modules)\n")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    # stage 2, no inductor after the step; then Muon's kernel compiled on its first call, as eager
    assert r.stdout.split()[-6:] == ["2", "False", "False", "mlflow", "True", "True"], r.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("cfg_name", ["zero2_bf16.json", "zero3_bf16.json"])
def test_foreach_grad_norm_equals_deepspeeds(dist_env, cfg_name):
    """build_engine's one-call clipping norm (engine docstring) gives DeepSpeed's per-tensor fp64 norm."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    _, engine = _train(cfg_name, steps=1)
    opt = engine.optimizer
    assert opt._foreach_grad_norm and "get_grad_norm_direct" in vars(opt)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    engine.backward(engine(x.to(torch.bfloat16)).float().pow(2).mean())

    def norm():
        if hasattr(opt, "scaled_global_norm"):  # ZeRO-1/2
            return float(opt.scaled_global_norm())
        return float(combine_grad_norm_groups(opt._get_norm_groups()))  # ZeRO-3

    ours = norm()
    del opt.get_grad_norm_direct  # back to DeepSpeed's own
    assert ours > 0 and ours == pytest.approx(norm(), rel=1e-5)


def test_one_worker_zero3_keeps_every_parameter():
    one = load_deepspeed_config(os.path.join(DS_DIR, "zero3_bf16.json"), micro_batch=2, world_size=1, grad_clip=1.0)
    two = load_deepspeed_config(os.path.join(DS_DIR, "zero3_bf16.json"), micro_batch=2, world_size=2, grad_clip=1.0)
    assert one["zero_optimization"]["stage3_param_persistence_threshold"] >= 2 ** 62
    assert two["zero_optimization"]["stage3_param_persistence_threshold"] == 100000
    assert one["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert "stage3_prefetch_bucket_size" not in two["zero_optimization"]


def test_auto_fields_and_overrides():
    cfg = load_deepspeed_config(os.path.join(DS_DIR, "zero0_fp32.json"), micro_batch=2, world_size=2,
                                grad_clip=0.5, zero_stage=3, bf16=True)
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["train_batch_size"] == 4
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] is True
    assert cfg["gradient_clipping"] == 0.5  # the shipped JSONs take optim.grad_clip


@pytest.mark.parametrize("key, given, ours", [("gradient_clipping", 1.0, dict(grad_clip=0.5)),
                                              ("gradient_clipping", "off", dict(grad_clip=1.0)),
                                              ("train_micro_batch_size_per_gpu", 8, dict(micro_batch=2))])
def test_a_json_number_that_disagrees_with_the_yaml_is_refused(tmp_path, key, given, ours):
    """Neither side wins silently (the Hugging Face Trainer's rule): the error names the file and both keys."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({key: given}))
    args = {"micro_batch": 2, "world_size": 1, "grad_clip": 1.0, **ours}
    yaml_key = "optim.grad_clip" if key == "gradient_clipping" else "optim.batch_size / run.num_workers"
    with pytest.raises(ConfigError, match=rf"mine.json: {key}={given!r} disagrees with {yaml_key}"):
        load_deepspeed_config(path, **args)


def test_a_json_number_that_agrees_with_the_yaml_is_kept(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 2}))
    cfg = load_deepspeed_config(path, micro_batch=2, world_size=2, grad_clip=0.5)
    assert cfg["gradient_clipping"] == 0.5 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["train_batch_size"] == 4


def test_every_shipped_json_takes_batch_and_clipping_from_the_yaml():
    for name in sorted(os.listdir(DS_DIR)):
        raw = json.loads(Path(DS_DIR, name).read_text())
        assert raw["gradient_clipping"] == "auto" and raw["train_micro_batch_size_per_gpu"] == "auto", name
        assert load_deepspeed_config(os.path.join(DS_DIR, name), 3, 1, grad_clip=0.25)["gradient_clipping"] == 0.25


def test_bad_deepspeed_configs(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_deepspeed_config(tmp_path / "none.json", 1, 1, 1.0)
    bad = tmp_path / "opt.json"
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match=r"opt.json: optimizer: not supported"):
        load_deepspeed_config(bad, 1, 1, 1.0)
    inconsistent = tmp_path / "batch.json"
    inconsistent.write_text(json.dumps({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(ConfigError, match="train_batch_size=5"):
        load_deepspeed_config(inconsistent, 2, 2, 1.0)
    # DeepSpeed would step the optimizer and the LR schedule every 2nd step of the plan, and its checkpoints
    # keep neither the micro-step count nor the gradients accumulated so far
    accum = tmp_path / "accum.json"
    for given in (2, "2"):
        accum.write_text(json.dumps({"gradient_accumulation_steps": given}))
        with pytest.raises(ConfigError, match=rf"accum.json: gradient_accumulation_steps={given!r}: not supported"):
            load_deepspeed_config(accum, 2, 1, 1.0)
    for given in (1, "auto"):
        accum.write_text(json.dumps({"gradient_accumulation_steps": given}))
        assert load_deepspeed_config(accum, 2, 1, 1.0)["gradient_accumulation_steps"] == 1


def test_linear_warmup_decay():
    f = linear_warmup_decay(total_steps=10, warmup_proportion=0.2)
    assert [round(f(s), 3) for s in range(10)] == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]


@pytest.mark.slow
def test_zero3_step_keeps_resident_parameters_and_trains_the_same(dist_env):
    """One worker: ZeRO-3's step leaves persistent parameters that are their own partition gathered (engine
    docstring), and the training is the same as with DeepSpeed's release + re-gather."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    ours, engine = _train("zero3_bf16.json")
    opt = engine.optimizer
    assert opt._keep_resident_parameters
    assert engine.zero_optimization_stage() == 3
    params = list(engine.module.parameters())
    assert all(p.ds_persist and p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
    assert all(p.data.data_ptr() == p.ds_tensor.data_ptr() for p in params)  # the weights are the partitions
    before = [p.data.clone() for p in params]
    released = []
    coordinator = opt.parameter_offload.get_param_coordinator()
    release = coordinator._PartitionedParameterCoordinator__release_param
    coordinator._PartitionedParameterCoordinator__release_param = lambda p, *a, **k: (released.append(p),
                                                                                       release(p, *a, **k))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    engine.backward(engine(x.to(torch.bfloat16)).float().pow(2).mean())
    for group in opt.param_groups:
        group["lr"] = 1e-2  # the schedule has decayed to 0 after _train's steps
    engine.step()
    del coordinator._PartitionedParameterCoordinator__release_param
    assert not released
    assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)
    assert any(not torch.equal(b, p.data) for b, p in zip(before, params))  # the step updated them in place
    assert all(p.data.data_ptr() == p.ds_tensor.data_ptr() for p in params)

    import dist_nce.worker.engine as engine_mod
    original = engine_mod.keep_resident_parameters
    engine_mod.keep_resident_parameters = lambda opt: False  # DeepSpeed's own release + re-gather
    try:
        theirs, engine2 = _train("zero3_bf16.json")
    finally:
        engine_mod.keep_resident_parameters = original
    assert not getattr(engine2.optimizer, "_keep_resident_parameters", False)
    assert ours == theirs
    import deepspeed
    # and the same weights: ours as they were before the extra step above, theirs gathered from the partitions
    with deepspeed.zero.GatheredParameters(list(engine2.module.parameters())):
        for b, p in zip(before, engine2.module.parameters()):
            assert torch.equal(b, p.data)

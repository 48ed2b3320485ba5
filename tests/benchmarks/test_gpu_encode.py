"""benchmarks/gpu_encode.py at test size on the CPU (the GPU run is BERT-large on an H100): every variant is
timed through the shard's encode path, rates, MFU and the KILT refresh time follow from the timings, and the
bf16-weight variant is checked against fp32 and autocast."""
from __future__ import annotations

import json

import pytest

from benchmarks import gpu_encode


def test_flops_per_entity_of_bert_large_match_the_issue():
    f = gpu_encode.flops_per_entity(gpu_encode.BERT_LARGE, 128)
    assert f["matmul_params"] == 24 * 12 * 1024 ** 2
    assert f["per_entity"] == pytest.approx(2 * 24 * 12 * 1024 ** 2 * 128 + 4 * 128 ** 2 * 1024 * 24)
    # issue 23: 4,750 entities/s = 49% of a 770 TFLOP/s peak
    assert 4750 * f["per_entity"] / 770e12 == pytest.approx(0.49, abs=0.005)


@pytest.mark.slow
def test_quick_run_measures_every_variant_on_the_cpu():
    out = gpu_encode.run("cpu", quick=True, peak_tflops=1.0, log=lambda msg: None)
    json.dumps(out)  # JSON-able as printed by __main__ and written by benchmarks/gpu.py
    names = ["a_eager_fp32w_autocast", "b_compiled_fp32w_autocast", "c_eager_bf16w", "d_compiled_bf16w"]
    assert list(out["variants"])[:4] == names
    rows = out["rows"]["per_timing"]
    for name in names:
        e = out["variants"][name]
        assert "error" not in e, e.get("error")
        s, r = e["seconds"], e["entities_per_s"]
        assert s["repeats"] == out["rounds"]["timed"] and s["min"] <= s["median"] <= s["max"]
        assert r["median"] == pytest.approx(rows / s["median"]) and r["min"] <= r["median"] <= r["max"]
        assert e["mfu"]["median"] == pytest.approx(r["median"] * out["flops"]["per_entity"] / 1e12)
        assert e["refresh_kilt_8gpu_min"]["median"] == pytest.approx(gpu_encode.KILT_ROWS / (8 * r["median"]) / 60)
        assert e["attention"] == "sdpa" and e["sdpa"]["backend"] != "unknown"
        assert e["vs_fp32"]["cos_min"] > 0.999
    assert out["variants"]["c_eager_bf16w"]["weights"] == "bfloat16"
    assert out["variants"]["c_eager_bf16w"]["autocast"] is None
    assert out["variants"]["a_eager_fp32w_autocast"]["autocast"] == "bfloat16"
    assert out["variants"]["b_compiled_fp32w_autocast"]["compile_s"] > 0
    assert out["numerics"]["bf16w_within_tolerance"] is True
    assert out["best"]["variant"] in names and out["peak_source"] == "caller"
    assert out["shard_default"]["compile"] is False  # a CPU shard: auto compiles on CUDA only
    assert out["sdpa_probe"]["ms_per_forward"]["default"]["ms"] > 0
    # the optional rows (no budget on quick runs): twice the batch, and the compiled one with the mask passed
    best = max(names, key=lambda n: out["variants"][n]["entities_per_s"]["median"])
    bigger = out["variants"][f"{best}_batch32"]
    assert bigger["batch"] == 32 and "error" not in bigger and bigger["entities_per_s"]["median"] > 0
    masked = [n for n in out["variants"] if n.endswith("_mask_passed")]
    assert len(masked) == 1 and out["variants"][masked[0]]["not_a_shard_path"] is True
    assert "error" not in out["variants"][masked[0]] and out["best"]["variant"] != masked[0]
    assert out["skipped"] == []


def test_variants_can_be_picked_by_name():
    with pytest.raises(ValueError, match="unknown variants"):
        gpu_encode.run("cpu", quick=True, peak_tflops=1.0, variants=["e_fp8"])

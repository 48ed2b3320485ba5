"""benchmarks/gpu_encode.py at test size on the CPU (the GPU run is BERT-large on an H100): every variant is
timed through the shard's encode path, rates, MFU and the KILT refresh time follow from the timings, and the
bf16-weight variant is checked against fp32 and autocast."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_encode
from dist_nce.kernels.build import SWITCH


def test_flops_per_entity_of_bert_large_match_the_issue():
    f = gpu_encode.flops_per_entity(gpu_encode.BERT_LARGE, 128)
    assert f["matmul_params"] == 24 * 12 * 1024 ** 2
    assert f["per_entity"] == pytest.approx(2 * 24 * 12 * 1024 ** 2 * 128 + 4 * 128 ** 2 * 1024 * 24)
    # issue 23: 4,750 entities/s = 49% of a 770 TFLOP/s peak
    assert 4750 * f["per_entity"] / 770e12 == pytest.approx(0.49, abs=0.005)


@pytest.mark.slow
def test_quick_run_measures_the_default_variants_on_the_cpu(monkeypatch):
    # sdpa, as on CUDA: on an AVX512-BF16 CPU the shard's bf16 encode would take the native kernel
    monkeypatch.setenv(SWITCH, "off")
    out = gpu_encode.run("cpu", quick=True, peak_tflops=1.0, log=lambda msg: None)
    json.dumps(out)  # JSON-able as printed by __main__ and written by benchmarks/gpu.py
    names = ["c_eager_bf16w", "c_eager_bf16w_batch2x", "e_compiled_layers_bf16w"]
    assert list(out["variants"]) == names == list(gpu_encode.DEFAULT_VARIANTS)
    rows, batch = out["rows"]["per_timing"], out["rows"]["batch"]
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
        assert e["weights"] == "bfloat16" and e["autocast"] is None
    c, c2, layers = (out["variants"][n] for n in names)
    assert c["batch"] == batch and c2["batch"] == 2 * batch and layers["batch"] == batch
    assert layers["compile"] is True and layers["compile_scope"] == "layers" and layers["compile_s"] > 0
    assert c["compile"] is False and c2["compile"] is False
    assert out["numerics"]["bf16w_within_tolerance"] is True
    assert out["numerics"]["e_compiled_layers_bf16w_vs_eager_rel_l2_max"] < 1e-2
    assert out["best"]["variant"] in names and sorted(out["best"]["ranking"]) == sorted(names)
    assert out["peak_source"] == "caller"
    # a CPU shard keeps fp32 weights (none of these variants); on CUDA c_eager_bf16w is the shard default
    assert out["shard_default"]["compile"] is False and out["shard_default"]["weights"] == "float32"
    assert out["shard_default"]["variant"] is None and not any(e["shard_default"] for e in out["variants"].values())
    assert out["compile_break_even"]["e_compiled_layers_bf16w"]["compile_s"] == layers["compile_s"]
    assert out["sdpa_probe"]["ms_per_forward"]["default"]["ms"] > 0
    assert len(out["skipped"]) == 1 and "d_compiled_bf16w" in out["skipped"][0]  # measured already


def test_variants_can_be_picked_by_name():
    with pytest.raises(ValueError, match="unknown variants"):
        gpu_encode.run("cpu", quick=True, peak_tflops=1.0, variants=["e_fp8"])
    # the variants measured already run by name, the whole model compiled (no compile here: compile=False)
    out = gpu_encode.run("cpu", quick=True, peak_tflops=1.0, variants=["a_eager_fp32w_autocast", "d_compiled_bf16w"],
                         compile=False, repeats=1, log=lambda msg: None)
    assert list(out["variants"]) == ["a_eager_fp32w_autocast"]
    assert out["variants"]["a_eager_fp32w_autocast"]["autocast"] == "bfloat16"
    assert "compiled variants (compile=False)" in out["skipped"]


def test_kb_lengths_rows_compare_packed_with_padded_on_real_tokens():
    """Issue 37 item 2 at test size: rows of the synthetic KILT KB's lengths, the eager padded encode and the
    packed one (service.encode_pack) through encode_rows, each with its first pass; MFU over real tokens."""
    saved = []  # what a call cut short would have brought back (benchmarks.gpu_common.result_writer)
    out = gpu_encode.run("cpu", quick=True, peak_tflops=1.0, lengths="kb", compile=False,
                         variants=["c_eager_bf16w", "f_packed_bf16w"], log=lambda msg: None,
                         partial=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    json.dumps(out, default=str)
    # after each variant's first pass, after the numerics, after the timed rounds
    assert len(saved) == 4 and list(saved[0]["variants"]) == ["c_eager_bf16w"]
    assert saved[0]["variants"]["c_eager_bf16w"]["first_pass_s"] > 0 and "numerics" not in saved[1]
    assert "numerics" in saved[2] and "seconds" not in saved[2]["variants"]["f_packed_bf16w"]
    assert "seconds" in saved[3]["variants"]["f_packed_bf16w"]
    assert out["rows"]["lengths"] == "kb" and not out["rows"]["all_full_length"]
    assert 1 <= out["flops"]["real_tokens_mean"] < 32
    want = gpu_encode.real_flops_per_entity(gpu_encode.TINY_BERT, gpu_encode.KBRows(32, 32, 1000, 0).lengths(
        range(32)))
    assert out["flops"]["per_entity"] == pytest.approx(want["per_entity"])
    packed, padded = out["variants"]["f_packed_bf16w"], out["variants"]["c_eager_bf16w"]
    assert packed["packed"] and not padded["packed"] and packed["attention"].startswith("dist_nce_packed_")
    for e in (packed, padded):
        assert e["first_pass_s"] > 0 and e["first_pass_mfu"] > 0 and e["mfu"]["median"] > 0
    assert out["numerics"]["f_packed_bf16w_vs_eager_rel_l2_max"] <= out["numerics"]["tolerance_rel_l2"]


def test_the_result_writer_leaves_a_partial_result_and_main_the_complete_one(tmp_path):
    from benchmarks.gpu_common import result_writer

    out = tmp_path / "r.json"
    result_writer(None)({"a": 1})  # no --out: nothing written
    assert not out.exists()
    result_writer(out)({"a": 1, "dtype": torch.bfloat16})
    assert json.loads(out.read_text()) == {"a": 1, "dtype": "torch.bfloat16", "complete": False}
    assert gpu_encode.main(["--device", "cpu", "--quick", "--no-compile", "--peak-tflops", "1",
                            "--variants", "c_eager_bf16w", "--out", str(out)]) == 0
    done = json.loads(out.read_text())
    assert done["complete"] is True and "seconds" in done["variants"]["c_eager_bf16w"]

"""benchmarks/import_rss.py at a tiny size: every method runs in a child process, the JSON renders."""
import json

import pytest

from benchmarks import import_rss, report


@pytest.mark.slow
def test_tiny_run_records_both_methods_and_renders(tmp_path):
    out = tmp_path / "import_rss.json"
    assert import_rss.main(["--small-rows", "20000", "--full-rows", "0", "--repeats", "1", "--shards", "2",
                            "--chunk-rows", "2000", "--model-shape", "tiny", "--model-repeats", "1", "--force",
                            "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (size,) = data["sizes"]
    assert size["rows"] == 20000 and size["shard_float16_bytes"] == 10000 * 1024 * 2
    for method in ("stream", "torch_load"):
        m = size["methods"][method]
        assert m["peak_rss_mib"]["max"] >= m["start_rss_mib"] > 0 and m["seconds"]["repeats"] == 1
    # the torch.load child holds the 82 MB matrix on top of what the streaming child holds
    assert size["methods"]["torch_load"]["peak_rss_mib"]["max"] > size["methods"]["stream"]["peak_rss_mib"]["max"] + 40
    model = data["model"]
    assert model["fingerprints_equal"] and model["shape"] == "tiny" and model["file_bytes"] > 4 * model["params"]
    assert set(model["methods"]) == {"load", "stream"} and model["noisy"] in (True, False)
    assert not list((tmp_path / "w").glob("*.t7")) and not list((tmp_path / "w").glob("*.bin")), "inputs deleted"
    text = report.import_rss(data)
    assert "| 20,000 x 1024 (0.1 GB) | stream |" in text
    assert "| 2 towers x 2 layers, d = 64 (" in text and "Both gave the same fingerprint." in text

    # one part run again keeps the other part of the file
    before = data["sizes"]
    assert import_rss.main(["--parts", "model", "--model-shape", "tiny", "--model-repeats", "1", "--force",
                            "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["sizes"] == before and again["model"]["methods"]["stream"]["seconds"]["repeats"] == 1

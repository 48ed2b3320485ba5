"""The training step logs the device's wall time for its forward, backward and optimizer step
(time/compute_device_s, dist_nce/worker/device_time.py) where there is one: the span opens before the
forward, closes after the optimizer step, and is read after the step's one read-back. A CPU run logs none."""
from __future__ import annotations

import pytest

from tests.train.local_service import LocalService
from tests.train.test_entity_cache import FROZEN, _Run, process_group  # noqa: F401 (a fixture)
from tests.train.tinyrun import tiny_config


@pytest.mark.slow
def test_the_step_logs_the_device_time_of_its_compute_where_there_is_a_device_clock(
        tmp_path, tiny_model_dir, process_group, monkeypatch):
    from dist_nce.train import loop
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever

    cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / "prep", *FROZEN)
    ensure_prepared(cfg.data, tiny_model_dir, log=lambda s: None)
    service = LocalService(cfg.data.prepared_dir, cfg.model.retriever, cfg.service, str(tmp_path / "shards"),
                           build_retriever(cfg.model, cfg.optim.seed).entity_encoder_state())
    events: list[str] = []

    class Logged(_Run):
        def train_step(self, step):
            if not getattr(self, "_wrapped", False):  # the engine exists now: mark its forward and step
                forward, opt_step = self.engine.forward, self.engine.step
                self.engine.forward = lambda *a, **k: (events.append("forward"), forward(*a, **k))[1]
                self.engine.step = lambda *a, **k: (events.append("optimizer"), opt_step(*a, **k))[1]
                self._wrapped = True
            metrics = super().train_step(step)
            self.metrics = [*getattr(self, "metrics", []), metrics]
            return metrics

        def finish(self):
            out = super().finish()
            out["metrics"] = self.metrics
            return out

    cpu = Logged(tiny_config(tmp_path, tiny_model_dir, tmp_path / "cpu", *FROZEN), service, 0, 1, "cpu").run()
    assert cpu["done"] and cpu["metrics"] and all("time/compute_device_s" not in m for m in cpu["metrics"])

    class Clock:  # a device clock: 0.5 s per span, read only after it was stopped
        def __init__(self, device):
            pass

        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")

        def seconds(self):
            assert events[-1] == "stop", events[-4:]
            events.append("read")
            return 0.5

    monkeypatch.setattr(loop, "DeviceSpan", Clock)
    events.clear()
    timed = Logged(tiny_config(tmp_path, tiny_model_dir, tmp_path / "timed", *FROZEN), service, 0, 1, "cpu").run()
    steps = len(timed["metrics"])
    assert timed["done"] and steps == 4
    assert [m["time/compute_device_s"] for m in timed["metrics"]] == [0.5] * steps
    spans = [e for e in events if e in ("start", "forward", "optimizer", "stop", "read")]
    assert spans[:5 * steps] == ["start", "forward", "optimizer", "stop", "read"] * steps, spans

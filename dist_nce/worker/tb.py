"""Rank 0's view of a run: TensorBoard scalars, a metrics.jsonl log and a tqdm bar.

``<output_dir>/tensorboard/`` holds the event files (``tensorboard --logdir <output_dir>``);
``<output_dir>/metrics.jsonl`` has one JSON object per logged step (``{"step": t, "train/loss":
...}``), which is what tests and scripts read. After a restart the steps since the last
checkpoint are trained and logged again; readers keep the LAST line of a step.
Other ranks get a logger that does nothing. A ``tracker`` (``run.tracking`` on:
:mod:`dist_nce.worker.tracking`) gets every scalar logged here, at the same step, and is closed
with the logger.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class RunLogger:
    def __init__(self, output_dir: str | Path, rank: int, total_steps: int, start_step: int, progress: bool,
                 tracker: Any = None):
        self.enabled = rank == 0
        self.writer = self.bar = self._jsonl = None
        self.tracker = tracker if self.enabled else None
        if not self.enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=start_step or None)
        self._jsonl = open(out / "metrics.jsonl", "a", encoding="utf-8")
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        """Scalars named like ``train/loss`` or ``dev/recall@64`` at ``step``."""
        if not self.enabled:
            return
        for name, v in values.items():
            self.writer.add_scalar(name, float(v), step)
        self._jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")
        self._jsonl.flush()
        if self.tracker is not None:
            self.tracker.log(step, values)

    def text(self, name: str, value: Any, step: int) -> None:
        if self.enabled:
            self.writer.add_text(name, str(value), step)

    def progress(self, postfix: dict[str, Any] | None = None) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, line: str) -> None:
        """Print a line without breaking the progress bar (rank 0 only)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            # Not print(): Ray Train patches it to log AND echo, which doubles every line.
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
        self._jsonl.close()
        if self.tracker is not None:
            self.tracker.close()


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl -> {step: values}, the last line of a step winning (re-trained steps)."""
    out: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.setdefault(int(d.pop("step")), {}).update(d)
    return out

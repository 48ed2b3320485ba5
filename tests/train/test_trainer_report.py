"""What the AIDA job prints at its end: the dev table (dist_nce.train.trainer.dev_table)."""
from __future__ import annotations

import json

from dist_nce.train.trainer import dev_table


def test_dev_table_lists_accuracy_then_recall_by_k_even_from_sorted_json():
    before = {"n_mentions": 5, "accuracy": 0.1, "recall@4": 0.3, "recall@16": 0.5, "recall@64": 0.9}
    after = {"n_mentions": 5, "accuracy": 0.2, "recall@4": 0.4, "recall@16": 0.6, "recall@64": 0.95}
    # summary.json is written with sorted keys: read back, "recall@16" comes before "recall@4"
    after = json.loads(json.dumps(after, sort_keys=True))
    assert list(after)[1:3] == ["n_mentions", "recall@16"]
    lines = dev_table(before, after).splitlines()
    assert lines[0].split()[:3] == ["dev", "(5", "mentions)"]
    assert [line.split()[0] for line in lines[1:]] == ["accuracy", "recall@4", "recall@16", "recall@64"]
    assert lines[2].split()[1:] == ["0.3000", "0.4000", "+0.1000"]
    # before only (a run that has not finished): the other columns are dashes
    assert dev_table(before, None).splitlines()[4].split() == ["recall@64", "0.9000", "-", "-"]

"""collect -> tables / plots over cells whose runs are written here as the jobs write them."""
import json
from pathlib import Path

import pytest
import yaml

from dist_nce.core.config import load_config
from dist_nce.minipaper.cells import aida_cells, reranker_cells, zeshel_cells
from dist_nce.minipaper.config import MiniPaperConfig
from dist_nce.minipaper.report import best_retriever, collect, tables, write_outputs

REPO = Path(__file__).resolve().parents[2]
# Made-up outcomes per (architecture, arm): val R@64 over seeds 0..2 = base + 0.01 * seed.
VAL = {("dual", "random"): 0.30, ("dual", "hard"): 0.40, ("som", "random"): 0.80, ("som", "hard"): 0.805}
BIAS = {"random": 0.9, "hard": 0.2}


def retriever_run(d: Path, val: float, arm: str, every: int = 10) -> dict:
    d.mkdir(parents=True)
    lines = []
    for step in (10, 20, 30):
        lines.append({"step": step - 1, "time/step_s": 0.1, "train/loss": 1.0})
        lines.append({"step": step, "bias/norm": BIAS[arm] + step / 1000, "bias/norm_se": 0.01, "bias/seconds": 0.05})
        lines.append({"step": step, "dev/recall@64": val * step / 30, "dev/accuracy": val / 3})
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = lambda v: {"own_world": {"recall@64": {"macro": v}, "accuracy": {"macro": v / 4}, "n_mentions": 600}}  # noqa
    summary = {"done": True, "seconds": 12.0, "config": {"zeshel": {"k": 64}, "bias": {"every_steps": every}},
               "dev_after": {"recall@64": val + 0.1, "accuracy": val / 3},
               "dev_before": {"recall@64": 0.05, "accuracy": 0.01},
               "zeshel": {"val": rep(val), "test": rep(val - 0.02)}}
    (d / "summary.json").write_text(json.dumps(summary))
    return summary


def reranker_run(d: Path, acc: float) -> dict:
    d.mkdir(parents=True)
    rep = {"unnormalized_accuracy": {"macro": acc}, "normalized_accuracy": {"macro": 2 * acc},
           "candidate_recall@64": {"macro": 0.5}, "n_mentions": 600}
    summary = {"done": True, "seconds": 5.0, "eval": {"val": rep, "test": rep}}
    (d / "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.fixture
def grid(tmp_path):
    data = {"seeds": [0, 1, 2], "zeshel": {
        "config": "configs/zeshel/test_tiny.yaml", "warmup": ["negatives.mode=random"],
        "architectures": {"dual": [], "som": []}, "arms": {"random": [], "hard": []}},
        "aida": {"architectures": {"dual": []}, "arms": {"random": [], "hard": []}}}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(MiniPaperConfig, tmp_path / "g.yaml")
    out = tmp_path / "grid"
    cells = {**zeshel_cells(cfg, REPO), **aida_cells(cfg)}
    done = {}
    for name, c in cells.items():
        arch, arm, seed = c.labels["architecture"], c.labels["arm"], c.labels["seed"]
        if arm == "start":
            done[name] = retriever_run(c.dir(out, REPO), 0.25, "random")
        elif c.part == "zeshel":
            done[name] = retriever_run(c.dir(out, REPO), VAL[(arch, arm)] + 0.01 * seed, arm)
        elif not (arm == "hard" and seed == 2):  # one AIDA cell failed
            s = retriever_run(c.dir(out, REPO), 0.5 + 0.01 * seed + (0.2 if arm == "hard" else 0), arm)
            done[name] = s
    failed = {"aida-dual-hard-s2": "exit 1"}
    return cfg, cells, done, failed, out


def test_collect_groups_seeds_and_judges_against_random(grid):
    cfg, cells, done, failed, out = grid
    result = collect(cfg, cells, done, failed, {}, out, REPO)
    z = result["zeshel"]
    g = {(x["architecture"], x["arm"]): x for x in z["groups"]}
    assert g[("dual", "hard")]["val/R@64"]["mean"] == pytest.approx(0.41)
    assert g[("dual", "hard")]["seeds"] == [0, 1, 2]
    vs = {(v["architecture"], v["arm"]): v for v in z["versus_random"]}
    assert vs[("dual", "hard")]["val/R@64"]["verdict"] == "wins"
    assert vs[("som", "hard")]["val/R@64"]["verdict"] == "tie"  # 0.805-0.825 vs 0.80-0.82
    assert [s["architecture"] for s in z["start"]] == ["dual", "som"]
    # the bias ordering from the monitor's last measurement on each trained model
    order = {b["architecture"]: b for b in z["bias_order"]}
    assert order["dual"]["order"] == ["random", "hard"] and order["dual"]["pairs"][0]["verdict"] == "wins"
    assert g[("dual", "hard")]["bias/final"]["mean"] == pytest.approx(0.23)
    # one measurement (0.05 s) per 10 steps of 0.1 s
    assert g[("dual", "hard")]["bias/cost"]["mean"] == pytest.approx(0.05)
    a = {(x["architecture"], x["arm"]): x for x in result["aida"]["groups"]}
    assert a[("dual", "hard")]["seeds"] == [0, 1]  # the failed seed is not averaged in
    statuses = {r["name"]: r["status"] for r in result["cells"]}
    assert statuses["aida-dual-hard-s2"] == "failed"
    assert best_retriever(result) == [("som", "hard"), ("som", "random")]


def test_tables_and_plots_render_from_the_collected_json(grid):
    cfg, cells, done, failed, out = grid
    result = collect(cfg, cells, done, failed, {}, out, REPO)
    # what is written to mini_paper.json reads back to the same tables
    result = json.loads(json.dumps(result))
    rr = reranker_cells(cfg, {k: c for k, c in cells.items() if c.part == "zeshel"}, best_retriever(result), REPO)
    rdone = {n: reranker_run(c.dir(out, REPO), 0.3 if c.labels["arm"] == "hard" else 0.1) for n, c in rr.items()}
    result = json.loads(json.dumps(collect(cfg, {**cells, **rr}, {**done, **rdone}, failed, {}, out, REPO)))
    text = tables(result)
    assert "| dual | hard | 3 | 41.0 [40.0, 42.0] (+) |" in text
    assert "| dual | shared start | 1 | 25.0 |" in text
    assert "| som | hard | 3 | 30.0 [30.0, 30.0] (+) |" in text  # Table 2: U.Acc of the best retriever's reranker
    # the bias curves (BIAS + step / 1000 per seed-free arm): random above hard at each of the 3 steps
    assert "zeshel dual: random > hard (apart at 3 of 3 monitor steps)" in text
    how = text.split("How much a mark says")[1]
    assert "3 seeds against 2: 1 in 10; 3 seeds against 3: 1 in 20, each way" in how  # a failed cell: 2 seeds
    n = int(how.split("tables make ")[1].split(" ")[0])
    marks = text.count("(+)") + text.count("(-)")
    expected = float(how.split("chance alone would leave about ")[1].split(" ")[0])
    assert n >= marks + 1 and n / 20 < expected < n / 10  # marks + the bias pair; 1/20 or 1/10 each
    assert "monitor cost at the grid's cadence, as a share of training time: zeshel dual median 5.0%" in text
    written = write_outputs(result, out)
    assert {p.name for p in written} == {"mini_paper.md", "zeshel_curves.png", "aida_curves.png", "zeshel_bias.png",
                                         "aida_bias.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def test_retriever_r1_sits_beside_u_acc_and_left_out_parts_get_no_section(grid):
    """Table 2 shows the retriever's own R@1 on the same mentions beside the reranker's U.Acc where the
    run recorded it; a result without reranker or AIDA cells (the MiniLM grid) has no such section."""
    cfg, cells, done, failed, out = grid
    zeshel = {k: c for k, c in cells.items() if c.part == "zeshel"}
    result = json.loads(json.dumps(collect(cfg, zeshel, done, failed, {}, out, REPO)))
    text = tables(result)
    assert "Table 1" in text and "Table 2" not in text and "AIDA" not in text
    rr = reranker_cells(cfg, zeshel, best_retriever(result), REPO)
    rdone = {}
    for n, c in rr.items():
        s = reranker_run(c.dir(out, REPO), 0.3)
        for rep in s["eval"].values():
            rep["retriever_recall@1"] = {"macro": 0.25}
        rdone[n] = s
    result = json.loads(json.dumps(collect(cfg, {**zeshel, **rr}, {**done, **rdone}, failed, {}, out, REPO)))
    table2 = tables(result).split("Table 2")[1].split("###")[0].split("## ")[0]
    assert "| architecture | negatives | seeds | val retriever R@1 | val U.Acc | val N.Acc | test retriever R@1 |" \
        in table2
    assert "| som | hard | 3 | 25.0 [25.0, 25.0] | 30.0 [30.0, 30.0] |" in table2


def test_named_page_blocks_render_apart():
    from dist_nce.minipaper.report import page_block, rewrite_page

    page = ("a\n<!-- minipaper -->\nold\n<!-- /minipaper -->\nb\n"
            "<!-- minipaper minilm -->\nold2\n<!-- /minipaper minilm -->\n")
    result = {"cells": [], "config": {}}
    both = rewrite_page(rewrite_page(page, result), result, "minilm")
    assert page_block(both) == page_block(both, "minilm") == tables(result, level=3)
    assert "old" not in both and both.startswith("a\n") and "\nb\n" in both
    with pytest.raises(ValueError, match="no <!-- minipaper seeds --> ... <!-- /minipaper seeds --> block"):
        rewrite_page(page, result, "seeds")


def test_heldout_r1_gets_a_column_when_the_runs_recorded_it(tmp_path):
    from dist_nce.minipaper.report import zeshel_columns
    from dist_nce.minipaper.results import zeshel_row

    summary = retriever_run(tmp_path / "run", 0.4, "hard")
    assert "heldout/R@1" not in zeshel_row(tmp_path / "run", summary)  # its dev has no recall@1
    summary["dev_after"]["recall@1"] = 0.25
    row = zeshel_row(tmp_path / "run", summary)
    assert row["heldout/R@1"] == 0.25 and row["heldout/R@64"] == pytest.approx(0.5)
    titles = [t for _, t in zeshel_columns({"zeshel": {"metrics": list(row)}})]
    assert titles[4:7] == ["heldout R@64", "heldout R@1", "bias (trained)"]
    assert "heldout R@1" not in [t for _, t in zeshel_columns({"zeshel": {"metrics": ["heldout/R@64"]}})]


def test_reranker_gain_over_its_retriever_is_paired_seed_by_seed(grid):
    """Table 2's question (does reranking help?) per seed: U.Acc minus the R@1 of the retriever run it
    reranked, on the same mentions; "above" only when every seed is above."""
    from dist_nce.minipaper.report import rerank_gains

    cfg, cells, done, failed, out = grid
    zeshel = {k: c for k, c in cells.items() if c.part == "zeshel"}
    result = json.loads(json.dumps(collect(cfg, zeshel, done, failed, {}, out, REPO)))
    rr = reranker_cells(cfg, zeshel, best_retriever(result), REPO)
    rdone = {}
    for n, c in rr.items():
        seed, arm = c.labels["seed"], c.labels["arm"]
        s = reranker_run(c.dir(out, REPO), 0.3 + 0.01 * seed if arm == "hard" else 0.2)
        s["eval"]["val"] = {**s["eval"]["val"], "retriever_recall@1": {"macro": 0.28 + 0.02 * seed}}
        s["eval"]["test"] = {**s["eval"]["test"], "retriever_recall@1": {"macro": 0.1}}
        (c.dir(out, REPO) / "summary.json").write_text(json.dumps(s))
        rdone[n] = s
    result = json.loads(json.dumps(collect(cfg, {**zeshel, **rr}, {**done, **rdone}, failed, {}, out, REPO)))
    gains = {(g["arm"], g["split"]): g for g in rerank_gains(result)}
    assert gains[("hard", "val")]["gains"] == pytest.approx([2.0, 1.0, 0.0])
    assert not gains[("hard", "val")]["above"] and not gains[("hard", "val")]["below"]  # 0.0 is not above
    assert gains[("random", "val")]["below"] and gains[("random", "val")]["gains"] == pytest.approx([-8.0, -10.0, -12.0])
    assert gains[("hard", "test")]["above"] and gains[("random", "test")]["above"]
    text = tables(result)
    assert "| som | hard | val | +2.0, +1.0, +0.0 | mixed |" in text
    assert "| som | random | val | -8.0, -10.0, -12.0 | below at every seed |" in text
    assert "Above at 8 of 12 (seed, split) pairs." in text

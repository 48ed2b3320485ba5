"""Packed against padded towers on the CPU (``RetrieverConfig.pack_tokens``, issue 37 items 1 and 5): the
retriever's forward + backward on the shipped MiniLM (both towers, dual, bf16 autocast where the CPU has
AVX512-BF16, else fp32), and the entity tower's no-grad encode, at candidate lengths drawn from the synthetic
KILT KB's (:mod:`benchmarks.kb_lengths`) and at every token real, interleaved in one process.

Padded = the forward the training step ran before packing (the batch cut to its longest row, attention
masked); packed = only the real tokens through the layers (``modeling.packed``, the CPU's ``padded``
attention over the rows). Per row: seconds min / median / max, the packed/padded ratio and whether the
spreads are apart, and the largest |score difference| of one forward in eval mode (the timed ones train, with
dropout: their draws differ), over the largest |score| (the same function; bf16 rounding). Saves
benchmarks/results/packed.json::

    .venv/bin/python -m benchmarks.packed                 # ~3 min on 2 cores
"""
from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
import torch

from benchmarks import kb_lengths
from benchmarks.common import (add_hygiene_args, compare, interleaved, load_guard, machine_info, native_bf16,
                               print_table, save_results)


def batch(b: int, k: int, lm: int, lc: int, lengths: str, seed: int):
    """(mention_ids [b, lm], mention_mask, cand_ids [b, k, L], cand_mask, host_checked keywords)."""
    from dist_nce.modeling.retriever import host_checked

    g = torch.Generator().manual_seed(seed)
    m = torch.randint(1000, 30000, (b, lm), generator=g)
    c = torch.randint(1000, 30000, (b, k, lc), generator=g)
    m[:, 0] = c[..., 0] = 101
    if lengths == "kb":
        lens = torch.from_numpy(kb_lengths.sample(b * k, np.random.default_rng(seed), lc)).reshape(b, k)
    else:
        lens = torch.full((b, k), lc)
    width = int(lens.max())
    c_mask = torch.arange(width)[None, None, :] < lens[..., None]
    c = c[..., :width] * c_mask
    m_mask = torch.ones_like(m, dtype=torch.bool)
    return m, m_mask, c, c_mask, host_checked(m_mask, c_mask)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mentions", type=int, default=4)
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    add_hygiene_args(ap)
    args = ap.parse_args(argv)
    guard = load_guard(args.force)

    from dist_nce.core.models import default_model_dir
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.retriever import Retriever, RetrieverConfig

    model_dir = default_model_dir()
    autocast = torch.bfloat16 if native_bf16() else None
    padded = Retriever(RetrieverConfig(preset="dual"), Encoder.from_pretrained(model_dir),
                       Encoder.from_pretrained(model_dir)).train()
    packed = copy.deepcopy(padded)
    packed.use_packing("auto")

    rows, results = [], {}
    for lengths in ("kb", "full"):
        data = batch(args.mentions, args.candidates, 32, 128, lengths, seed=1)
        scores = {}

        def step(model, name):
            def run():
                model.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    s = model(*data[:4], **data[4]).float()
                torch.nn.functional.cross_entropy(s, torch.zeros(s.shape[0], dtype=torch.long)).backward()
                scores[name] = s.detach()
            return run

        def encode(model, name):
            def run():
                with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                     enabled=autocast is not None):
                    scores[name] = model.encode_entities(data[2], data[3], data[4]["cand_padded"],
                                                         data[4]["cand_lengths"]).vecs.float()
            return run

        for work, make in (("train_step", step), ("entity_encode", encode)):
            for model in (padded, packed):
                model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                same = [model(*data[:4], **data[4]).float() for model in (padded, packed)]
            diff = float((same[1] - same[0]).abs().max() / same[0].abs().max())
            for model in (padded, packed):
                model.train()
            spreads = interleaved({"padded": make(padded, "padded"), "packed": make(packed, "packed")},
                                  repeats=args.repeats, warmup=1)
            c = compare(spreads["packed"], spreads["padded"])
            real = int(data[3].sum())
            key = f"{work}/{lengths}"
            results[key] = {"padded": spreads["padded"], "packed": spreads["packed"], "packed_over_padded": c,
                            "eval_scores_max_abs_diff_over_max_abs": diff, "real_candidate_tokens": real,
                            "padded_candidate_tokens": int(data[3].numel())}
            rows.append({"row": key, "padded": spreads["padded"]["median"], "packed": spreads["packed"]["median"],
                         "x": c["x_median"], "distinct": str(c["distinct"]), "real": real,
                         "total": int(data[3].numel()), "diff": diff})
    print_table(rows, [("row", "work/lengths", "<20s"), ("padded", "padded s", ">9.3f"),
                       ("packed", "packed s", ">9.3f"), ("x", "packed/padded", ">13.2f"),
                       ("distinct", "apart", ">6s"), ("real", "real tok", ">8d"), ("total", "padded tok", ">10d"),
                       ("diff", "|diff|/max", ">9.2g")])
    payload = {"benchmark": "packed vs padded towers on the CPU (issue 37 items 1, 5)",
               "model": "shipped all-MiniLM-L6-v2, both towers, dual",
               "batch": {"mentions": args.mentions, "candidates": args.candidates, "mention_len": 32,
                         "cand_len": 128, "lengths": "kb: synthetic KILT KB (benchmarks/kb_lengths); full: all 128"},
               "precision": "bf16 autocast" if autocast else "fp32", "order": "interleaved padded packed ...",
               "results": results, **guard, "machine": machine_info()}
    print(save_results("packed", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())

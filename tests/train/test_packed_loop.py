"""model.retriever.pack_tokens through the real training loop (a Worker in this process, its negatives from
one real shard): with the dropout-free tiny BERT the packed towers give the padded run's losses and trained
weights up to fp32 rounding (other GEMM shapes), so the loop hands the forward the rows' host lengths."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.train.local_service import LocalService
from tests.train.test_entity_cache import FROZEN, _Run, process_group  # noqa: F401 (a fixture)
from tests.train.tinyrun import tiny_config


@pytest.mark.slow
def test_packed_training_equals_padded_training(tmp_path, tiny_model_dir, process_group, monkeypatch):
    from dist_nce.modeling import packed as packed_module
    from dist_nce.train.data import ensure_prepared
    from dist_nce.train.model import build_retriever

    calls = []
    real_forward = packed_module.forward

    def counted(model, ids, packing, token_type_ids=None):
        calls.append(packing.tokens)
        return real_forward(model, ids, packing, token_type_ids)

    monkeypatch.setattr(packed_module, "forward", counted)

    base = tiny_config(tmp_path, tiny_model_dir, tmp_path / "prep", *FROZEN)
    ensure_prepared(base.data, tiny_model_dir, log=lambda s: None)
    service = LocalService(base.data.prepared_dir, base.model.retriever, base.service, str(tmp_path / "shards"),
                           build_retriever(base.model, base.optim.seed).entity_encoder_state())
    outs = {}
    for pack in (False, True):
        cfg = tiny_config(tmp_path, tiny_model_dir, tmp_path / f"pack_{pack}", *FROZEN,
                          f"model.retriever.pack_tokens={str(pack).lower()}")
        assert cfg.model.retriever.pack_tokens is pack
        outs[pack] = _Run(cfg, service, 0, 1, "cpu").run()
        assert len(calls) == (8 if pack else 0)  # 4 steps x 2 towers packed, none padded
    padded, packed = outs[False], outs[True]
    assert padded["done"] and packed["done"] and len(packed["losses"]) == 4
    np.testing.assert_allclose(packed["losses"], padded["losses"], rtol=1e-4, atol=1e-5)
    moved = 0
    start = build_retriever(base.model, base.optim.seed).state_dict()
    for name, w in padded["weights"].items():
        torch.testing.assert_close(packed["weights"][name], w, rtol=1e-3, atol=1e-5, msg=name)
        moved += not torch.equal(w, start[name])
    assert moved  # it trained

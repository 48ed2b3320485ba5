"""A small run directory laid out as jobs/aida_finetune.py exports one, without training.

For tests and ``python -m benchmarks.link --quick``: a synthetic KILT KB and AIDA files
(``kb.synthetic``), the prepared store (``kb.prepare``), a retriever built from a model
directory (with seeded noise on its weights: a random tiny BERT maps every text to
nearly the same vector, so rankings would be near-ties), its KB embeddings encoded by
the shards' own loop (``index.encode.encode_rows``), persisted as one shard version and
exported with ``index.export.export_snapshot``, and a ``summary.json`` whose config names
the store, as the trainer's does. Building it takes seconds with the tiny BERT.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from dist_nce.core.artifacts import atomic_write_json
from dist_nce.core.config import to_dict
from dist_nce.index.encode import encode_rows, state_fingerprint, store_fingerprint
from dist_nce.index.export import export_snapshot
from dist_nce.index.versions import PersistedVersions, shard_dir_name
from dist_nce.modeling.retriever import Retriever, RetrieverConfig


def _perturb(module: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def make_tiny_run(root: str | os.PathLike, model_dir: str, num_entities: int = 60, num_dev: int = 12,
                  preset: str = "dual", m: int | None = None, seed: int = 0, mention_max_len: int = 32,
                  entity_max_len: int = 32) -> Path:
    """Write ``<root>/data`` (synthetic files, prepared store) and ``<root>/run``; return the run dir.

    The run holds ``model/``, ``shards/shard-000-of-001/v00000000``, ``kb_snapshot/`` and
    ``summary.json`` with ``config.data.prepared_dir`` and ``config.service``.
    """
    from kb.prepare import PrepareConfig, prepare
    from kb.store import EntityStore
    from kb.synthetic import write_kilt

    from dist_nce.train.config import TrainJobConfig

    root = Path(root)
    src = write_kilt(root / "data" / "synthetic", num_entities, 4, num_dev, 0, seed=seed)
    prepared = root / "data" / "prepared"
    prepare(PrepareConfig(out=str(prepared), kilt_ks=str(src["kb"]), aida_dir=str(root / "data" / "synthetic"),
                          model_dir=model_dir, entity_max_len=entity_max_len, mention_max_len=mention_max_len,
                          progress=False), log=lambda _: None)
    store = EntityStore(prepared)
    run = root / "run"
    torch.manual_seed(seed)
    config = RetrieverConfig(preset=preset, m=m, mention_model=model_dir, storage_dtype="float32")
    retriever = Retriever.build(config).eval()
    _perturb(retriever, seed)
    retriever.save_pretrained(run / "model")
    state = retriever.entity_encoder_state()
    reps = encode_rows(retriever.entity_side, store, 64, torch.device("cpu"), None, config.storage_dtype)
    n = store.num_entities
    versions = PersistedVersions(run / "shards" / shard_dir_name(0, 1),
                                 {"rows": [0, n], "store_fingerprint": store_fingerprint(str(prepared))})
    versions.save(0, reps, encoder_fingerprint=state_fingerprint(state))
    export_snapshot(run / "kb_snapshot", store, [((0, n), versions.path(0))], version=0,
                    model=str(run / "model"), retriever=to_dict(config))
    job = TrainJobConfig()
    job.data.prepared_dir = str(prepared.resolve())
    job.model.retriever = config
    job.run.output_dir = str(run.resolve())
    job.service.num_shards = 2
    job.service.num_cpus = 0.25
    atomic_write_json(run / "summary.json", {"config": to_dict(job), "done": True, "index_version": 0})
    return run


def make_tiny_reranker(out: str | os.PathLike, model_dir: str, max_len: int = 64, seed: int = 0) -> Path:
    """A reranker (random tiny BERT + noise, so its scores are spread) saved to ``out``."""
    from dist_nce.core.text import load_tokenizer
    from dist_nce.modeling.encoder import load_transformer
    from dist_nce.modeling.reranker import Reranker, RerankerConfig

    torch.manual_seed(seed)
    reranker = Reranker(RerankerConfig(model=model_dir, max_len=max_len), load_transformer(model_dir),
                        load_tokenizer(model_dir)).eval()
    _perturb(reranker, seed + 1)
    reranker.save_pretrained(out)
    return Path(out)

"""One tiny exported run (synthetic KILT KB of 60 entities, 12 dev mentions, random tiny BERT)
for every test of tests/link; read-only: a test that changes it copies it first."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model_dir):
    from dist_nce.link.tiny_run import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("link_run"), tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory, tiny_model_dir):
    from dist_nce.link.tiny_run import make_tiny_reranker

    return make_tiny_reranker(tmp_path_factory.mktemp("link_reranker") / "reranker", tiny_model_dir)


@pytest.fixture(scope="session")
def dev_file(tiny_run):
    return tiny_run.parent / "data" / "synthetic" / "aidayago2-dev-kilt.jsonl"


@pytest.fixture(scope="session")
def blink_files(tmp_path_factory):
    """(biencoder, cross-encoder): tiny checkpoints in BLINK's released layouts (legacy
    LayerNorm names), for linking with no run over the tiny run's prepared store."""
    from tests.blink_helpers import write_blink_biencoder, write_blink_crossencoder

    root = tmp_path_factory.mktemp("blink_files")
    return (write_blink_biencoder(root / "biencoder_wiki_large.bin", seed=3),
            write_blink_crossencoder(root / "crossencoder_wiki_large.bin", seed=5))


@pytest.fixture(scope="session")
def tiny_store(tiny_run):
    return tiny_run.parent / "data" / "prepared"

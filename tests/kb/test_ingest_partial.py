"""kb.ingest.run_chunks starts by removing what a killed worker was half-way through writing."""
from __future__ import annotations

from kb.ingest import run_chunks


def test_partial_outputs_of_a_killed_run_are_removed(tmp_path):
    work = tmp_path / "chunks"
    work.mkdir()
    partial = work / ".entities-000-000003.arrow.k2j4h1.tmp"  # the name dist_nce.core.artifacts.atomic_path uses
    partial.write_bytes(b"\0" * 100)
    done = work / "entities-000-000001.arrow"
    done.write_bytes(b"kept")
    assert run_chunks([], work, lambda t: {}, progress=False, log=lambda s: None) == []
    assert not partial.exists() and done.read_bytes() == b"kept"

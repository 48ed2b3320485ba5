"""Export an encoded KB in the layout FAISS and BLINK users load directly.

``<out>/`` after :func:`export_snapshot`::

    embeddings.npy   float32 (or float16) [N, d] for dual/poly, [N, m, d] for multi-m/genpoly,
                     [N, T, d] for SOM; row i is entity row i of the prepared store;
                     padded positions are zero
    mask.npy         bool [N, m] / [N, T], True = real position (multi-vector presets only)
    ids.txt          the entities' source ids (KILT wikipedia_id, Zeshel document_id, ...),
                     one per line, in row order
    embeddings.t7    optional (``blink_t7``): the same float32 matrix as a torch tensor,
                     ``torch.save``-d, which BLINK's ``build_faiss_index.py`` reads as
                     ``--candidate_encoding`` (an export format for BLINK; load it with
                     ``torch.load(path, weights_only=True)``)
    manifest.json    kind "embedding_snapshot": shapes, dtype, model, encoder and store
                     fingerprints, the per-shard version directories it was made from

For example ``index = faiss.IndexFlatIP(d); index.add(np.load("embeddings.npy"))``.
The matrix is filled shard by shard through a memory map, so the export never holds
more than one shard's embeddings in memory (except the optional .t7 copy). Every file
is written atomically and the manifest last: a directory with a manifest is complete.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dist_nce.core.artifacts import atomic_path, write_manifest
from dist_nce.index.versions import EMBEDDINGS_FILE
from kb.store import EntityStore

KIND = "embedding_snapshot"
SCHEMA_VERSION = 1
EXPORT_DTYPES = {"float32": np.float32, "float16": np.float16}
IDS_CHUNK = 1 << 16


def _load_part(version_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(version_dir / EMBEDDINGS_FILE))


def export_snapshot(out: str | os.PathLike, store: EntityStore, parts: Sequence[tuple[tuple[int, int], Path]],
                    dtype: str = "float32", blink_t7: bool = False, **fields: Any) -> dict:
    """Write the layout of the module docstring from per-shard version directories.

    store: the ``EntityStore`` the rows index; parts: ((a, b), version directory) covering
    [0, N) in order (``versions.PersistedVersions.path``); ``fields`` go into the manifest.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {list(EXPORT_DTYPES)}, got {dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = store.num_entities
    bounds = [r for r, _ in parts]
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != n or any(
            b[1] != c[0] for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"export: shard ranges {bounds} do not tile the store's {n} rows")
    first = _load_part(parts[0][1])
    trailing, has_mask = tuple(first["vecs"].shape[1:]), "mask" in first
    shape = (n, *trailing)
    with contextlib.ExitStack() as stack:
        tmp_vecs = stack.enter_context(atomic_path(out / "embeddings.npy"))
        vecs = np.lib.format.open_memmap(tmp_vecs, mode="w+", dtype=EXPORT_DTYPES[dtype], shape=shape)
        mask = None
        if has_mask:
            tmp_mask = stack.enter_context(atomic_path(out / "mask.npy"))
            mask = np.lib.format.open_memmap(tmp_mask, mode="w+", dtype=np.bool_, shape=shape[:-1])
        for i, ((a, b), version_dir) in enumerate(parts):
            part = first if i == 0 else _load_part(version_dir)
            if tuple(part["vecs"].shape) != (b - a, *trailing) or ("mask" in part) != has_mask:
                raise ValueError(f"{version_dir}: embeddings {list(part['vecs'].shape)} do not fit rows "
                                 f"[{a}, {b}) x {list(trailing)}")
            vecs[a:b] = part["vecs"].float().numpy()
            if mask is not None:
                mask[a:b] = part["mask"].numpy()
        for memmap in (vecs, mask):
            if memmap is not None:
                memmap.flush()
        del vecs, mask  # close the maps before the renames
    with atomic_path(out / "ids.txt") as tmp, open(tmp, "w", encoding="utf-8") as f:
        for a in range(0, n, IDS_CHUNK):
            ids = store.source_ids(np.arange(a, min(a + IDS_CHUNK, n)))
            f.write("".join(f"{i}\n" for i in ids))
    files = {"embeddings": "embeddings.npy", "ids": "ids.txt"}
    if has_mask:
        files["mask"] = "mask.npy"
    if blink_t7:
        matrix = torch.from_numpy(np.load(out / "embeddings.npy", mmap_mode="r").astype(np.float32))
        with atomic_path(out / "embeddings.t7") as tmp:
            torch.save(matrix, tmp)
        files["blink_t7"] = "embeddings.t7"
    return write_manifest(out, KIND, SCHEMA_VERSION, num_entities=n, shape=list(shape), dtype=dtype,
                          files=files, parts=[{"rows": list(r), "dir": str(p)} for r, p in parts], **fields)

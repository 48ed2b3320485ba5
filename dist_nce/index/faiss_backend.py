"""FAISS maximum-inner-product search for one shard: flat, IVF, HNSW; CPU or GPU.

The index holds M vectors with an owner each (``scoring.flatten_for_mips``): one per
entity for dual, up to m per entity for multi-m. :func:`search_entities` returns the
top k ENTITIES: hits are grouped by owner keeping the best (the first, since faiss
returns hits best first), and the fetch is enlarged until k distinct eligible entities
are found or nothing more can come back.

Storage: fp32 (``Flat``) or fp16 (``SQfp16``: faiss decodes each fp16 code to fp32 and
takes the dot product with the fp32 query, i.e. the exact score of the fp16-rounded
vectors up to summation order: within 1e-5 of them, 3e-3 of fp32, in
benchmarks/search.py). On CPU SQfp16 halves memory but costs speed (no BLAS: ~0.3x
of flat fp32 there). On GPU, flat fp16 is a GpuIndexFlat with fp16 storage (faiss has
no GPU flat SQ); HNSW has no faiss GPU implementation and stays on the CPU.

Callers search from processes that applied ``dist_nce.cluster.runtime.configure_faiss()``
(faiss otherwise skips BLAS for batches under 128000 queries).
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dist_nce.cluster.runtime import require_faiss
from dist_nce.sampling.topk import first_occurrence, isin_rows

FAISS_GPU_MAX_K = 2048  # faiss GPU k-selection limit


def factory_string(kind: str, storage: str, nlist: int, hnsw_m: int) -> str:
    """The ``faiss.index_factory`` description of an index kind and storage."""
    codes = {"fp32": "Flat", "fp16": "SQfp16"}
    if storage not in codes:
        raise ValueError(f"faiss storage must be one of {sorted(codes)}, got {storage!r}")
    if kind == "flat":
        return codes[storage]
    if kind == "ivf":
        return f"IVF{nlist},{codes[storage]}"
    if kind == "hnsw":
        return f"HNSW{hnsw_m},{codes[storage]}"
    raise ValueError(f"faiss index kind must be 'flat', 'ivf' or 'hnsw', got {kind!r}")


def build_index(vectors: np.ndarray, kind: str, storage: str, *, nlist: int = 1024, hnsw_m: int = 32,
                ef_construction: int = 200, train_rows: int = 0, seed: int = 0,
                gpu_device: int | None = None) -> tuple[Any, Any]:
    """Build an inner-product index over ``vectors`` [M, d] float32.

    ``train_rows`` > 0 trains IVF on that many uniformly sampled rows (else on all).
    ``gpu_device``: clone to that GPU (flat, IVF); returns (index, gpu_resources or None),
    the resources must stay alive as long as the index.
    """
    faiss = require_faiss()

    if vectors.ndim != 2 or vectors.dtype != np.float32:
        raise ValueError(f"build_index: vectors must be float32 [M, d], got {vectors.dtype} {vectors.shape}")
    n, d = vectors.shape
    on_gpu = gpu_device is not None and kind != "hnsw"
    # GPU flat fp16 = fp32 flat cloned with fp16 storage (no GPU IndexScalarQuantizer).
    cpu_storage = "fp32" if (on_gpu and kind == "flat") else storage
    index = faiss.index_factory(d, factory_string(kind, cpu_storage, nlist, hnsw_m), faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        index.hnsw.efConstruction = ef_construction
    if kind == "ivf":
        if n < nlist:
            raise ValueError(f"build_index: IVF with nlist={nlist} needs at least that many vectors, "
                             f"the shard has {n}; lower nlist")
        train = vectors
        if 0 < train_rows < n:
            train = vectors[np.sort(np.random.default_rng(seed).choice(n, train_rows, replace=False))]
        index.train(train)
    elif not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    if not on_gpu:
        return index, None
    res = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    options.useFloat16 = storage == "fp16"
    return faiss.index_cpu_to_gpu(res, gpu_device, index, options), res


def preallocated_flat(n: int, d: int, storage: str) -> Any:
    """An exact inner-product index (Flat or SQfp16 codes) already sized for n rows, to be
    filled in place through :func:`faiss_storage_view`: the vectors then exist once,
    where ``build_index`` holds the caller's array and faiss's copy at the same time."""
    faiss = require_faiss()

    index = faiss.index_factory(d, factory_string("flat", storage, 1, 1), faiss.METRIC_INNER_PRODUCT)
    index.codes.resize(n * index.code_size)
    index.ntotal = n
    return index


def search_params(kind: str, on_gpu: bool, nprobe: int, ef_search: int, fetch: int) -> Any:
    """Per-call search parameters (thread-safe, unlike mutating the index)."""
    faiss = require_faiss()

    if kind == "ivf" and not on_gpu:
        return faiss.SearchParametersIVF(nprobe=nprobe)
    if kind == "hnsw":  # HNSW returns at most efSearch results
        return faiss.SearchParametersHNSW(efSearch=max(ef_search, fetch))
    return None


def set_gpu_nprobe(index: Any, nprobe: int) -> None:
    """GPU IVF takes nprobe as an index property."""
    faiss = require_faiss()

    faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)


def search_entities(index: Any, queries: np.ndarray, k: int, owners: Tensor, exclude: Tensor,
                    params_for=None, max_fetch: int | None = None, dead: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """Top k distinct entities per query, by their best vector's inner product.

    Args:
        index: faiss index over M vectors; ``owners`` [M] int64 maps vector -> local entity.
        queries: [B, d] float32.
        exclude: [B, e] int64 local entity rows never to return (gold; -1 = none).
        params_for: ``fetch -> faiss SearchParameters | None``.
        max_fetch: cap on the vectors fetched per query (GPU k limit).
        dead: optional int64 local entity rows never to return for any query (entities a KB
            delta removed); the fetch grows past them like past the gold.
    Returns:
        (entities [B, k] int64 local rows, -1 when fewer were found; scores [B, k] float32,
        -inf in empty slots), each row best first.
    """
    if queries.ndim != 2 or queries.shape[1] != index.d:
        raise ValueError(f"search_entities: queries must be [B, {index.d}], got {list(queries.shape)}")
    batch, total = queries.shape[0], index.ntotal
    per_entity = int(torch.bincount(owners).max()) if owners.numel() else 1
    limit = min(total, max_fetch or total)
    ents = torch.full((batch, k), -1, dtype=torch.int64)
    scores = torch.full((batch, k), float("-inf"), dtype=torch.float32)
    todo = np.arange(batch)
    # Enough for k entities when each has one vector; multi-vector rows usually need ~2x.
    fetch = min(limit, (k + exclude.shape[1]) * min(per_entity, 2))
    while len(todo) and fetch > 0:
        params = params_for(fetch) if params_for else None
        dist, hits = index.search(np.ascontiguousarray(queries[todo]), fetch, params=params)
        hits_t = torch.from_numpy(hits)
        ent = torch.where(hits_t >= 0, owners[hits_t.clamp(min=0)], -1)
        keep = (hits_t >= 0) & first_occurrence(ent) & ~isin_rows(ent, exclude[torch.from_numpy(todo)])
        if dead is not None:
            keep &= ~torch.isin(ent, dead)
        found = keep.sum(dim=1)
        pos = torch.where(keep, torch.arange(fetch), fetch).sort(dim=1).values[:, :k]
        got = pos < fetch
        width = pos.shape[1]
        rows = torch.from_numpy(todo)
        ents[rows, :width] = torch.where(got, ent.gather(1, pos.clamp(max=fetch - 1)), -1)
        scores[rows, :width] = torch.where(got, torch.from_numpy(dist).gather(1, pos.clamp(max=fetch - 1)),
                                           float("-inf"))
        # A row is final once it has k entities, or faiss returned fewer hits than asked
        # (e.g. IVF probed lists exhausted), or the fetch already covers everything allowed.
        exhausted = (hits_t < 0).any(dim=1) | (fetch >= limit)
        todo = todo[(~((found >= k) | exhausted)).numpy()]
        fetch = min(limit, 2 * fetch)
    return ents, scores


def faiss_storage_view(index, n: int, d: int, dtype: torch.dtype) -> Tensor | None:
    """Zero-copy [n, d] ``dtype`` tensor over a CPU faiss index's own row-ordered codes.

    Flat (fp32 codes) and SQfp16 (fp16 codes) store row i at bytes [i*c, (i+1)*c), c the
    code size; HNSW keeps such an index as its ``storage``. Returns None for any other
    layout. The tensor keeps ``index`` alive (tensor -> numpy -> ctypes buffer -> index;
    pass the index object that owns the C++ index), so it stays valid even if the caller
    drops the index first.
    """
    faiss = require_faiss()

    owner = index  # the Python object that owns the C++ index (a downcast proxy does not)
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexHNSW):
        index = faiss.downcast_index(index.storage)
    if isinstance(index, faiss.IndexScalarQuantizer):
        if index.sq.qtype != faiss.ScalarQuantizer.QT_fp16 or dtype != torch.float16:
            return None
    elif not (isinstance(index, faiss.IndexFlat) and dtype == torch.float32):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if n == 0 or index.ntotal != n or index.d != d or index.codes.size() != n * d * itemsize:
        return None
    address = faiss.rev_swig_ptr(index.codes.data(), 1).ctypes.data
    buffer = (ctypes.c_uint8 * (n * d * itemsize)).from_address(address)
    buffer.owner = owner  # the numpy array below references buffer, the tensor the array
    numpy_dtype = np.float16 if dtype == torch.float16 else np.float32
    return torch.from_numpy(np.frombuffer(buffer, dtype=numpy_dtype).reshape(n, d))

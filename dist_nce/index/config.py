"""A shard index's configuration (the ``index`` section of the service config): backend,
storage and compute precision, the Gumbel mode and sampler, chunk and block sizes.
What each choice does is said in :mod:`dist_nce.index.search`."""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, Range, check_fields

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _help(text: str, default, bounds: Range | None = None):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    return dataclasses.field(default=default, metadata={"help": text, **({"range": bounds} if bounds else {})})


def _splits_on_grid(n: int, parts: int, grid: int) -> bool:
    """Whether ``actors.service.even_ranges(n, parts, grid)`` gives ``parts`` non-empty ranges
    (the same cuts: each inner boundary at the grid multiple nearest the even split)."""
    cuts = [0] + [min(n, (i * n // parts + grid // 2) // grid * grid) for i in range(1, parts)] + [n]
    return all(a < b for a, b in zip(cuts, cuts[1:]))


@dataclasses.dataclass
class IndexConfig:
    """How a shard searches its entities."""

    backend: Literal["torch", "flat", "ivf", "hnsw"] = _help(
        "torch: exact, any preset; flat: faiss exact MIPS; ivf/hnsw: faiss approximate MIPS", "flat")
    storage: Literal["fp32", "fp16", "bf16"] = _help(
        "dtype the entity vectors are kept in (faiss: fp32 or fp16 only)", "fp32")
    compute: Literal["fp32", "fp16", "bf16"] = _help(
        "torch matmul dtype of the exact path (bf16/fp16 are for GPUs; bf16 is also fast on recent CPUs)", "fp32")
    score_dtype: Literal["fp32", "bf16"] = _help(
        "exact scoring precision. bf16: entity vectors stored bf16 (half the bytes), queries rounded to "
        "bf16, products summed in fp32 (each product of two bf16 values is exact in fp32) and scores kept "
        "fp32; sets storage and compute (leave those at fp32). torch backend only", "fp32")
    device: str = _help("torch device of the exact path: auto (cuda if available), cpu, cuda, cuda:1", "auto")
    faiss_gpu: Literal["auto", "on", "off"] = _help(
        "put the faiss flat/IVF index on the GPU: auto = when faiss sees a GPU and device is cuda", "auto")
    gumbel: Literal["auto", "exact", "candidates"] = _help(
        "Gumbel-top-k: exact brute force over all rows, or within the backend's top `candidates`", "auto")
    sampler: Literal["auto", "dense", "block"] = _help(
        "exact Gumbel-top-k sampler: dense draws one Gumbel per (query, row) (the reference); block draws "
        "each block's maximum, keeps the K-1 best blocks and draws rows only inside them (same law, noise "
        "for N/block_rows + (K-1)*block_rows rows per query; dist_nce/sampling/block_gumbel.py); auto (the "
        "default) = block wherever it applies, i.e. the exact Gumbel mode (any backend and preset) with "
        "chunk_rows 0 or a multiple of block_rows, else dense: in candidates mode (ivf/hnsw by default) no "
        "exact sampler runs, and a chunk_rows block_rows does not divide keeps dense rather than raising "
        "(IndexConfig.resolved_sampler). Under auto a KB too small to put num_shards boundaries on the "
        "block_rows grid is split evenly instead: the same law, but its sharded draws are not the flat draw "
        "bit for bit (IndexConfig.row_grid). On an H200 the dense sampler took 17-19x a plain GEMM + top-k "
        "over 5.9M bf16 rows", "auto")
    kernel: Literal["auto", "native", "triton", "torch"] = _help(
        "exact search over dual reps (the block sampler and top-k). native = a fused CPU kernel whose scores "
        "never leave the core (dist_nce/kernels/native): AVX512-BF16 for score_dtype bf16 where the CPU has it, "
        "else AVX2+FMA for fp32 or bf16 rows (on bf16 rows both compute the same bits); triton = one GEMM and "
        "one fused Triton reduction per chunk (dist_nce/sampling/block_fused.py; interpreted on a CPU, for "
        "tests); torch = chunked GEMM then torch reductions; auto = triton on CUDA devices, native where the "
        "CPU flags and a C compiler allow (DIST_NCE_NATIVE=off and DIST_NCE_NATIVE_MASK rule kernels out), "
        "else torch. Same law, different float rounding, so runs that must repeat draws bit for bit across "
        "machines should pin it", "auto")
    block_rows: int = _help(
        "rows per block of the block sampler, on a global grid; must divide chunk_rows. sqrt(N/(K-1)) "
        "minimises the noise drawn. Sharded == flat bit for bit when every shard starts on this grid", 128,
        AT_LEAST_1)
    candidates: int = _help("N, rows retrieved per query before Gumbel in candidates mode", 1024, AT_LEAST_1)
    tail_sample: int = _help("rows sampled uniformly to estimate the softmax mass outside the candidates", 1024,
                             AT_LEAST_1)
    chunk_rows: int = _help(
        "entities per block on the exact path; blocks follow a global grid, so keep it equal across shards "
        "for bit-identical Gumbel samples (SOM: a block materialises chunk_rows x T x d). 0 = auto: 8192 on "
        "a CPU, on a GPU a [B, chunk] fp32 score chunk of ~512 MB and at most 2 GB of entity vectors, divided by "
        "the vectors per entity row (T for SOM, m for multi-m) (index.exact.auto_chunk_rows)", 0, AT_LEAST_0)
    nlist: int = _help("IVF lists", 1024, AT_LEAST_1)
    nprobe: int = _help("IVF lists probed per query", 32, AT_LEAST_1)
    ivf_train_rows: int = _help("rows IVF k-means trains on (0 = all)", 0, AT_LEAST_0)
    hnsw_m: int = _help("HNSW graph degree", 32, AT_LEAST_1)
    ef_construction: int = _help("HNSW build beam", 200, AT_LEAST_1)
    ef_search: int = _help("HNSW search beam (raised to the fetch size when smaller)", 128, AT_LEAST_1)
    seed: int = _help("seed of index construction (IVF training sample)", 0, AT_LEAST_0)

    def validate(self) -> None:
        check_fields(self, "index")  # the loader did already; direct constructions did not
        if self.backend != "torch" and self.storage == "bf16":
            raise ValueError("index.storage bf16 is torch-only; faiss stores fp32 or fp16")
        if self.score_dtype == "bf16":
            if self.backend != "torch":
                raise ValueError(f"index.score_dtype bf16 needs backend 'torch' (faiss stores fp32 or fp16), got "
                                 f"{self.backend!r}")
            if self.storage not in ("fp32", "bf16") or self.compute != "fp32":
                raise ValueError("index.score_dtype bf16 sets the storage (bf16) and the GEMM (bf16 values, fp32 "
                                 f"sums): leave index.storage and index.compute at fp32, got {self.storage}/"
                                 f"{self.compute}")
        if self.sampler == "block" and self.chunk_rows and self.chunk_rows % self.block_rows:
            raise ValueError(f"index.block_rows ({self.block_rows}) must divide index.chunk_rows "
                             f"({self.chunk_rows}) with sampler 'block'")

    def storage_dtype(self) -> torch.dtype:
        """dtype the entity vectors are held in (``score_dtype`` bf16 overrides ``storage``)."""
        return torch.bfloat16 if self.score_dtype == "bf16" else DTYPES[self.storage]

    def resolved_sampler(self) -> str:
        """The exact sampler that runs: ``sampler`` itself unless it is "auto", which is "block"
        (same law as "dense", at about top-k cost) wherever the block sampler applies and "dense"
        where it cannot: in candidates mode (``gumbel_mode()``; no exact sampler runs there, and
        shards keep a row grid of 1) and where ``chunk_rows`` is set but not a multiple of
        ``block_rows`` (an explicit "block" raises there; auto falls back)."""
        if self.sampler != "auto":
            return self.sampler
        if self.gumbel_mode() != "exact":
            return "dense"
        if self.chunk_rows and self.chunk_rows % self.block_rows:
            return "dense"
        return "block"

    def row_grid(self, num_rows: int | None = None, num_shards: int | None = None) -> int:
        """Rows a shard boundary must be a multiple of: ``block_rows`` for the block sampler
        (its blocks must not straddle shards for sharded == flat bit for bit), else 1.

        With ``num_rows`` and ``num_shards`` (the service's even split of version-0 rows) and
        ``sampler`` "auto": 1 when ``num_rows`` cannot be cut into ``num_shards`` non-empty ranges
        on the block grid (a KB of fewer than about ``num_shards * block_rows`` rows). The block
        sampler then still draws the exact law, each shard's partial blocks as pieces of their own,
        but not the flat draw bit for bit; an explicit "block" keeps the grid (and such a KB is
        refused by ``actors.service.even_ranges``)."""
        if self.resolved_sampler() != "block":
            return 1
        if self.sampler == "auto" and num_rows is not None and num_shards \
                and not _splits_on_grid(int(num_rows), int(num_shards), self.block_rows):
            return 1
        return self.block_rows

    def gumbel_mode(self) -> str:
        if self.gumbel != "auto":
            return self.gumbel
        return "candidates" if self.backend in ("ivf", "hnsw") else "exact"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

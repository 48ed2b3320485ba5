"""Configuration of the sharded negative service (EntityShard actors + NegativeService)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, check_fields
from dist_nce.index.config import IndexConfig

# Ray's convention for restarts and retries.
_RAY_COUNT = Range(ge=-1, why="-1 = without limit")


def _help(text: str, bounds: Range | None = None, **kw):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    return field(metadata={"help": text, **({"range": bounds} if bounds else {})}, **kw)


@dataclass
class ServiceConfig:
    num_shards: int = _help("EntityShard actors the KB rows are split into (evenly, contiguous ranges; with "
                            "the block sampler (index.sampler block, or auto where it resolves to block), "
                            "boundaries on the index.block_rows grid; under auto a KB too small for that grid "
                            "is split evenly).",
                            AT_LEAST_1, default=2)
    num_cpus: float = _help("CPUs reserved per shard actor (fractional allowed).", AT_LEAST_0, default=0.5)
    num_gpus: float = _help("GPUs per shard actor; fractional values share a GPU with trainers.", AT_LEAST_0,
                            default=0.0)
    resources: dict[str, float] = _help(
        "Custom Ray resources each shard actor requires, e.g. {kb_shard: 1} to place shards on dedicated "
        "nodes started with --resources='{\"kb_shard\": N}'. Shards are SPREAD over the nodes that have them.",
        AT_LEAST_0, default_factory=dict)
    threads: int = _help("Intra-op threads of each shard process (encode and search).", AT_LEAST_1,
                        default=1)
    max_concurrency: int = _help("Concurrent calls per shard: searches keep running during a refresh.",
                                 Range(ge=2, why="searches must run during a refresh"), default=4)
    max_restarts: int = _help("Ray restarts of a dead shard actor (it reloads its last persisted version).",
                              _RAY_COUNT, default=3)
    max_task_retries: int = _help("Ray retries of a call whose shard died mid-call.", _RAY_COUNT,
                                  default=3)
    encode_batch_size: int = _help("Entities per encoder forward when a shard re-encodes its rows.",
                                   AT_LEAST_1, default=64)
    encode_dtype: Literal["auto", "fp32", "bf16", "fp16"] = _help(
        "Autocast dtype of re-encoding: auto = bf16 where the device has bf16 units (GPUs from Ampere on; CPUs "
        "with AVX512-BF16 or AMX-BF16), else fp32 (elsewhere bf16 is emulated, slower than fp32).",
        default="auto")
    encode_weights: Literal["auto", "fp32", "bf16"] = _help(
        "Dtype of the weights of each shard's entity encoder: fp32 = autocast to encode_dtype (weights cast "
        "in every GEMM, layer norms and residual sums in fp32); bf16 = weights held in bf16 and the whole "
        "forward in bf16, no autocast (needs encode_dtype auto or bf16); auto = bf16 on CUDA when "
        "encode_dtype resolves to bf16 there, else fp32. Refreshes cast the new weights on load.",
        default="auto")
    encode_compile: bool | Literal["auto"] = _help(
        "torch.compile each shard's entity encoder (index/encode.py compile_encoder; on CUDA layer by layer, "
        "the attention mask built eagerly): a compile on the shard's first encode; weights of later refreshes "
        "are swapped in without recompiling. Needs a C++ compiler on CPUs. auto = whichever measured faster "
        "on the device: on CUDA (H100, BERT-large: layers compiled 66.5% of the bf16 peak, eager 61.3%; "
        "benchmarks/results/gpu_encode.json), off on CPUs.", default="auto")
    encode_pack: bool = _help(
        "Re-encode packed (modeling.packed): only each batch's real tokens go through the encoder, attention "
        "by row offsets (FlashAttention varlen on CUDA; the encode attention over rows padded to the longest "
        "elsewhere). Not with encode_compile true (auto then means off); same vectors within rounding. Off by "
        "default: not measured on a GPU yet; on a 2-core CPU packed towers encoded in 0.81x the time, spreads "
        "overlapping (benchmarks/results/packed.json).",
        default=False)
    encode_attention: Literal["auto", "native", "model"] = _help(
        "Attention of re-encoding: auto = the native bf16 kernel (index/attention.py) when the encode runs "
        "in bf16 on a CPU with AVX512-BF16, else the model's own; native = that kernel or an error saying "
        "why not; model = the model's own (sdpa). Answers agree within bf16 rounding.", default="auto")
    shard_dir: Optional[str] = _help(
        "Directory where shards persist embedding versions (one sub-directory per shard and version).",
        default=None)
    keep_versions: int = _help("Persisted versions kept per shard (older ones are deleted).",
                          Range(ge=1, why="a restarted shard reloads the last one"), default=2)
    call_timeout_s: float = _help("Seconds before a shard call counts as failed and is retried.",
                                  POSITIVE, default=600.0)
    index: IndexConfig = _help("How each shard indexes and searches its rows.", default_factory=IndexConfig)

    def validate(self) -> None:
        # The loader has checked the ranges already; direct constructions reach here unchecked.
        check_fields(self, "service")
        if self.encode_pack and self.encode_compile is True:
            raise ValueError("service.encode_pack and service.encode_compile: true cannot both be on (a packed batch "
                             "has a new token count each time, a compile per batch); set encode_compile to auto "
                             "(off when packing) or false")
        if self.encode_weights == "bf16" and self.encode_dtype not in ("auto", "bf16"):
            raise ValueError(f"service.encode_weights bf16 runs the encode in bf16, but encode_dtype is "
                             f"{self.encode_dtype!r}; set encode_dtype auto or bf16, or encode_weights fp32")

"""Encode a shard's entity rows: the pure loop a shard runs on refresh, and fingerprints.

A refresh re-encodes every row a shard owns with the newest entity encoder. The rows
are visited in batches of similar length (sorted by token count, longest first), so a
batch pads to its own longest row rather than to the store's ``max_len``: on KILT,
where most descriptions are far shorter than 128 tokens, that is most of the work
saved. Results are scattered back to row order.

On CUDA a batch without padding (on KILT nearly every batch: most pages fill the 128 tokens) goes to
the transformer with no attention mask, so sdpa may run its flash kernel (:func:`encode_batch`).

An encoder compiled layer by layer (static shapes, :func:`compile_encoder`) gets a handful of batch
shapes instead of one per (batch, longest row): each batch's length is rounded up to one of at most
4 lengths and the last short batch is filled up to the batch size (:func:`static_batch_shape`); the
added positions are masked and the added rows dropped, so the reps are those of the plain path.

Reps come out with a fixed shape per row, whatever batch a row fell in: dual/poly
``[n, d]``; multi-m/genpoly-m ``[n, m, d]`` + mask; SOM ``[n, max_len, d]`` + mask (padded
back to the store width). Padded positions are zeroed, so the stored reps do not depend
on how rows were batched beyond floating-point rounding of the real positions.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from dist_nce.core.artifacts import MANIFEST, file_sha256
from dist_nce.modeling.retriever import EntityEncoder, _min_len, to_storage
from dist_nce.modeling.scoring import Reps, entity_reps
from kb.store import EntityStore

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_WEIGHTS = ("auto", "fp32", "bf16")
log = logging.getLogger(__name__)
_TOLD: set[str] = set()


def cpu_has_fast_bf16() -> bool:
    """Whether torch runs bf16 GEMMs on this CPU's bf16 units (oneDNN built in, and
    :func:`~dist_nce.kernels.build.bf16_units_missing` finds the units)."""
    from dist_nce.kernels.build import bf16_units_missing

    try:  # what torch itself consults before picking oneDNN bf16 kernels
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return onednn and bf16_units_missing() is None


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """``ServiceConfig.encode_dtype`` -> the autocast dtype on ``device`` (None = fp32).

    ``auto`` picks bf16 where the device runs it fast (CUDA with bf16 support; CPUs with
    AVX512-BF16/AMX, ~2.3x faster than fp32 for MiniLM here: :func:`cpu_has_fast_bf16`), else fp32.
    """
    if name == "auto":
        if device.type == "cuda":  # not emulated bf16 (V100, T4: torch answers yes there by default)
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else None
        return torch.bfloat16 if cpu_has_fast_bf16() else None
    if name not in _AUTOCAST:
        raise ValueError(f"encode_dtype must be one of auto, {', '.join(_AUTOCAST)}; got {name!r}")
    return _AUTOCAST[name]


class Precision(NamedTuple):
    """How a shard's encoder runs: the dtype its weights are held in, and the autocast dtype
    ``encode_rows`` runs under (None = off). From :func:`encode_precision`."""

    weights: torch.dtype
    autocast: torch.dtype | None

    @property
    def compute(self) -> torch.dtype | None:
        """The dtype of the matmuls (None = fp32): the autocast dtype, or that of the weights."""
        return self.autocast or (None if self.weights == torch.float32 else self.weights)

    @property
    def label(self) -> str:
        """``bfloat16``, ``float32``, ...: what a version's manifest records as ``encode_dtype``."""
        return str(self.compute or torch.float32).removeprefix("torch.")


def encode_precision(dtype: str, weights: str, device: torch.device) -> Precision:
    """``ServiceConfig.encode_dtype`` and ``encode_weights`` -> the :class:`Precision` of encodes on ``device``.

    ``encode_weights``: ``fp32`` keeps fp32 weights and autocasts to ``encode_dtype`` (every
    GEMM casts its weight, layer norms and residual sums stay fp32); ``bf16`` holds the weights
    in bf16 and runs the whole forward in bf16 without autocast (no casts; layer norms, GELU and
    residual sums read and write half the bytes); it needs ``encode_dtype`` auto or bf16.
    ``auto`` = bf16 on CUDA when ``encode_dtype`` resolves to bf16 there, else fp32: on a
    GPU the elementwise work between the GEMMs is memory bound, and fp32 activations double it.
    """
    if weights not in _WEIGHTS:
        raise ValueError(f"encode_weights must be one of {', '.join(_WEIGHTS)}; got {weights!r}")
    autocast = autocast_dtype(dtype, device)
    if weights == "bf16":
        if dtype not in ("auto", "bf16"):
            raise ValueError(f"encode_weights bf16 runs the encode in bf16, but encode_dtype is {dtype!r}; "
                             "set encode_dtype auto or bf16, or encode_weights fp32")
        return Precision(torch.bfloat16, None)
    if weights == "auto" and device.type == "cuda" and autocast is torch.bfloat16:
        return Precision(torch.bfloat16, None)
    return Precision(torch.float32, autocast)


def compile_wanted(setting: bool | str, device: torch.device, pack: bool = False) -> bool:
    """``ServiceConfig.encode_compile`` on ``device``: true, false, or ``auto`` = whichever measured faster
    there: on CUDA, compiled layer by layer (:func:`prepare_encoder`); on a CPU, off; off when the encode
    is packed (``pack``: ``ServiceConfig.encode_pack``; every packed batch has its own token count).

    CUDA (benchmarks/results/gpu_encode.json, H100, BERT-large T = 128, batch 512, torch 2.11,
    transformers 5.17): each layer compiled 6127 entities/s (66.5% of the same run's bf16 GEMM
    peak; its compile 2.9 s) against eager 5652/s (61.3%); the whole model compiled was slower
    than eager (3628/s against 5445/s in the first run: its graph ran the math attention over an
    in-graph all-True mask, see :func:`compile_encoder`). CPUs: compiling needs a C++ compiler and
    a minute; ``true`` opts in (64% against 59% of the CPU's bf16 peak, docs/benchmarks.md).
    """
    if setting == "auto":
        return device.type == "cuda" and not pack
    if isinstance(setting, bool):
        return setting  # true with pack: prepare_encoder refuses (ServiceConfig.validate did already)
    raise ValueError(f"encode_compile must be true, false or auto; got {setting!r}")


def prepare_encoder(encoder: EntityEncoder, precision: Precision, attention: str, compile: bool,
                    device: torch.device, layers: bool | None = None, pack: bool = False) -> str:
    """Ready an encoder built for encoding, in place, the way a shard runs it: on ``device``, its
    weights in ``precision.weights``, the attention of :func:`choose_attention`, compiled
    (:func:`compile_encoder`) if ``compile``: layer by layer (``layers``; default: on CUDA) or whole;
    packed (``modeling.packed`` over that attention; :func:`encode_rows` then packs every batch) if
    ``pack``, which excludes ``compile``. Returns the attention implementation.

    Call it outside inference mode (tensors made inside it cannot be updated in place later).
    ``EntityEncoder.load_state`` copies a refresh's weights into the held tensors, casting them
    to their dtype, so bf16 weights take later refreshes like fp32 ones (and a compiled graph
    sees them, its weights being graph inputs).
    """
    if pack and compile:
        raise ValueError("prepare_encoder: a packed encoder is not compiled (every batch has its own token count)")
    encoder.to(device=device, dtype=precision.weights)  # floating tensors only: ids buffers stay int64
    name = choose_attention(encoder, attention, device, precision.compute)
    if compile:
        compile_encoder(encoder, layers=device.type == "cuda" if layers is None else layers)
    if pack:
        encoder.encoder.use_packing("auto")
        name = str(encoder.encoder.model.config._attn_implementation)
    return name


def length_sorted_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Row positions grouped ``batch_size`` at a time by token count, longest first.

    Longest first puts the peak memory of a refresh at its very start, where an
    out-of-memory error costs nothing.
    """
    if batch_size < 1:
        raise ValueError(f"encode batch size must be >= 1, got {batch_size}")
    order = np.argsort(-lengths.astype(np.int64), kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _fixed_width(reps: Reps, width: int) -> Reps:
    """Pad [b, t, d] multi-vector reps (t <= width) to ``width`` positions; zero padding."""
    vecs, mask = reps
    if mask is None:
        return reps
    vecs = vecs.masked_fill(~mask.unsqueeze(-1), 0)
    t = vecs.shape[1]
    if t < width:
        vecs = torch.cat([vecs, vecs.new_zeros(vecs.shape[0], width - t, vecs.shape[2])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(mask.shape[0], width - t)], dim=1)
    return Reps(vecs, mask)


def static_batch_shape(rows: int, longest: int, batch_size: int, max_len: int, buckets: int = 4
                       ) -> tuple[int, int]:
    """(batch, length) that a batch of ``rows`` rows, its longest ``longest`` tokens, is padded to
    for an encoder compiled with static shapes (:func:`compile_encoder` ``layers=True``).

    rows: 1 <= rows <= batch_size; longest: >= 1; batch_size: rows per batch of the refresh, capped
    at the rows it encodes; max_len: the store's width (ids are [rows, max_len]).
    Returns batch = ``batch_size`` (the last short batch is filled up) and length = ``longest``
    rounded up to a multiple of step = ceil(max_len / buckets) rounded up to a multiple of 8, at most
    ``max_len``: so a refresh sees at most ``buckets`` lengths and one batch size (max_len 128: 32, 64,
    96, 128), whatever its rows' lengths, i.e. at most ``buckets`` graphs per attention-mask variant,
    within dynamo's recompile limit of 8.
    """
    if not 1 <= rows <= batch_size or longest < 1 or max_len < 1 or buckets < 1:
        raise ValueError(f"static_batch_shape: need 1 <= rows ({rows}) <= batch_size ({batch_size}), "
                         f"longest ({longest}) >= 1, max_len ({max_len}) >= 1, buckets ({buckets}) >= 1")
    step = -(-max_len // buckets)  # ceil(max_len / buckets) ...
    step = -(-step // 8) * 8  # ... rounded up to a multiple of 8
    return batch_size, min(max_len, -(-longest // step) * step)


def static_shapes(encoder: EntityEncoder) -> bool:
    """Whether ``encoder`` was compiled with static shapes (:func:`compile_encoder` ``layers=True``):
    :func:`encode_rows` then pads its batches to :func:`static_batch_shape`."""
    return bool(getattr(encoder, _STATIC, False))


_STATIC = "static_encode_shapes"


def transformer_layers(encoder: EntityEncoder) -> torch.nn.ModuleList | None:
    """The stack of transformer layers of ``encoder`` (BERT: ``model.encoder.layer``): its longest
    ``ModuleList``; None if it has none."""
    lists = [m for m in encoder.encoder.model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


def compile_encoder(encoder: EntityEncoder, layers: bool = False) -> EntityEncoder:
    """``torch.compile`` the transformer of ``encoder`` in place (``ServiceConfig.encode_compile``).

    Inductor fuses the elementwise work between the GEMMs (bias, GELU, residual add + layer norm,
    the autocast casts), which is what keeps a small encoder such as MiniLM well below the GEMM
    rate on a CPU. The weights stay graph inputs (no freezing), so ``EntityEncoder.load_state``
    swapping them in place is seen by the next forward without recompiling; ``state_dict`` keys
    are unchanged. The first forward pays the compile (needs a C++ compiler on CPUs).

    ``layers=False`` (CPUs): the whole model, ``dynamic=True``: one graph for every batch length.

    ``layers=True`` (what a CUDA shard does): each transformer layer (:func:`transformer_layers`)
    compiled with ``dynamic=False``, the embeddings, the attention mask and the pooler left eager.
    Why: (1) transformers (5.17) drops an all-True or absent mask for sdpa only outside tracing
    (``masking_utils._ignore_bidirectional_mask_sdpa``: ``is_tracing`` is true whenever dynamo
    compiles), so a whole-model graph builds the all-True mask itself and its sdpa ran the math
    backend (H100: a fused ``_safe_softmax ... arange ... ge`` kernel and fp32 GEMMs, 39% of the
    peak against 58.6% eager). Built eagerly, the mask of a batch without padding is None, and the
    compiled layers get none. (2) Inductor keeps the fused sdpa ops as extern kernels
    (``_inductor/lowering.py``: ``make_fallback(aten._scaled_dot_product_{flash,efficient,cudnn}_attention,
    sdpa_constraint)``; only ``_scaled_dot_product_flash_attention_for_cpu`` is decomposed,
    ``_inductor/decomposition.py``); which one is fixed when ``aten.scaled_dot_product_attention``
    is traced, from the sizes it sees: static sizes are the ones eager sees, so the compiled layer
    gets eager's kernel (cuDNN flash on an H100). (3) The layers share one graph (same code, weights
    as inputs: PyTorch's regional compilation), a compile of seconds rather than the whole model's
    47 s. Each new (batch, length) shape compiles again, up to dynamo's ``recompile_limit`` (8;
    shapes past it run eagerly): on an H200, 16,384 rows of 32-128 tokens in batches of 512 hit
    it, the first pass 18.1 s against 1.9 s warm. So the encoder is marked (:func:`static_shapes`)
    and :func:`encode_rows` pads each batch to :func:`static_batch_shape`: at most 4 lengths and one
    batch size, each with or without a mask (on CUDA a batch whose rows all fill its length has
    none), the added positions masked and the added rows dropped. Rows are visited longest first,
    so full-length batches, nearly all of a KILT shard, come first and share one graph.
    """
    stack = transformer_layers(encoder) if layers else None
    if stack is None:
        encoder.encoder.model.compile(dynamic=True)
        return encoder
    for layer in stack:
        layer.compile(dynamic=False)
    setattr(encoder, _STATIC, True)
    return encoder


def choose_attention(encoder: EntityEncoder, mode: str, device: torch.device, autocast: torch.dtype | None) -> str:
    """Apply ``ServiceConfig.encode_attention`` (auto | native | model) to an encoder built for
    encoding; returns the attention implementation its forward now uses (for manifests).
    ``autocast``: the dtype the encode computes in (``Precision.compute``; None = fp32).

    The native kernel (index/attention.py) only pays where encodes run in bf16 on a CPU; auto
    keeps the model's own attention elsewhere and logs why once per process.
    """
    if mode not in ("auto", "native", "model"):
        raise ValueError(f"service.encode_attention must be auto, native or model; got {mode!r}")
    if mode != "model":
        from dist_nce.kernels.attention import NAME, use_native_attention

        why = ("the encode does not run in bf16 on a CPU" if device.type != "cpu" or autocast is not torch.bfloat16
               else use_native_attention(encoder))
        if why is None:
            return NAME
        if mode == "native":
            raise ValueError(f"service.encode_attention: native: {why}")
        if why not in _TOLD:
            _TOLD.add(why)
            log.info("service.encode_attention auto: the model's own attention (%s)", why)
    return str(encoder.encoder.model.config._attn_implementation)


def encode_batch(encoder: EntityEncoder, ids: torch.Tensor, real: torch.Tensor, padded: bool = True,
                 trim: bool = True) -> Reps:
    """``encoder(ids, real)`` for one batch; ``padded=False`` promises that ``real`` is all True
    and then gives the transformer no attention mask at all. ``trim=False`` keeps the batch's
    padding columns (``EntityEncoder.trim_padding`` would cut them): the static shapes of
    :func:`static_batch_shape`; masked, they change the reps by rounding only.

    Why: sdpa's flash kernel takes no mask, so a mask sends it to the memory-efficient kernel
    (CUDA). transformers drops an all-True mask itself in eager mode (after a device-to-host
    check), but not while ``torch.compile`` traces: a compiled encoder would run every batch
    masked. Same reps as ``encoder(ids, real)`` (the rows are unpadded, trimming is a no-op).
    """
    if padded and trim:
        return encoder(ids, real)
    if padded:
        states, real = encoder.encoder(ids, real)
        return entity_reps(encoder.spec, states, real)
    states = encoder.encoder.model(input_ids=ids.long()).last_hidden_state
    return entity_reps(encoder.spec, states, real)


@torch.inference_mode()
def encode_rows(encoder: EntityEncoder, store: EntityStore, batch_size: int, device: torch.device,
                autocast: torch.dtype | None, storage_dtype: str,
                progress: Callable[[int], None] | None = None, fill_to: int | None = None) -> Reps:
    """Entity reps of every row of ``store`` (an ``EntityStore`` or a slice), in row order.

    ``store`` needs only ``num_entities``, ``max_len``, ``lengths(rows)`` and ``token_ids(rows)``.
    ``autocast``: ``Precision.autocast`` (None for fp32, and for an encoder holding bf16 weights).

    Returns Reps in ``storage_dtype`` on the CPU: vecs [n, d], [n, m, d] or [n, max_len, d]
    (see the module docstring), mask None or [n, m] / [n, max_len] bool. ``progress(k)`` is
    called with the number of rows finished after each batch. An encoder compiled with static
    shapes (:func:`static_shapes`) gets batches padded to :func:`static_batch_shape`; a packed one
    (:func:`prepare_encoder` ``pack``) gets each batch's rows with their lengths, and only their real
    tokens go through it.

    ``fill_to`` (static shapes only; default ``min(batch_size, n)``): the rows every batch is filled
    up to, and batches then hold at most that many. A shard passes its main refresh's batch when it
    encodes a KB delta's few rows, so a delta of any size reuses the refresh's graphs instead of
    compiling its own (one more (batch, length) family per distinct delta size, past dynamo's limit).
    """
    n = store.num_entities
    lengths = store.lengths(np.arange(n))
    width = _kept(encoder) or store.max_len  # positions per row when reps carry a mask
    static = static_shapes(encoder)
    packing = encoder.encoder.packing is not None  # prepare_encoder(pack=True)
    min_len = _min_len(encoder.spec, "entity") if static else 1  # columns a score reads by position
    if fill_to is not None and fill_to < 1:
        raise ValueError(f"encode_rows: fill_to must be >= 1, got {fill_to}")
    fill = min(batch_size, n) if fill_to is None else fill_to
    vecs = mask = None
    done = 0
    for pos in length_sorted_batches(lengths, min(batch_size, fill) if static and fill_to is not None else batch_size):
        longest = max(int(lengths[pos].max()), 1)
        tokens, lens = store.token_ids(pos), lengths[pos]
        if static:  # a handful of shapes: fill the batch up with copies of its first row, round the length up
            rows, longest = static_batch_shape(len(pos), max(longest, min_len), fill, store.max_len)
            first = np.zeros(rows - len(pos), dtype=np.int64)
            tokens, lens = np.concatenate([tokens, tokens[first]]), np.concatenate([lens, lens[first]])
        ids = torch.from_numpy(tokens[:, :longest]).to(device)
        real = torch.arange(longest, device=device)[None, :] < torch.from_numpy(lens).to(device)[:, None]
        # no mask for a batch without padding, on CUDA where it decides the attention kernel
        padded = device.type != "cuda" or int(lens.min()) < longest
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            if packing and int(lens.min()) >= 1:  # the host's lengths: real tokens only, nothing read back
                reps = encoder(ids, real, bool(int(lens.min()) < longest), torch.from_numpy(lens.astype(np.int64)))
            elif static:
                reps = encode_batch(encoder, ids, real, padded, trim=False)
            else:
                reps = encode_batch(encoder, ids, real, padded)
        if static:
            reps = Reps(reps.vecs[:len(pos)], None if reps.mask is None else reps.mask[:len(pos)])
        reps = to_storage(_fixed_width(Reps(reps.vecs.float(), reps.mask), width), storage_dtype)
        if vecs is None:
            vecs = torch.empty((n, *reps.vecs.shape[1:]), dtype=reps.vecs.dtype)
            mask = None if reps.mask is None else torch.empty((n, *reps.mask.shape[1:]), dtype=torch.bool)
        rows = torch.from_numpy(pos)
        vecs[rows] = reps.vecs.cpu()
        if mask is not None:
            mask[rows] = reps.mask.cpu()
        done += len(pos)
        if progress is not None:
            progress(done)
    if vecs is None:  # an empty slice: shape from the encoder's config
        d = encoder.encoder.hidden_size
        shape = (0, d) if width == 1 else (0, width, d)
        vecs = torch.empty(shape, dtype=getattr(torch, storage_dtype))
        mask = None if width == 1 else torch.empty(shape[:2], dtype=torch.bool)
    return Reps(vecs, mask)


def _kept(encoder: EntityEncoder) -> int | None:
    """Positions the entity side keeps: 1, m, or None (every token, SOM)."""
    reduction, count = encoder.spec.entity_side
    return None if reduction == "all" else count


def state_fingerprint(state: dict[str, Any]) -> str:
    """A digest of an entity-encoder state (``EntityEncoder.state()``): config, spec and every
    weight's name, dtype, shape and bytes. Two states with equal fingerprints encode alike.

    Hugging Face bookkeeping in the config (``_name_or_path``, ``transformers_version``, ...)
    is left out: it says where a model was loaded from, not how it encodes, and changes
    when a retriever is saved and loaded again.

    An fp32 weight whose every value is a bf16 value is digested as that bf16 tensor: a model
    trained with DeepSpeed bf16 publishes bf16 weights to the shards and is exported in fp32
    (``train.model.full_state_dict``), and the two hold the same numbers, so they encode alike.
    Without this, evaluating or linking with the export re-encoded the whole KB (seen on a GPU:
    1M entities encoded again instead of reusing the run's final version).
    """
    h = hashlib.blake2b(digest_size=16)
    config = {k: v for k, v in state["transformer_config"].items()
              if not k.startswith("_") and k != "transformers_version"}
    meta = {"config": config, **{k: state[k] for k in ("format", "spec", "trim_padding")}}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name in sorted(state["weights"]):
        t = state["weights"][name].detach().cpu().contiguous()
        if t.dtype == torch.float32:
            as_bf16 = t.to(torch.bfloat16)
            if torch.equal(as_bf16.float(), t):  # NaN never compares equal: such a tensor stays fp32
                t = as_bf16
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def store_fingerprint(store_dir: str) -> str:
    """The prepared store's identity: the sha256 of its manifest (which records its sources,
    tokenizer, counts and ingest run), so a re-prepared store never matches old embeddings.

    A store changed by KB deltas (``kb.delta``) keeps the identity of its lineage, the sha256
    of its manifest before the first delta: row ids never move within a lineage, so every
    embedding version persisted before a delta stays valid for the rows it covers (which KB
    version an artifact encodes is recorded beside this, as ``kb_version``).
    """
    import json
    from pathlib import Path

    path = Path(store_dir) / MANIFEST
    lineage = json.loads(path.read_text(encoding="utf-8")).get("lineage_sha256")
    return lineage or file_sha256(path)

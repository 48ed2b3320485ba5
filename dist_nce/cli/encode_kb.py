"""Encode a whole prepared KB with an entity encoder, through the EntityShard actors.

A dist-nce retriever directory (``Retriever.save_pretrained``)::

    .venv/bin/python jobs/encode_kb.py --prepared data/kilt_minilm --model runs/aida/retriever \
        --out data/embeddings/aida --num-shards 4

BLINK's released biencoder (architecture read off the weights; the tokenizer is ``--tokenizer``
or the default model's, which has bert-uncased's vocabulary)::

    .venv/bin/python jobs/encode_kb.py --prepared data/kilt_bert --model models/biencoder_wiki_large.bin \
        --tokenizer /models/bert-large-uncased --out data/embeddings/blink --num-shards 8

A Hugging Face model directory, with the score preset it is used under::

    .venv/bin/python jobs/encode_kb.py --prepared data/zeshel_minilm --model /models/bert-base-uncased \
        --preset multi --m 8 --out data/embeddings/zeshel_multi8 --blink-t7

On a cluster (``ray start --head`` first; the job runs in a copy of ``--working-dir``, so
give absolute paths)::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/encode_kb.py --prepared /data/kilt_minilm --model /runs/aida/retriever \
        --out /data/embeddings/aida --num-shards 8 --num-gpus 1

Each shard persists its embeddings under ``<out>/shards`` as soon as it finishes, so an
interrupted run resumes by shard: run the same command again and only the shards
without a persisted copy (same model, store and preset) encode. The export
(:mod:`dist_nce.index.export`: ``embeddings.npy``, ``ids.txt``, ``manifest.json``, optional
``embeddings.t7`` for BLINK) is written last. ``<out>`` holding a snapshot of another
model or store is refused unless ``--overwrite``. One encode per ``<out>`` at a time: a second one
started while the first runs stops with status 2, naming it (``dist_nce.core.run_lock``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dist_nce.cli.common import error, hold
from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1
from dist_nce.core.flags import FlagParser, existing, number
from dist_nce.core.run_lock import LOCK_FILE

SPEC_FILE = "encode_spec.json"


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="encode_kb", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepared", required=True, type=existing("dir"),
                   help="prepared KB directory (jobs/prepare_kb.py output)")
    p.add_argument("--model", required=True, help="dist-nce retriever directory, BLINK biencoder checkpoint file "
                                                  "(biencoder_wiki_large.bin), or a Hugging Face model directory "
                                                  "(then --preset)")
    p.add_argument("--tokenizer", default=None, type=existing("dir"),
                   help="tokenizer directory for a BLINK file (default: the default "
                        "model's, bert-uncased's vocabulary)")
    p.add_argument("--out", required=True, help="output directory (export + per-shard versions under shards/)")
    p.add_argument("--preset", choices=["dual", "poly", "multi", "som", "genpoly"], default=None,
                   help="score preset of a Hugging Face model or BLINK file (default dual; a retriever directory "
                        "knows its own)")
    p.add_argument("--m", type=number(int, AT_LEAST_1), default=None, help="vectors/codes for poly, multi, genpoly")
    p.add_argument("--storage-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype shards keep and persist (default: the retriever's, else float16)")
    p.add_argument("--export-dtype", choices=["float32", "float16"], default="float32",
                   help="dtype of embeddings.npy (FAISS reads float32)")
    p.add_argument("--blink-t7", action="store_true", help="also write embeddings.t7 for BLINK's faiss indexer")
    p.add_argument("--num-shards", type=number(int, AT_LEAST_1), default=2,
                   help="EntityShard actors (even contiguous row ranges)")
    p.add_argument("--num-cpus", type=number(float, AT_LEAST_0), default=1.0, help="CPUs per shard actor")
    p.add_argument("--num-gpus", type=number(float, AT_LEAST_0), default=0.0,
                   help="GPUs per shard actor (fractional allowed)")
    p.add_argument("--threads", type=number(int, AT_LEAST_1), default=1, help="intra-op threads per shard")
    p.add_argument("--batch-size", type=number(int, AT_LEAST_1), default=64, help="entities per encoder forward")
    p.add_argument("--encode-dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="autocast dtype (auto: bf16 where the device has bf16 units: Ampere+ GPUs, AVX512-BF16, AMX)")
    p.add_argument("--overwrite", action="store_true", help="replace a snapshot of another model/store in --out")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def load_entity_side(args: argparse.Namespace) -> tuple[Any, dict, str, int]:
    """(RetrieverConfig, entity-encoder state, tokenizer sha256, d) for --model: a retriever directory or
    BLINK file (:func:`dist_nce.modeling.resolve.load_retriever`), or a Hugging Face model directory."""
    from dist_nce.core.artifacts import MANIFEST
    from dist_nce.core.text import load_tokenizer, tokenizer_fingerprint
    from dist_nce.modeling.encoder import Encoder
    from dist_nce.modeling.resolve import load_retriever
    from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig

    model = Path(args.model)
    missing_model(model)
    if model.is_file():  # a BLINK biencoder checkpoint
        config = RetrieverConfig(preset=args.preset or "dual", m=args.m, storage_dtype=args.storage_dtype or "float16")
        config.validate()
        retriever = load_retriever(model, tokenizer_dir=args.tokenizer, config=config)
        return (config, retriever.entity_encoder_state(), tokenizer_fingerprint(retriever.tokenizer)["sha256"],
                retriever.hidden_size)
    if args.tokenizer:
        raise ValueError(f"--tokenizer is for a BLINK checkpoint file; {model} is a directory with its own tokenizer")
    if (model / MANIFEST).is_file():  # a dist-nce retriever directory
        retriever = load_retriever(model)
        config = retriever.config
        if (args.preset, args.m) != (None, None) and (args.preset, args.m) != (config.preset, config.m):
            raise ValueError(f"{model} is a {config.preset} (m={config.m}) retriever; drop --preset/--m or "
                             "pass the matching ones")
        if args.storage_dtype:
            config = dataclasses.replace(config, storage_dtype=args.storage_dtype)
        if retriever.tokenizer is None:
            raise ValueError(f"{model}: retriever directory without tokenizer/; cannot check the prepared store")
        return (config, retriever.entity_encoder_state(), tokenizer_fingerprint(retriever.tokenizer)["sha256"],
                retriever.hidden_size)
    config = RetrieverConfig(preset=args.preset or "dual", m=args.m, mention_model=str(model),
                             storage_dtype=args.storage_dtype or "float16")
    config.validate()
    encoder = Encoder.from_pretrained(model)
    state = EntityEncoder(encoder, config.spec(), config.trim_padding).state()
    return config, state, tokenizer_fingerprint(load_tokenizer(str(model)))["sha256"], encoder.hidden_size


def missing_model(model: Path) -> None:
    if not model.exists():
        raise FileNotFoundError(f"{model}: --model not found; expected a retriever directory, a BLINK biencoder "
                                "checkpoint file or a Hugging Face model directory")


def check_out_dir(out: Path, spec: dict, overwrite: bool) -> None:
    """Refuse (or with --overwrite, clear) an --out that holds another model's or store's snapshot."""
    path = out / SPEC_FILE
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old != spec:
            differs = sorted(k for k in set(old) | set(spec) if old.get(k) != spec.get(k))
            if not overwrite:
                raise ValueError(f"{out} holds a snapshot made with other settings (differs in: "
                                 f"{', '.join(differs)}); pass --overwrite or choose another --out")
            for child in out.iterdir():  # all but the lock this job holds (main): removed, it would lock nothing
                if child.name != LOCK_FILE:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    from dist_nce.actors.config import ServiceConfig
    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import configure_process, init_ray
    from dist_nce.core.artifacts import atomic_write_json
    from dist_nce.index.config import IndexConfig
    from dist_nce.index.encode import state_fingerprint, store_fingerprint
    from dist_nce.index.export import export_snapshot
    from dist_nce.index.versions import shard_dir_name, version_dir_name
    from kb.store import EntityStore

    configure_process(args.threads)
    if EntityStore(args.prepared).kb_version:
        # The snapshot format holds rows [0, N) of one version; a store changed by KB deltas has removed rows
        # and appended ones (kb.delta). Its compacted copy is a plain store again.
        raise ValueError(f"{args.prepared} was changed by KB deltas (kb_version "
                         f"{EntityStore(args.prepared).kb_version}): compact it first "
                         "(jobs/update_kb.py --store ... --compact --out NEW) and encode NEW")
    config, state, tokenizer_sha, dim = load_entity_side(args)
    out = Path(args.out).resolve()
    fingerprint = state_fingerprint(state)
    spec = {"model": str(Path(args.model).resolve()), "encoder_fingerprint": fingerprint,
            "prepared": str(Path(args.prepared).resolve()), "store_fingerprint": store_fingerprint(args.prepared),
            "preset": config.preset, "m": config.m, "storage_dtype": config.storage_dtype,
            "num_shards": args.num_shards}
    check_out_dir(out, spec, args.overwrite)
    atomic_write_json(out / SPEC_FILE, spec)

    service_config = ServiceConfig(
        num_shards=args.num_shards, num_cpus=args.num_cpus, num_gpus=args.num_gpus, threads=args.threads,
        encode_batch_size=args.batch_size, encode_dtype=args.encode_dtype, shard_dir=str(out / "shards"),
        keep_versions=1, max_concurrency=2, index=IndexConfig(backend="torch", device="cpu"))
    init_ray()
    t0 = time.perf_counter()
    service = NegativeService.create(args.prepared, config, service_config, str(out), dim=dim,
                                     tokenizer_sha256=tokenizer_sha)
    print(f"encode_kb: {service.num_entities:,} entities, {service.num_shards} shards "
          f"({', '.join(f'[{a}, {b})' for a, b in service.ranges)}), preset {config.preset}"
          f"{'' if config.m is None else f' m={config.m}'}, d={dim} -> {out}", file=sys.stderr)
    try:
        handle = service.refresh(state, 0)
        with tqdm(total=service.num_entities, unit="ent", desc="encode", disable=not args.progress) as bar:
            while not handle.done():
                progress = handle.progress()
                bar.set_postfix_str(" ".join(f"s{i}:{d}/{t}" for i, (d, t) in enumerate(progress)), refresh=False)
                bar.update(sum(d for d, _ in progress) - bar.n)
                time.sleep(0.5)
            handle.wait()
            bar.update(service.num_entities - bar.n)
        status = service.status()
    finally:
        service.shutdown()
    wrong = [s["shard"] for s in status if s["encoder_fingerprint"] != fingerprint or s["served"] != 0]
    if wrong:
        raise RuntimeError(f"shards {wrong} do not serve version 0 of this model; see {out / 'shards'}")
    seconds = round(time.perf_counter() - t0, 2)
    parts = [(tuple(s["rows"]), out / "shards" / shard_dir_name(s["shard"], args.num_shards) / version_dir_name(0))
             for s in status]
    manifest = export_snapshot(
        out, EntityStore(args.prepared), parts, dtype=args.export_dtype, blink_t7=args.blink_t7,
        version=0, spec_file=SPEC_FILE, **spec,
        shards=[{"rows": s["rows"], "source": s["source"]} for s in status], seconds=seconds)
    reused = sum(s["source"] == "reloaded" for s in status)
    print(f"encode_kb: {manifest['num_entities']:,} x {manifest['shape'][1:]} {manifest['dtype']} -> "
          f"{out / 'embeddings.npy'} ({reused} of {len(status)} shards reused from an earlier run, "
          f"{seconds} s)", file=sys.stderr)
    return manifest


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dist_nce.core.artifacts import ArtifactMismatch

    try:
        missing_model(Path(args.model))  # here too: run() reads the store before it loads the model
    except FileNotFoundError as e:
        return error(e)
    out = Path(args.out).resolve()
    # one live encode per --out (a second one, or an --overwrite, would clear or mix the first one's shards)
    held = hold([(out, LOCK_FILE, f"--out {out}")], "use another --out")
    if isinstance(held, int):
        return held
    with held:
        try:
            run(args)
        except (ValueError, ArtifactMismatch, FileNotFoundError) as e:
            return error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Link mentions in new text with a trained run: ``Linker.from_pretrained(run_dir).link(docs)``.

    linker = Linker.from_pretrained("runs/demo/20250101-120000", k=5)
    # or without a run: a retriever directory or BLINK's released files, over a prepared store
    linker = Linker.from_pretrained(model="models/biencoder_wiki_large.bin", store="data/prepared/kilt_bert",
                                    snapshot="data/embeddings/blink", reranker="models/crossencoder_wiki_large.bin")
    linker.link([{"text": "Paris is in France .", "mentions": [[12, 18]]}])
    # [{"mentions": [{"span": [12, 18], "mention": "France",
    #                 "entities": [{"id": "5843419", "title": "France", "row": 17, "score": 41.2}, ...]}]}]

The steps are the training pipeline's own, in order:

1. :mod:`dist_nce.link.inputs` cuts each mention into (left, mention, right);
2. ``dist_nce.core.text.encode_mentions`` tokenizes them with the store's ``mention_max_len``,
   exactly as ``kb.prepare`` tokenized the training and dev mentions;
3. the run's mention encoder encodes them (``dist_nce.retrieval``, longest first);
4. the KB is searched: in process (the run's exported snapshot, or the store encoded here)
   or through the trainer's sharded ``NegativeService`` (``LinkConfig.searcher``);
5. an optional trained reranker rescores the k candidates from the store's entity token
   ids (as it was trained) and reorders them.

:meth:`Linker.prepare`, :meth:`Linker.encode`, :meth:`Linker.search`, :meth:`Linker.rerank`
and :meth:`Linker.answers` are those steps one by one; the Ray Serve application
(:mod:`dist_nce.link.serve`) runs them in separate deployments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.core.config import from_dict, to_dict
from dist_nce.core.text import encode_mentions, tokenizer_fingerprint
from dist_nce.index.search import ShardIndex
from dist_nce.link.config import LinkConfig
from dist_nce.link.inputs import Mention, parse_docs
from dist_nce.link.run_dir import RunArtifacts, resolve, snapshot_index
from dist_nce.modeling.resolve import load_reranker, load_retriever
from dist_nce.modeling.retriever import Retriever
from dist_nce.modeling.scoring import Reps
from dist_nce.retrieval import Searcher, default_index_config, iter_mention_reps, local_search, retrieve
from dist_nce.sampling.topk import ShardResult
from kb.store import EntityStore


PREPARE_CHUNK = 64  # mentions whose records (context copies) exist at once in Linker.prepare


@dataclass(frozen=True)
class Prepared:
    """Mentions of a request, tokenized: ids int32 [N, L] (pad-filled), lengths int64 [N]."""

    mentions: list[Mention]
    ids: np.ndarray
    lengths: np.ndarray


class _TokenRows:
    """Token rows in the shape ``dist_nce.retrieval`` reads a mention table."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray):
        self._ids, self.lengths = ids, lengths

    def token_ids(self, idx: Any) -> np.ndarray:
        return self._ids[np.asarray(idx, dtype=np.int64)]


def encode_token_rows(retriever: Retriever, ids: np.ndarray, lengths: np.ndarray) -> Reps:
    """Token rows int32 [B, L] + lengths [B] -> mention Reps [B, ...] float32 on the CPU, in input order.

    One batch of ``dist_nce.retrieval.iter_mention_reps`` (the evaluation's encoder loop)."""
    rows = _TokenRows(np.asarray(ids), np.asarray(lengths, dtype=np.int64))
    ((order, reps),) = iter_mention_reps(retriever, rows, None, max(len(rows.lengths), 1), progress=False)
    back = torch.from_numpy(np.argsort(order))
    return Reps(reps.vecs[back], None if reps.mask is None else reps.mask[back])


@torch.inference_mode()
def rerank_scores(reranker: Any, store: EntityStore, ids: np.ndarray, rows: np.ndarray, pairs: int) -> np.ndarray:
    """Reranker scores float32 [B, k] of mention token rows ids [B, L] against store rows [B, k].

    Entities are the store's token ids, the reranker's training input; ``pairs`` bounds the
    (mention, candidate) pairs of one forward."""
    rows = np.asarray(rows)
    per = max(1, pairs // max(rows.shape[1], 1))  # mentions per forward
    device = next(reranker.parameters()).device
    out = np.empty(rows.shape, dtype=np.float32)
    for a in range(0, len(rows), per):
        m = torch.from_numpy(np.asarray(ids[a:a + per], dtype=np.int64)).to(device)
        e = torch.from_numpy(store.token_ids(rows[a:a + per]).astype(np.int64)).to(device)
        out[a:a + per] = reranker.score(m, e).float().cpu().numpy()
    return out


def _config(config: LinkConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> LinkConfig:
    """A LinkConfig from a config object or dict plus keyword overrides (unknown keys refused)."""
    base = to_dict(config) if isinstance(config, LinkConfig) else dict(config or {})
    return from_dict(LinkConfig, {**base, **overrides}, "LinkConfig")


class Linker:
    """A trained retriever over its KB (and optionally a reranker): text with mentions -> entities."""

    def __init__(self, artifacts: RunArtifacts, config: LinkConfig, retriever: Retriever | None, tokenizer: Any,
                 store: EntityStore, searcher: Searcher, reranker: Any = None):
        self.artifacts, self.config = artifacts, config
        self.retriever, self.tokenizer, self.store, self.searcher, self.reranker = (
            retriever, tokenizer, store, searcher, reranker)
        self.mention_max_len = int(store.manifest["mention_max_len"])

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, run_dir: str | os.PathLike | None = None,
                        config: LinkConfig | Mapping[str, Any] | None = None, *,
                        keep_encoder: bool = True, open_searcher: bool = True, **overrides: Any) -> "Linker":
        """Load ``run_dir`` (``runs/<name>/<time>`` of jobs/aida_finetune.py), or, with no run,
        ``model`` + ``store`` (a retriever directory or BLINK biencoder file over a prepared KB).

        ``config`` / ``overrides``: :class:`LinkConfig` fields (``k=5``, ``reranker=...``,
        ``model=...``, ``snapshot=...``). ``keep_encoder=False`` drops the mention encoder once
        the index is built (the Serve ingress encodes in another deployment);
        ``open_searcher=False`` opens no index (the Serve ingress searches through its KBSearcher
        deployment), leaving :meth:`search` unusable.
        """
        from kb.store import EntityStore

        cfg = _config(config, overrides)
        art = resolve(run_dir, cfg.model, cfg.store, cfg.snapshot)
        retriever = load_retriever(art.model, tokenizer_dir=cfg.tokenizer).eval().to(cfg.device)
        if retriever.tokenizer is None:
            raise ArtifactMismatch(f"{art.model}: no tokenizer/ directory; mentions cannot be tokenized as in "
                                   "training")
        tok_sha = tokenizer_fingerprint(retriever.tokenizer)["sha256"]
        store = EntityStore(art.store, tokenizer_sha256=tok_sha)
        searcher = cls._open_searcher(cfg, art, retriever, store, tok_sha) if open_searcher else None
        reranker = None
        if cfg.reranker:
            reranker = load_reranker(cfg.reranker, tokenizer_dir=cfg.tokenizer).eval().to(cfg.device)
            theirs = None if reranker.tokenizer is None else tokenizer_fingerprint(reranker.tokenizer)["sha256"]
            if theirs != tok_sha:
                raise ArtifactMismatch(f"{cfg.reranker}: the reranker's tokenizer differs from the retriever's and "
                                       f"the store's (it reads the store's entity token ids)")
        return cls(art, cfg, retriever if keep_encoder else None, retriever.tokenizer, store, searcher, reranker)

    @staticmethod
    def _open_searcher(cfg: LinkConfig, art: RunArtifacts, retriever: Retriever, store: EntityStore, tok_sha: str):
        from dist_nce.index.encode import state_fingerprint
        from dist_nce.retrieval import build_local_index

        if cfg.searcher == "local":
            index_cfg = cfg.index or default_index_config(retriever)
            if cfg.kb == "encode":
                return build_local_index(retriever, store, index_cfg, progress=cfg.progress)
            if art.snapshot is None:
                if art.run_dir is None:
                    raise FileNotFoundError(f"{art.model}: no KB snapshot to search; give snapshot (--snapshot, the "
                                            "--out of jobs/encode_kb.py) or kb: encode (--kb encode)")
                raise FileNotFoundError(f"{art.run_dir}: no kb_snapshot/ (the run exported none); use kb: encode "
                                        "(--kb encode) to encode the store in this process")
            fingerprint = state_fingerprint(retriever.entity_encoder_state())
            return snapshot_index(art.snapshot, store, retriever.spec, index_cfg, fingerprint)
        return _open_service(cfg, art, retriever, tok_sha)

    def close(self) -> None:
        """Stop the shard actors of a service searcher (their persisted versions stay)."""
        if self.config.searcher == "service" and self.searcher is not None:
            self.searcher.shutdown()
            self.searcher = None

    def __enter__(self) -> "Linker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ steps
    def prepare(self, docs: Sequence[Mapping[str, Any]]) -> Prepared:
        """Check ``docs`` (ValueError naming the doc and field) and tokenize every mention."""
        mentions = parse_docs(docs)
        # A record copies its contexts out of the doc's text: cut PREPARE_CHUNK at a time, so a
        # request of many spans over a long text holds a few copies, not one per span.
        parts = [encode_mentions(self.tokenizer, [m.record for m in mentions[a:a + PREPARE_CHUNK]],
                                 self.mention_max_len) for a in range(0, len(mentions), PREPARE_CHUNK)]
        ids = np.concatenate(parts) if parts else np.zeros((0, self.mention_max_len), dtype=np.int32)
        lengths = (ids != self.tokenizer.pad_token_id).sum(axis=1).astype(np.int64)
        return Prepared(mentions, ids, lengths)

    def encode(self, ids: np.ndarray, lengths: np.ndarray) -> Reps:
        """Token rows int32 [B, L] + lengths [B] -> mention Reps [B, ...] float32 on the CPU, in input order."""
        if self.retriever is None:
            raise RuntimeError("this Linker was loaded with keep_encoder=False")
        return encode_token_rows(self.retriever, ids, lengths)

    def check_k(self, k: int | None) -> int:
        k = self.config.k if k is None else k
        # live entities: rows a KB delta removed stay in the row space but are never returned
        n = self.store.num_live
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"k must be an integer in [1, {n}] (the KB's entities), got {k!r}")
        return k

    def search(self, reps: Reps, k: int) -> ShardResult:
        """Mention Reps [B, ...] -> the top k store rows and scores [B, k] over the whole KB."""
        if self.searcher is None:
            raise RuntimeError("this Linker was loaded with open_searcher=False")
        if isinstance(self.searcher, ShardIndex):
            return local_search(self.searcher, reps, k)
        return self.searcher.topk(reps, k).result()

    def rerank(self, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Mention token rows [B, L] and candidate store rows [B, k] -> reranker scores float32 [B, k]."""
        if self.reranker is None:
            raise RuntimeError("no reranker loaded (LinkConfig.reranker)")
        return rerank_scores(self.reranker, self.store, ids, rows, self.config.rerank_pairs)

    def answers(self, mentions: Sequence[Mention], num_docs: int, rows: np.ndarray, scores: np.ndarray,
                rerank: np.ndarray | None, ids: Sequence[Any] | None = None) -> list[dict]:
        """Per doc ``{"id"?, "mentions": [{"span", "mention", "entities": [...]}]}``; entities best first
        (by reranker score when there is one, ties keeping the retriever's order)."""
        rows, scores = np.asarray(rows), np.asarray(scores)
        flat = rows.ravel()
        titles = self.store.titles(flat)
        sources = self.store.source_ids(flat)
        k = rows.shape[1]
        ids = list(ids) if ids is not None else [None] * num_docs
        out: list[dict] = [({} if id_ is None else {"id": id_}) | {"mentions": []} for id_ in ids]
        for i, m in enumerate(mentions):
            ents = []
            for j in range(k):
                e = {"id": sources[i * k + j], "title": titles[i * k + j], "row": int(rows[i, j]),
                     "score": float(scores[i, j])}
                if rerank is not None:
                    e["rerank_score"] = float(rerank[i, j])
                ents.append(e)
            if rerank is not None:
                ents = [ents[j] for j in np.argsort(-rerank[i], kind="stable")]
            out[m.doc]["mentions"].append({"span": None if m.span is None else list(m.span),
                                           "mention": m.mention, "entities": ents})
        return out

    # ------------------------------------------------------------------ all at once
    def link(self, docs: Sequence[Mapping[str, Any]], k: int | None = None, progress: bool | None = None
             ) -> list[dict]:
        """Link every mention of ``docs`` (see the module docstring for the forms and the answer)."""
        if self.retriever is None:
            raise RuntimeError("this Linker was loaded with keep_encoder=False")
        k = self.check_k(k)
        prepared = self.prepare(docs)
        progress = self.config.progress if progress is None else progress
        got = retrieve(self.retriever, _TokenRows(prepared.ids, prepared.lengths), self.searcher, k,
                       batch_size=self.config.batch_size, progress=progress, desc="link")
        rerank = self.rerank(prepared.ids, got.rows) if self.reranker is not None else None
        return self.answers(prepared.mentions, len(docs), got.rows, got.scores, rerank,
                            [d.get("id") for d in docs])


def _open_service(cfg: LinkConfig, art: RunArtifacts, retriever: Retriever, tok_sha: str):
    """The trainer's NegativeService over the store, serving this model's entity embeddings
    (the run's persisted final index when it is this model's, else encoded now)."""
    import dataclasses

    from dist_nce.actors.config import ServiceConfig
    from dist_nce.actors.service import NegativeService
    from dist_nce.cluster.runtime import init_ray
    from dist_nce.retrieval import serve_model

    svc = cfg.service or from_dict(ServiceConfig, art.service or {}, f"{art.run_dir}/summary.json: service")
    svc = dataclasses.replace(svc, shard_dir=svc.shard_dir or str(_default_shard_dir(art)))
    init_ray()
    service = NegativeService.create(str(art.store), retriever.config, svc,
                                     str(art.run_dir or Path(svc.shard_dir).parent),
                                     dim=retriever.hidden_size, tokenizer_sha256=tok_sha)
    try:
        serve_model(service, retriever, progress=cfg.progress)
    except BaseException:
        service.shutdown()
        raise
    return service


def _default_shard_dir(art: RunArtifacts) -> Path:
    """Where the service's shards persist (and look for) the KB's embeddings when
    ``service.shard_dir`` is unset: the run's ``shards/``, else ``<snapshot>/shards`` (the layout
    of jobs/encode_kb.py's --out)."""
    if art.run_dir is not None:
        return Path(art.run_dir) / "shards"
    if art.snapshot is not None:
        return Path(art.snapshot) / "shards"
    raise FileNotFoundError(f"searcher: service with model {art.model} and no run directory needs service.shard_dir "
                            "(--shard-dir: where the shards persist and reuse the KB's embeddings, e.g. "
                            "<jobs/encode_kb.py --out>/shards) or snapshot (--snapshot)")

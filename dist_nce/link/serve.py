"""The linker over HTTP: a Ray Serve application of three deployments.

    RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run configs/serve/link.yaml  # set args.run first
    # or BLINK's released files over a prepared store (args.run empty; see ServeConfig):
    #   args: {link: {model: .../biencoder_wiki_large.bin, reranker: .../crossencoder_wiki_large.bin,
    #                 store: data/prepared/kilt_bert, snapshot: data/embeddings/blink}}
    curl -s -X POST http://127.0.0.1:8000/link -H 'Content-Type: application/json' \\
        -d '{"docs": [{"text": "Paris is in France .", "mentions": [[12, 18]]}], "k": 5}'

* ``LinkIngress`` (HTTP): checks the request, tokenizes (``Linker.prepare``: the training
  tokenization), sends every mention to the encoder, searches the KB (in the replica, or
  through the trainer's sharded NegativeService, ``link.searcher: service``: the replica
  then owns its shard actors) and, with a reranker, asks the reranker; answers
  ``{"docs": [...]}`` in the Python API's format (``Linker.link``).
* ``MentionEncoder``: the run's (or ``link.model``'s) mention encoder; concurrent requests' mentions are encoded
  together (``@serve.batch``), which is where batching pays on a CPU or a GPU.
* ``RerankerScorer`` (only with ``link.reranker``): (mention, k candidates) items batched
  the same way.

Requests: ``{"docs": [doc, ...], "k": 5}``, a list of docs, or one doc; a doc is
``{"text", "mentions": [[start, end], ...]}`` or a KILT ``{"input": "... [START_ENT] m [END_ENT] ..."}``.
Refusals, each with ``{"error": message}``: 400 (not JSON, wrong shape), 422 (a doc or k
that :mod:`dist_nce.link.inputs` refuses: missing spans, span outside the text, empty
text), 413 (body over ``max_request_bytes`` or more than ``max_mentions`` mentions), 405
(not POST). A refused request changes nothing: the replicas keep serving.

HTTP listens on loopback only unless configured otherwise (``http_options.host`` in the
config; :func:`start_local` here): the endpoint has no authentication of its own.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import torch
from ray import serve

from dist_nce.core.config import ConfigError, from_dict, to_dict
from dist_nce.link.config import ServeConfig
from dist_nce.modeling.scoring import Reps

DEFAULT_HOST = "127.0.0.1"


def _pad(rows: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Unpadded token rows -> (ids int32 [B, max len] pad-filled, lengths int64 [B])."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, np.array([len(r) for r in rows], dtype=np.int64)


def stack_reps(parts: list[tuple[np.ndarray, np.ndarray | None]]) -> Reps:
    """Per-mention reps from different encoder batches -> Reps [B, ...]. Multi-vector mention
    reps (SOM: one vector per token) are padded to the longest with masked-out zeros."""
    if parts[0][1] is None:
        return Reps(torch.from_numpy(np.stack([v for v, _ in parts])))
    width = max(v.shape[0] for v, _ in parts)
    vecs = np.zeros((len(parts), width, parts[0][0].shape[-1]), dtype=np.float32)
    mask = np.zeros((len(parts), width), dtype=bool)
    for i, (v, m) in enumerate(parts):
        vecs[i, :len(v)], mask[i, :len(m)] = v, m
    return Reps(torch.from_numpy(vecs), torch.from_numpy(mask))


def keep_replica_grpc_on_loopback() -> bool:
    """Make this Serve replica's inter-deployment gRPC server listen on loopback when the
    cluster is loopback-only; True if it will.

    Ray Serve 2.60 binds that server on ``[::]`` (every interface) whatever the cluster's
    addresses are, so a replica of a local, loopback-only Ray (how this project starts one,
    and what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes ``serve run`` start) would accept
    unauthenticated calls from the network. On such a node every caller is on this machine,
    so the port is bound to 127.0.0.1 instead. A node with a routable address (a real
    multi-node cluster) is left as Ray binds it. Called first in each deployment's
    ``__init__``: Serve constructs the user class before it starts the gRPC server.
    """
    import ray
    from ray.serve._private import replica

    if ray.util.get_node_ip_address() not in ("127.0.0.1", "::1"):
        return False
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:  # another Ray version: nothing to redirect (tests/link checks listeners)
        return False
    if getattr(bind, "loopback_only", False):
        return True

    def bind_loopback(server, address: str):
        host, _, port = address.rpartition(":")
        return bind(server, f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0", "") else address)

    bind_loopback.loopback_only = True
    replica.add_port_to_grpc_server = bind_loopback
    return True


@serve.deployment
class MentionEncoder:
    """Token rows -> mention vectors; concurrent calls are encoded in one batch."""

    def __init__(self, model: str, tokenizer: str | None, device: str, max_batch_size: int,
                 batch_wait_timeout_s: float):
        keep_replica_grpc_on_loopback()
        from dist_nce.cluster.runtime import configure_process
        from dist_nce.modeling.resolve import load_retriever

        configure_process(1)
        self.retriever = load_retriever(model, tokenizer_dir=tokenizer).eval().to(device)
        self.pad = self.retriever.tokenizer.pad_token_id
        self.encode.set_max_batch_size(max_batch_size)
        self.encode.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def encode(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        from dist_nce.link.linker import encode_token_rows

        ids, lengths = _pad(rows, self.pad)
        reps = encode_token_rows(self.retriever, ids, lengths)
        vecs = reps.vecs.numpy()
        if reps.mask is None:
            return [(vecs[i], None) for i in range(len(rows))]
        mask = reps.mask.numpy()
        return [(vecs[i][mask[i]], mask[i][mask[i]]) for i in range(len(rows))]


@serve.deployment
class RerankerScorer:
    """(mention token row, k candidate store rows) -> k reranker scores; calls batched."""

    def __init__(self, reranker: str, tokenizer: str | None, store_dir: str, device: str, pairs: int,
                 max_batch_size: int, batch_wait_timeout_s: float):
        keep_replica_grpc_on_loopback()
        from kb.store import EntityStore

        from dist_nce.cluster.runtime import configure_process
        from dist_nce.modeling.resolve import load_reranker

        configure_process(1)
        self.reranker = load_reranker(reranker, tokenizer_dir=tokenizer).eval().to(device)
        from dist_nce.core.text import tokenizer_fingerprint

        # It reads the store's entity token ids: they must be in its own vocabulary.
        self.store = EntityStore(store_dir, tokenizer_sha256=tokenizer_fingerprint(self.reranker.tokenizer)["sha256"])
        self.pairs = pairs
        self.pad = self.reranker.tokenizer.pad_token_id
        self.score.set_max_batch_size(max_batch_size)
        self.score.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def score(self, items: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
        from dist_nce.link.linker import rerank_scores

        ids, _ = _pad([m for m, _ in items], self.pad)
        k = max(len(r) for _, r in items)
        rows = np.zeros((len(items), k), dtype=np.int64)  # shorter rankings padded with row 0, dropped below
        for i, (_, r) in enumerate(items):
            rows[i, :len(r)] = r
        scores = rerank_scores(self.reranker, self.store, ids, rows, self.pairs)
        return [scores[i, :len(r)] for i, (_, r) in enumerate(items)]


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def request_docs(payload: Any, default_k: int) -> tuple[list, int]:
    """The docs and k of a request body (already JSON-decoded); BadRequest(400) on a wrong shape."""
    k = default_k
    if isinstance(payload, dict) and "docs" in payload:
        unknown = sorted(set(payload) - {"docs", "k"})
        if unknown:
            raise BadRequest(400, f"unknown request field(s) {unknown}; expected 'docs' and optionally 'k'")
        docs, k = payload["docs"], payload.get("k", default_k)
    elif isinstance(payload, dict):
        docs = [payload]
    else:
        docs = payload
    if not isinstance(docs, list):
        raise BadRequest(400, f"expected {{'docs': [...]}}, a list of docs or one doc; got {type(docs).__name__}")
    return docs, k


@serve.deployment
class LinkIngress:
    """HTTP: parse, tokenize, encode (MentionEncoder), search, rerank (RerankerScorer), answer."""

    def __init__(self, encoder: Any, reranker: Any, config: dict):
        keep_replica_grpc_on_loopback()
        from dist_nce.cluster.runtime import configure_process
        from dist_nce.link.linker import Linker

        configure_process(1)
        self.cfg = from_dict(ServeConfig, config)
        link = dict(to_dict(self.cfg.link), reranker=None, progress=False)  # the reranker runs in its deployment
        self.linker = Linker.from_pretrained(self.cfg.run or None, link, keep_encoder=False)
        self.encoder, self.reranker = encoder, reranker

    async def _link(self, payload: Any) -> list[dict]:
        docs, k = request_docs(payload, self.cfg.link.k)
        try:
            k = self.linker.check_k(k)
            prepared = self.linker.prepare(docs)
        except ValueError as e:
            raise BadRequest(422, str(e)) from None
        n = len(prepared.mentions)
        if n > self.cfg.max_mentions:
            raise BadRequest(413, f"{n} mentions in one request; the limit is {self.cfg.max_mentions}")
        rows = [prepared.ids[i, :prepared.lengths[i]].tolist() for i in range(n)]
        parts = await asyncio.wait_for(asyncio.gather(*[self.encoder.encode.remote(r) for r in rows]),
                                       self.cfg.request_timeout_s)
        # Searching is blocking CPU work (faiss, torch) or a wait on shard actors: off the event loop.
        found = await asyncio.to_thread(self.linker.search, stack_reps(list(parts)), k)
        cand = found.ids.numpy()
        rerank = None
        if self.reranker is not None:
            scored = await asyncio.wait_for(asyncio.gather(*[self.reranker.score.remote((rows[i], cand[i].tolist()))
                                                             for i in range(n)]), self.cfg.request_timeout_s)
            rerank = np.stack(list(scored))
        return self.linker.answers(prepared.mentions, len(docs), cand, found.scores.float().numpy(), rerank,
                                   [d.get("id") for d in docs])

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            if request.method != "POST":
                raise BadRequest(405, "POST a JSON body")
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.cfg.max_request_bytes:
                raise BadRequest(413, f"body of {declared} bytes; the limit is {self.cfg.max_request_bytes}")
            body = await request.body()
            if len(body) > self.cfg.max_request_bytes:
                raise BadRequest(413, f"body of {len(body)} bytes; the limit is {self.cfg.max_request_bytes}")
            try:
                payload = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(400, f"body is not JSON: {e}") from None
            return JSONResponse({"docs": await self._link(payload)})
        except BadRequest as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        except Exception as e:  # noqa: BLE001 - a failure of ours: answer it in JSON too, keep serving
            return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)


def build_app(args: dict) -> Any:
    """The application for ``serve run`` / ``serve deploy`` (``import_path: dist_nce.link.serve:build_app``);
    ``args`` are :class:`~dist_nce.link.config.ServeConfig` fields (unknown keys refused)."""
    from dist_nce.link.run_dir import resolve

    cfg = from_dict(ServeConfig, args, "serve args")
    if not cfg.run and not cfg.link.model:
        raise ConfigError("serve args: run: give the run directory (runs/<name>/<time>), or link.model (a retriever "
                          "directory or BLINK biencoder file) and link.store")
    try:  # a wrong path fails here, before any replica starts
        art = resolve(cfg.run or None, cfg.link.model, cfg.link.store, cfg.link.snapshot)
    except ValueError as e:
        raise ConfigError(f"serve args: {e}") from None
    actor = {"num_cpus": cfg.replica_cpus}
    # A replica queues at most max_ongoing_requests calls: room for a full batch and the next one.
    batched = 2 * cfg.max_batch_size
    encoder = MentionEncoder.options(num_replicas=cfg.encoder_replicas, ray_actor_options=actor,
                                     max_ongoing_requests=batched).bind(
        str(art.model), cfg.link.tokenizer, cfg.link.device, cfg.max_batch_size, cfg.batch_wait_timeout_s)
    reranker = None
    if cfg.link.reranker:
        reranker = RerankerScorer.options(num_replicas=cfg.reranker_replicas, ray_actor_options=actor,
                                          max_ongoing_requests=batched).bind(
            cfg.link.reranker, cfg.link.tokenizer, str(art.store), cfg.link.device, cfg.link.rerank_pairs,
            cfg.max_batch_size, cfg.batch_wait_timeout_s)
    return LinkIngress.options(num_replicas=cfg.ingress_replicas, ray_actor_options=actor,
                               max_ongoing_requests=cfg.ingress_max_ongoing).bind(
        encoder, reranker, to_dict(cfg))


def start_local(port: int, host: str = DEFAULT_HOST) -> None:
    """Start Serve's HTTP proxy on ``host:port`` (loopback by default) in the connected Ray."""
    serve.start(http_options={"host": host, "port": int(port)})

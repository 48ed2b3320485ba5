"""The linker over HTTP: a Ray Serve application of four deployments, clients at its edge.

    RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python -m dist_nce.cli.serve_link configs/serve/link.yaml \\
        run=runs/demo/<time>             # or: serve run configs/serve/link.yaml, args.run set first
    # or BLINK's released files over a prepared store (run="" and link.model=..., see ServeConfig):
    #   args: {link: {model: .../biencoder_wiki_large.bin, reranker: .../crossencoder_wiki_large.bin,
    #                 store: data/prepared/kilt_bert, snapshot: data/embeddings/blink}}
    curl -s -X POST http://127.0.0.1:8000/link -H 'Content-Type: application/json' \\
        -d '{"docs": [{"text": "Paris is in France .", "mentions": [[12, 18]]}], "k": 5}'

* ``LinkEdge`` (with ``edge_port``, as the shipped config sets it; Serve's own proxy off): the
  HTTP server clients talk to (:mod:`dist_nce.link.edge`). It decides on the head, before
  reading a body (method, path, Content-Type, Content-Length), bounds what it buffers, closes
  idle connections and slow heads, starts each request's deadline when it arrives and sheds
  with 503 what cannot be served in it; accepted bodies go to ``LinkIngress.answer``.
* ``LinkIngress``: checks the request (:mod:`dist_nce.link.request`), tokenizes
  (``Linker.prepare``: the training tokenization), sends every mention to the encoder, the
  vectors to the searcher and, with a reranker, the candidates to the reranker; answers
  ``{"docs": [...]}`` in the Python API's format (``Linker.link``). Without an edge
  (``edge_port: 0``: development) it is the app's ingress behind Serve's own proxy, with the
  same checks on a body that proxy has already read, and none of the edge's.
* ``MentionEncoder``: the run's (or ``link.model``'s) mention encoder; concurrent requests' mentions are encoded
  together (``@serve.batch``), which is where batching pays on a CPU or a GPU.
* ``KBSearcher``: the KB index (in the replica), or the trainer's sharded NegativeService
  (``link.searcher: service``: the replica owns the shard actors); one replica by default
  (``searcher_replicas``), so every HTTP replica shares one index or one set of shards.
* ``RerankerScorer`` (only with ``link.reranker``): (mention, k candidates) items batched
  the same way.

With a ``cuda`` ``link.device`` the encoder, reranker and local-index searcher replicas reserve
``replica_gpus`` (default 1) GPUs each; the edge and HTTP replicas run no model and reserve CPUs only.

Requests: POST ``route`` (Content-Type ``application/json``), body ``{"docs": [doc, ...], "k": 5}``,
a list of docs, or one doc; a doc is ``{"text", "mentions": [[start, end], ...]}``, a KILT
``{"input": "... [START_ENT] m [END_ENT] ..."}`` or BLINK's ``{"context_left", "mention", "context_right"}``.
Every limit is checked before any tokenizing (``ServeConfig``'s ``max_*`` fields). Refusals, each with
``{"error": message}`` naming the field (and doc) at fault, at most 400 characters (values it quotes are cut):

* 400: not UTF-8 (the byte offset), nested deeper than ``max_json_depth``, not JSON, wrong shape,
  a lone UTF-16 surrogate (``"\\ud800"``) outside the docs;
* 404: another path; 405: not POST; 415: not ``application/json`` (UTF-8);
* 408: the head not sent within ``header_timeout_s`` of its first byte, or the body within
  ``body_timeout_s`` (a slow client); a connection that starts no request within
  ``idle_timeout_s`` is closed;
* 413: a declared Content-Length over ``max_request_bytes`` (before reading), a body past it
  (read as a stream and cut there), more than ``max_docs`` docs, a text over
  ``max_text_chars``, more than ``max_mentions_per_doc`` spans in a doc or ``max_mentions`` in
  all, a span over ``max_span_chars``, k over ``max_k``; 431: a head over ``max_header_bytes``;
* 422: a doc or k that :mod:`dist_nce.link.request` or :mod:`dist_nce.link.inputs` refuses
  (a wrong type, missing spans, a span outside the text, empty text, a lone surrogate in a doc,
  k over the KB's size);
* 503: shed: the request could not be served within ``request_timeout_s`` of its arrival (or
  the client's shorter ``X-Request-Timeout-Seconds``), ``max_queued_requests`` already wait,
  ``max_connections`` are open, ``max_buffered_bytes`` of bodies are being read, or a
  deployment is overloaded;
* 504: a stage (tokenize, encode, search or rerank, named) ran past the deadline;
* 500: a failure of ours, as ``internal error (id <uuid>)``; the traceback is in the replica's
  log under that id, never in the answer.

A refused request changes nothing: the replicas keep serving.

The edge listens on loopback unless configured otherwise (``edge_host``): the endpoint has no
authentication of its own.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import numpy as np
import torch
from ray import serve

from dist_nce.core.config import ConfigError, from_dict, to_dict
from dist_nce.link.config import ServeConfig
from dist_nce.link.edge import media_type
from dist_nce.link.request import BadRequest, Deadline, check_request, decode_utf8, parse_json, read_body, shown
from dist_nce.modeling.scoring import Reps

DEFAULT_HOST = "127.0.0.1"
LOG = logging.getLogger("ray.serve")  # the replica's log (logs/serve/replica_*.log), next to Serve's own


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


@serve.deployment
class KBSearcher:
    """Mention vectors -> the top k store rows over the whole KB: the one index (or, with
    ``link.searcher: service``, the one set of shard actors) that every HTTP replica searches."""

    def __init__(self, config: dict):
        keep_replica_grpc_on_loopback()
        from dist_nce.cluster.runtime import configure_process
        from dist_nce.link.linker import Linker

        configure_process(1)
        cfg = from_dict(ServeConfig, config)
        link = dict(to_dict(cfg.link), reranker=None, progress=False)
        if cfg.link.searcher == "service":
            # The shards encode on their own devices; this replica only hands them the weights.
            link["device"] = "cpu"
        self.linker = Linker.from_pretrained(cfg.run or None, link, keep_encoder=False)

    async def search(self, vecs: np.ndarray, mask: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Mention vectors [B, D] (or [B, T, D] with mask [B, T]) -> (rows int64 [B, k], scores float32 [B, k])."""
        # Copied: Ray hands over read-only arrays (zero-copy from its object store), which torch warns of.
        reps = Reps(torch.tensor(vecs), None if mask is None else torch.tensor(mask))
        # Blocking CPU work (faiss, torch) or a wait on shard actors: off the event loop.
        found = await asyncio.to_thread(self.linker.search, reps, k)
        return found.ids.numpy(), found.scores.float().numpy()

    def __del__(self):
        # Serve calls this when the replica stops: the shard actors go with it.
        linker = getattr(self, "linker", None)
        if linker is not None:
            linker.close()


async def within(deadline: Deadline, stage: str, work: Any) -> Any:
    """Await ``work`` in what is left of the request's ``deadline``: 504 naming ``stage`` when it runs
    out, 503 when the deployment doing ``stage`` is overloaded or has no replica."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    try:
        return await asyncio.wait_for(work, deadline.left())
    except asyncio.TimeoutError:
        raise deadline.timed_out(stage) from None
    except (BackPressureError, DeploymentUnavailableError):
        raise BadRequest(503, f"the service is overloaded ({stage}); retry later") from None


@serve.deployment
class LinkIngress:
    """HTTP: read and check the request (:mod:`dist_nce.link.request`), tokenize, encode
    (MentionEncoder), search (KBSearcher), rerank (RerankerScorer), answer."""

    def __init__(self, encoder: Any, searcher: Any, reranker: Any, config: dict):
        keep_replica_grpc_on_loopback()
        from dist_nce.cluster.runtime import configure_process
        from dist_nce.link.linker import Linker

        configure_process(1)
        self.cfg = from_dict(ServeConfig, config)
        self.limits = self.cfg.limits()
        # Tokenizer, store and k's bounds only: encoding, search and reranking run in their deployments.
        link = dict(to_dict(self.cfg.link), reranker=None, progress=False, device="cpu")
        self.linker = Linker.from_pretrained(self.cfg.run or None, link, keep_encoder=False, open_searcher=False)
        self.encoder, self.searcher, self.reranker = encoder, searcher, reranker

    async def _link(self, docs: list, k: int, deadline: Deadline) -> list[dict]:
        try:
            k = self.linker.check_k(k)
            # Bounded by check_request's limits, yet CPU work: off the event loop, other requests go on.
            prepared = await within(deadline, "tokenize", asyncio.to_thread(self.linker.prepare, docs))
        except ValueError as e:
            raise BadRequest(422, str(e)) from None
        n = len(prepared.mentions)
        rows = [prepared.ids[i, :prepared.lengths[i]].tolist() for i in range(n)]
        parts = await within(deadline, "encode", asyncio.gather(*[self.encoder.encode.remote(r) for r in rows]))
        reps = stack_reps(list(parts))
        cand, scores = await within(deadline, "search", self.searcher.search.remote(
            reps.vecs.numpy(), None if reps.mask is None else reps.mask.numpy(), k))
        rerank = None
        if self.reranker is not None:
            scored = await within(deadline, "rerank", asyncio.gather(
                *[self.reranker.score.remote((rows[i], cand[i].tolist())) for i in range(n)]))
            rerank = np.stack(list(scored))
        return self.linker.answers(prepared.mentions, len(docs), cand, scores, rerank, [d.get("id") for d in docs])

    async def _answer(self, body: bytes, deadline: Deadline) -> tuple[int, bytes]:
        """(status, JSON) for a request body read within the limits."""
        try:
            payload = parse_json(decode_utf8(body), self.limits.max_json_depth)
            del body
            docs, k = check_request(payload, self.cfg.link.k, self.limits)
            # ASCII: the texts are checked Unicode, and no answer can fail to encode.
            return 200, json.dumps({"docs": await self._link(docs, k, deadline)}).encode()
        except BadRequest as e:
            return e.status, json.dumps({"error": e.message}).encode()
        except Exception:  # noqa: BLE001 - a failure of ours: logged here, never shown to the client
            incident = uuid.uuid4().hex
            LOG.exception("request failed (id %s)", incident)
            return 500, json.dumps({"error": f"internal error (id {incident}); see the replica log"}).encode()

    async def answer(self, body: bytes, deadline_at: float) -> tuple[int, bytes]:
        """The edge's call (:class:`LinkEdge`): (status, JSON) for a body it read and checked, due at
        ``deadline_at`` (wall-clock seconds, counted from the request's arrival at the edge)."""
        deadline = Deadline.until(deadline_at, self.cfg.request_timeout_s)
        if deadline.left() <= 0:  # it waited for this replica past its deadline: shed before any work
            return 503, json.dumps({"error": "the service is overloaded (the request waited for an HTTP replica "
                                             "past its deadline); retry later"}).encode()
        return await self._answer(body, deadline)

    async def __call__(self, request: Any) -> Any:
        """HTTP through Serve's own proxy (no edge): the same checks, on a body the proxy has read."""
        from starlette.responses import Response

        try:
            if request.method != "POST":
                raise BadRequest(405, "POST a JSON body")
            path = request.scope.get("path", "")[len(request.scope.get("root_path", "")):]
            if path not in ("", "/"):
                raise BadRequest(404, f"no such path {shown(request.url.path, 60)}; POST to the app's route")
            kind, charset = media_type(request.headers.get("content-type", "").encode("latin-1") or None)
            if kind != "application/json" or charset not in (None, "utf-8"):
                raise BadRequest(415, "Content-Type must be application/json (UTF-8), got "
                                      f"{shown(request.headers.get('content-type', 'none'), 60)}")
            body = await read_body(request.stream(), request.headers.get("content-length"),
                                   self.limits.max_request_bytes, self.cfg.body_timeout_s)
        except BadRequest as e:
            return Response(json.dumps({"error": e.message}), e.status, media_type="application/json")
        # No edge: the deadline starts once the body is read, after any wait in Serve's queue.
        status, answer = await self._answer(body, Deadline(self.cfg.request_timeout_s))
        return Response(answer, status, media_type="application/json")


@serve.deployment(num_replicas=1)
class LinkEdge:
    """The app's HTTP endpoint when ``edge_port`` is set: :class:`dist_nce.link.edge.Edge` on
    ``edge_host:edge_port`` in this replica's event loop, answering through :meth:`LinkIngress.answer`.
    One replica (it owns the port)."""

    async def __init__(self, ingress: Any, config: dict):
        keep_replica_grpc_on_loopback()
        from dist_nce.link.edge import Edge

        self.cfg = from_dict(ServeConfig, config)
        self.ingress = ingress
        self.edge = Edge(self.cfg.edge_limits(), self._link)
        self.server = await self.edge.start(self.cfg.edge_host, self.cfg.edge_port)

    async def _link(self, body: bytes, deadline_at: float) -> tuple[int, bytes]:
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        try:
            return await self.ingress.answer.remote(body, deadline_at)
        except (BackPressureError, DeploymentUnavailableError):
            return 503, json.dumps({"error": "the service is overloaded (HTTP replicas); retry later"}).encode()

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        where = f"http://{self.cfg.edge_host}:{self.cfg.edge_port}{self.cfg.route}"
        return JSONResponse({"error": f"this app answers HTTP at its edge, {where}"}, status_code=404)

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


def replica_options(cfg: ServeConfig) -> dict[str, dict]:
    """ray_actor_options per deployment: CPUs for each; GPUs (:meth:`ServeConfig.gpus`) for the
    model replicas, and for the searcher when it searches a local index (it loads the model on
    ``link.device`` to build it); the HTTP replicas and a service searcher's replica run no model."""
    cpus = {"num_cpus": cfg.replica_cpus}
    gpus = cfg.gpus()
    model = {**cpus, "num_gpus": gpus} if gpus else cpus
    return {"encoder": model, "reranker": model, "searcher": model if cfg.link.searcher == "local" else cpus,
            "ingress": cpus}


def build_app(args: dict) -> Any:
    """The application for ``serve run`` / ``serve deploy`` (``import_path: dist_nce.link.serve:build_app``);
    ``args`` are :class:`~dist_nce.link.config.ServeConfig` fields (unknown keys refused)."""
    import ray

    from dist_nce.cluster.runtime import local_ray_on_loopback
    from dist_nce.link.run_dir import check_snapshot_for_store, resolve

    if not ray.is_initialized():
        # `serve run dist_nce.link.serve:build_app run=...` (docs/linking.md) calls this builder, then starts a
        # local Ray of its own: without the loopback switch in the environment, every Ray process of it (GCS,
        # raylet, the replicas' gRPC) listened on the machine's routable address, unauthenticated.
        local_ray_on_loopback()
    cfg = from_dict(ServeConfig, args, "serve args")
    if not cfg.run and not cfg.link.model:
        raise ConfigError("serve args: run: give the run directory (runs/<name>/<time>), or link.model (a retriever "
                          "directory or BLINK biencoder file) and link.store")
    try:  # a wrong path, or a snapshot the searcher would refuse, fails here, before any replica starts
        art = resolve(cfg.run or None, cfg.link.model, cfg.link.store, cfg.link.snapshot)
        if cfg.link.searcher == "local" and cfg.link.kb == "snapshot":
            check_snapshot_for_store(art)
    except ValueError as e:  # ArtifactMismatch too
        raise ConfigError(f"serve args: {e}") from None
    if cfg.link.reranker:  # refused here, not by three failed replicas and their tracebacks
        from dist_nce.modeling.resolve import check_reranker

        try:
            check_reranker(cfg.link.reranker)
        except (OSError, ValueError) as e:
            raise ConfigError(f"serve args: link.reranker: {e}") from None
    actor = replica_options(cfg)
    # A replica queues at most max_ongoing_requests calls: room for a full batch and the next one.
    batched = 2 * cfg.max_batch_size
    encoder = MentionEncoder.options(num_replicas=cfg.encoder_replicas, ray_actor_options=actor["encoder"],
                                     max_ongoing_requests=batched).bind(
        str(art.model), cfg.link.tokenizer, cfg.link.device, cfg.max_batch_size, cfg.batch_wait_timeout_s)
    # Every HTTP replica's requests may be searching at once.
    searcher = KBSearcher.options(num_replicas=cfg.searcher_replicas, ray_actor_options=actor["searcher"],
                                  max_ongoing_requests=cfg.ingress_max_ongoing * cfg.ingress_replicas).bind(
        to_dict(cfg))
    reranker = None
    if cfg.link.reranker:
        reranker = RerankerScorer.options(num_replicas=cfg.reranker_replicas, ray_actor_options=actor["reranker"],
                                          max_ongoing_requests=batched).bind(
            cfg.link.reranker, cfg.link.tokenizer, str(art.store), cfg.link.device, cfg.link.rerank_pairs,
            cfg.max_batch_size, cfg.batch_wait_timeout_s)
    ingress = LinkIngress.options(num_replicas=cfg.ingress_replicas, ray_actor_options=actor["ingress"],
                                  max_ongoing_requests=cfg.ingress_max_ongoing,
                                  max_queued_requests=cfg.max_queued_requests).bind(
        encoder, searcher, reranker, to_dict(cfg))
    if not cfg.edge_port:
        return ingress
    # Like Serve's own proxy, the edge reserves no CPU: it waits on sockets and on the ingress.
    return LinkEdge.options(ray_actor_options={"num_cpus": 0}).bind(ingress, to_dict(cfg))


def start_local(port: int, host: str = DEFAULT_HOST) -> None:
    """Start Serve's HTTP proxy on ``host:port`` (loopback by default) in the connected Ray."""
    serve.start(http_options={"host": host, "port": int(port)})

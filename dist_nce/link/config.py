"""Configuration of the linker (Python API, jobs/link.py) and of its Ray Serve application."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dist_nce.actors.config import ServiceConfig
from dist_nce.core.config import AT_LEAST_1, POSITIVE, Range
from dist_nce.index.config import IndexConfig
from dist_nce.link.edge import EdgeLimits
from dist_nce.link.request import Limits


def _help(text: str, bounds: Range | None = None, **kw):
    return field(metadata={"help": text, **({"range": bounds} if bounds else {})}, **kw)


@dataclass
class LinkConfig:
    k: int = _help("Entities returned per mention (the reranker, when present, reorders these k).",
                   AT_LEAST_1, default=10)
    batch_size: int = _help("Mentions per mention-encoder forward.", AT_LEAST_1, default=64)
    searcher: Literal["local", "service"] = _help(
        "local: search in this process (small KBs); service: the trainer's sharded NegativeService on Ray "
        "(large KBs, e.g. the 5.9M KILT pages).", default="local")
    kb: Literal["snapshot", "encode"] = _help(
        "local searcher: snapshot = the run's exported KB embeddings (kb_snapshot/); encode = encode the "
        "prepared store in this process with the run's entity encoder.", default="snapshot")
    store: Optional[str] = _help("Prepared KB directory; default: the run's (summary.json data.prepared_dir). "
                                 "Required with model (no run).", default=None)
    model: Optional[str] = _help(
        "Link without a run: a retriever directory (Retriever.save_pretrained) or a BLINK biencoder checkpoint "
        "file (biencoder_wiki_large.bin); then store is required and the KB index comes from snapshot, "
        "kb: encode, or the service's shard_dir. None = the run's model/.", default=None)
    tokenizer: Optional[str] = _help(
        "Tokenizer directory for BLINK checkpoint files (model, reranker); None = the default model's "
        "(bert-uncased's vocabulary). Saved directories bring their own.", default=None)
    snapshot: Optional[str] = _help(
        "Local searcher, kb: snapshot: an exported KB embedding snapshot (jobs/encode_kb.py --out, a run's "
        "kb_snapshot/); used only if this model's entity encoder made it. None = the run's kb_snapshot/. "
        "Without a run it is also the service searcher's default shard_dir parent (<snapshot>/shards).",
        default=None)
    reranker: Optional[str] = _help("A reranker directory (Reranker.save_pretrained) or a BLINK cross-encoder "
                                    "checkpoint file (crossencoder_wiki_large.bin); None = none.", default=None)
    rerank_pairs: int = _help("(mention, candidate) pairs per reranker forward.", AT_LEAST_1, default=256)
    device: str = _help("Torch device of the encoders: cpu, cuda, cuda:1.", default="cpu")
    index: Optional[IndexConfig] = _help(
        "Local searcher's index; None = exact (faiss flat for dual/multi-m, torch for the others).", default=None)
    service: Optional[ServiceConfig] = _help(
        "Service searcher's shards; None = the run's own service config (summary.json), persisting under "
        "<run>/shards, where the trainer left the final index (reused when it is this model's). Without a run: "
        "service.shard_dir (or snapshot) says where the shards persist and reuse the KB's embeddings, e.g. "
        "<jobs/encode_kb.py --out>/shards with the same num_shards.", default=None)
    progress: bool = _help("Progress bars while encoding and searching.", default=True)


@dataclass
class ServeConfig:
    """The Ray Serve application (dist_nce/link/serve.py, configs/serve/link.yaml)."""

    run: str = _help("Run directory of jobs/aida_finetune.py (runs/<name>/<time>); empty = link.model and "
                     "link.store instead (e.g. BLINK's biencoder_wiki_large.bin).", default="")
    link: LinkConfig = _help("How the replicas link (k, searcher, reranker, ...).", default_factory=LinkConfig)
    encoder_replicas: int = _help("Replicas of the mention-encoder deployment.", AT_LEAST_1, default=1)
    reranker_replicas: int = _help("Replicas of the reranker deployment (when link.reranker is set).",
                                   AT_LEAST_1, default=1)
    ingress_replicas: int = _help("Replicas of the HTTP deployment (read, check, tokenize, answer).", AT_LEAST_1,
                                  default=1)
    ingress_max_ongoing: int = _help("Requests one HTTP replica works on at once (more wait in Serve's queue).",
                                     AT_LEAST_1, default=64)
    replica_cpus: float = _help("CPUs reserved per replica (fractional allowed).", Range(ge=0), default=0.5)
    max_batch_size: int = _help("@serve.batch: mentions (encoder) or mentions x k pairs / k (reranker) per "
                                "batch.", AT_LEAST_1, default=32)
    batch_wait_timeout_s: float = _help("@serve.batch: seconds a partial batch waits for more requests.",
                                        Range(ge=0), default=0.01)
    max_request_bytes: int = _help(
        "Request bodies are read as a stream and refused with 413 at this many bytes plus one, with or "
        "without a Content-Length.", AT_LEAST_1, default=1_000_000)
    body_timeout_s: float = _help("Seconds a client has to send its whole body; slower ones get 408.", POSITIVE,
                                  default=10.0)
    max_json_depth: int = _help(
        "Bodies nesting arrays/objects deeper are refused with 400 before decoding (a request needs 5: "
        "{docs: [{mentions: [[start, end]]}]}).",
        Range(ge=5, le=500, why="a request nests 5 deep; Python's JSON decoder recurses once per level"),
        default=16)
    max_docs: int = _help("Requests with more docs are refused with 413.", AT_LEAST_1, default=64)
    max_text_chars: int = _help("Docs whose text (or KILT input) is longer, in characters, are refused with 413.",
                                AT_LEAST_1, default=100_000)
    max_mentions: int = _help("Requests with more mentions in all are refused with 413 (checked before "
                              "tokenizing).", AT_LEAST_1, default=256)
    max_mentions_per_doc: int = _help("Docs with more mentions (spans, or KILT [START_ENT] markers) are refused "
                                      "with 413.", AT_LEAST_1, default=256)
    max_span_chars: int = _help("Mention spans longer, in characters, are refused with 413.", AT_LEAST_1,
                                default=1000)
    max_k: int = _help("Requests asking for more entities per mention (k) are refused with 413; k is also at "
                       "most the KB's entities.", AT_LEAST_1, default=100)
    request_timeout_s: float = _help(
        "Seconds one request may take from its arrival (at the edge: when its head arrives; through Serve's "
        "proxy: when an HTTP replica takes it). The edge sheds with 503 a request that cannot be served in what "
        "is left; a stage (tokenize, encode, search, rerank) that runs past it gets 504 naming it.", POSITIVE,
        default=15.0)
    max_queued_requests: int = _help(
        "Requests waiting for an HTTP replica (beyond ingress_max_ongoing each), at the edge and in Serve's "
        "queue; more get 503.", AT_LEAST_1, default=256)
    edge_port: int = _help(
        "Port of the linker's HTTP edge (dist_nce/link/edge.py), the endpoint for clients: it checks heads and "
        "bodies before reading them, closes idle connections and sheds load (run it with Serve's proxy off, "
        "proxy_location: Disabled, as configs/serve/link.yaml does). 0 = no edge: Serve's own proxy serves the "
        "app, with none of those limits (development).", Range(ge=0, le=65535), default=0)
    edge_host: str = _help("Address the edge listens on; loopback unless you put authentication in front.",
                           default="127.0.0.1")
    route: str = _help("Path the edge answers (POST); any other gets 404.", default="/")
    header_timeout_s: float = _help("Edge: seconds from a request head's first byte to its end; slower: 408.",
                                    POSITIVE, default=10.0)
    idle_timeout_s: float = _help("Edge: seconds a connection may stay open without starting a request.",
                                  POSITIVE, default=10.0)
    max_header_bytes: int = _help("Edge: request heads over this many bytes get 431.", Range(ge=1024),
                                  default=16384)
    max_connections: int = _help("Edge: open connections at most; more get 503 and are closed.", AT_LEAST_1,
                                 default=512)
    max_buffered_bytes: int = _help(
        "Edge: bytes of request bodies held at once (read, or waiting for an HTTP replica); a body that "
        "would pass it gets 503. With max_connections x 128 KiB of socket buffers, the edge's bound on "
        "request memory.", AT_LEAST_1, default=64_000_000)
    replica_gpus: Optional[float] = _help(
        "GPUs per encoder and reranker replica, and per searcher replica when it searches a local index; "
        "None = 1 with a cuda link.device, else 0.", Range(ge=0), default=None)
    searcher_replicas: int = _help(
        "Replicas of the search deployment (each holds the KB index, or with link.searcher: service one set of "
        "shard actors); every HTTP replica searches through it.", AT_LEAST_1, default=1)

    def validate(self) -> None:
        # A request without "k" gets link.k: over max_k, every such request was refused with a 413 naming a k
        # the client never sent.
        if self.link.k > self.max_k:
            raise ValueError(f"link.k: {self.link.k}: over max_k ({self.max_k}), so every request that does not "
                             "give its own k would be refused; lower link.k or raise max_k")

    def limits(self) -> Limits:
        """The request limits of :mod:`dist_nce.link.request`."""
        return Limits(self.max_request_bytes, self.max_json_depth, self.max_docs, self.max_text_chars,
                      self.max_mentions, self.max_mentions_per_doc, self.max_span_chars, self.max_k)

    def edge_limits(self) -> EdgeLimits:
        """What the edge (:mod:`dist_nce.link.edge`) lets through; its slots are the HTTP replicas'."""
        return EdgeLimits(self.route, self.max_request_bytes, self.max_header_bytes, self.max_buffered_bytes,
                          self.max_connections, self.header_timeout_s, self.idle_timeout_s, self.body_timeout_s,
                          self.request_timeout_s, self.ingress_max_ongoing * self.ingress_replicas,
                          self.max_queued_requests)

    def gpus(self) -> float:
        """GPUs of an encoder or reranker replica (``replica_gpus``, or 1 on a cuda device)."""
        if self.replica_gpus is not None:
            return self.replica_gpus
        return 1.0 if self.link.device.startswith("cuda") else 0.0

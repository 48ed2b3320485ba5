"""The Ray Serve app against a real local Serve, through a real HTTP client; the service searcher."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]
# Serve's access log (a line per request at INFO, forwarded to this process's output by Ray) off: the
# tests read answers, not logs, and the 200-request test printed hundreds of lines into `make test`.
QUIET = {"enable_access_log": False}


def post(url: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


_PRIOR_LISTENERS: set = set()


def _listeners(proc) -> set:
    return {c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def server(ray_local, tiny_run, tiny_reranker, blink_files, tiny_store):
    from ray import serve

    from dist_nce.cluster.runtime import free_port
    from dist_nce.link.serve import build_app, start_local

    # What this pytest process already listened on (an earlier test file in the same xdist worker may
    # leave e.g. torch's TCPStore on '::'); the loopback test judges what serving opened.
    _PRIOR_LISTENERS.update(_listeners(psutil.Process()))
    port = free_port()
    start_local(port)
    # 0.2 CPUs x 3 (link) + 4 (rerank) replicas leave room for the service tests' shards on 2 CPUs.
    args = {"run": str(tiny_run), "link": {"k": 3}, "replica_cpus": 0.2, "max_request_bytes": 20_000,
            "max_mentions": 8, "max_batch_size": 16}
    serve.run(build_app(args), name="link", route_prefix="/link", logging_config=QUIET)
    serve.run(build_app({**args, "link": {"k": 3, "reranker": str(tiny_reranker)}}), name="rerank",
              route_prefix="/rerank", logging_config=QUIET)
    # BLINK's released files (tiny, their layouts) and no run; no CPUs reserved, so the service test
    # below still finds room for its shards on the 2-CPU cluster.
    blink = {**args, "run": "", "replica_cpus": 0, "link": {**blink_link(blink_files, tiny_store), "k": 3}}
    serve.run(build_app(blink), name="blink", route_prefix="/blink", logging_config=QUIET)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def entity_rows(docs: list[dict]) -> list:
    return [[[e["row"] for e in m["entities"]] for m in d["mentions"]] for d in docs]


def assert_same_ranking(got: list[dict], want: list[dict], atol: float = 1e-4) -> None:
    """The same top-k up to near-ties: scores agree rank by rank within ``atol``, a row in both
    lists has the same score in both, and a row in one list only ties (within ``atol``) with the
    other list's last score. (Shards that re-encode the KB in other batches than the exported
    snapshot get embeddings that differ in the last bits, which reorders rows tied to ~1e-6.)"""
    for g, w in zip(got, want, strict=True):
        for gm, wm in zip(g["mentions"], w["mentions"], strict=True):
            assert gm["span"] == wm["span"]
            mine = {e["row"]: e["score"] for e in gm["entities"]}
            theirs = {e["row"]: e["score"] for e in wm["entities"]}
            np.testing.assert_allclose(list(mine.values()), list(theirs.values()), atol=atol, err_msg=str(gm))
            for a, b in ((mine, theirs), (theirs, mine)):
                for row, score in a.items():
                    if row in b:
                        assert abs(score - b[row]) <= atol, (row, gm, wm)
                    else:  # cut off at the other list's end: only a tie with its last entry may be
                        assert score <= min(b.values()) + atol, (row, gm, wm)


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert entity_rows(got) == entity_rows(want)
    for g, w in zip(got, want):
        for gm, wm in zip(g["mentions"], w["mentions"]):
            assert (gm["span"], gm["mention"]) == (wm["span"], wm["mention"])
            for key in ("score", "rerank_score"):
                if key in wm["entities"][0]:
                    np.testing.assert_allclose([e[key] for e in gm["entities"]], [e[key] for e in wm["entities"]],
                                               atol=1e-4)


def test_http_answers_equal_the_python_api(server, tiny_run, tiny_reranker, dev_file):
    from dist_nce.link import Linker
    from kb.kilt import split_marked_input

    docs = [json.loads(line) for line in open(dev_file, encoding="utf-8")][:5]
    docs.append({"text": "Tulsa lies in Oklahoma near Arkansas .", "mentions": [[14, 22], [28, 36]]})
    # the first KILT input again as BLINK's mention line: the same mention, so the same entities
    left, mention, right = split_marked_input(docs[0]["input"], "dev", 0)
    docs.append({"context_left": left + " ", "mention": mention, "context_right": right, "query_id": "q0"})
    status, got = post(f"{server}/link", {"docs": docs})
    assert status == 200, got
    assert_same(got["docs"], Linker.from_pretrained(tiny_run, k=3, progress=False).link(docs))
    assert [e["row"] for e in got["docs"][-1]["mentions"][0]["entities"]] == \
        [e["row"] for e in got["docs"][0]["mentions"][0]["entities"]]
    status, got = post(f"{server}/rerank", {"docs": docs[:3], "k": 3})
    assert status == 200, got
    want = Linker.from_pretrained(tiny_run, k=3, progress=False, reranker=str(tiny_reranker)).link(docs[:3])
    assert "rerank_score" in got["docs"][0]["mentions"][0]["entities"][0]
    assert_same(got["docs"], want)


def blink_link(blink_files, tiny_store) -> dict:
    bi, cross = blink_files
    return {"model": str(bi), "reranker": str(cross), "store": str(tiny_store), "kb": "encode"}


def test_blink_files_are_served_with_no_run(server, blink_files, tiny_store, dev_file):
    from dist_nce.link import Linker

    docs = [json.loads(line) for line in open(dev_file, encoding="utf-8")][:4]
    status, got = post(f"{server}/blink", {"docs": docs})
    assert status == 200, got
    want = Linker.from_pretrained(k=3, progress=False, **blink_link(blink_files, tiny_store)).link(docs)
    assert "rerank_score" in got["docs"][0]["mentions"][0]["entities"][0]
    assert_same(got["docs"], want)


def test_a_dev_mention_gets_the_same_top1_from_api_job_and_serve(server, tiny_run, dev_file, tmp_path):
    from dist_nce.link import Linker

    line = json.loads(open(dev_file, encoding="utf-8").readline())
    doc = {"id": line["id"], "input": line["input"]}
    api = Linker.from_pretrained(tiny_run, k=3, progress=False).link([doc])[0]["mentions"][0]["entities"][0]
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps(doc) + "\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "jobs/link.py", "--run", str(tiny_run), "--input", str(src), "--output",
                        str(out), "--k", "3"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    job = json.loads(out.read_text())["mentions"][0]["entities"][0]
    status, got = post(f"{server}/link", doc)
    assert status == 200, got
    http = got["docs"][0]["mentions"][0]["entities"][0]
    assert (api["id"], api["title"]) == (job["id"], job["title"]) == (http["id"], http["title"])


def test_200_concurrent_requests_all_succeed(server):
    words = "Tulsa lies in Oklahoma near Arkansas and the Ozark mountains".split()

    def one(i: int) -> tuple[int, float, dict]:
        a = i % (len(words) - 1)
        text = " ".join(words)
        start = sum(len(w) + 1 for w in words[:a])
        doc = {"text": text, "mentions": [[start, start + len(words[a])]]}
        t0 = time.perf_counter()
        status, body = post(f"{server}/link", {"docs": [doc]})
        return status, time.perf_counter() - t0, body

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(200)))
    bad = [(s, b) for s, _, b in results if s != 200]
    assert not bad, bad[:3]
    assert all(len(b["docs"][0]["mentions"][0]["entities"]) == 3 for _, _, b in results)
    # the same request always gets the same ranking, however it was batched
    by_mention = {}
    for i, (_, _, b) in enumerate(results):
        by_mention.setdefault(i % (len(words) - 1), set()).add(tuple(entity_rows(b["docs"])[0][0]))
    assert all(len(v) == 1 for v in by_mention.values())
    lat = sorted(t for _, t, _ in results)
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    print(f"\n200 concurrent requests (32 client threads): p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    good = {"docs": [{"text": "Paris is in France .", "mentions": [[12, 18]]}]}
    cases = [
        ({"docs": [{"text": "Paris is in France ."}]}, 422, "doc 0: field 'mentions': missing"),
        ({"docs": [{"text": "Paris", "mentions": [[0, 1]]}, {"text": "Paris", "mentions": [[3, 40]]}]}, 422,
         "doc 1: field 'mentions[0]': span [3, 40) is outside the text"),
        ({"docs": [{"text": "", "mentions": [[0, 1]]}]}, 422, "doc 0: field 'text': empty text"),
        ({"docs": [{"text": "x " * 20_000, "mentions": [[0, 1]]}]}, 413, "limit is 20000"),
        ({"docs": [{"text": "a b c d e f g h i", "mentions": [[2 * i, 2 * i + 1] for i in range(9)]}]}, 413,
         "9 mentions in one request; the limit is 8"),
        (b"{not json", 400, "body is not JSON"),
        ({"docs": "Paris"}, 400, "expected {'docs': [...]}"),
        ({"docs": [good["docs"][0]], "k": 0}, 422, "field 'k': 0; must be at least 1"),
        ({"docs": [], "kk": 3}, 400, "unknown request field(s) ['kk']"),
    ]
    for body, status, needle in cases:
        got_status, got = post(f"{server}/link", body)
        assert (got_status, needle in got.get("error", "")) == (status, True), (body if len(str(body)) < 200 else
                                                                                  status, got_status, got)
        ok_status, ok = post(f"{server}/link", good)
        assert ok_status == 200 and ok["docs"][0]["mentions"][0]["mention"] == "France"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{server}/link", timeout=60)  # GET
    assert e.value.code == 405


def test_nothing_listens_beyond_loopback_while_serving(server):
    """Every listening socket of this process's tree (the local Ray, the Serve proxy, the
    replicas' inter-deployment gRPC servers) is on loopback: none of them authenticates."""
    import ipaddress

    listeners = []  # (pid, process title, address)
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            title = " ".join(proc.cmdline())[:80]
            listeners += [(proc.pid, title, c.laddr) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN and not (proc == me and c.laddr in _PRIOR_LISTENERS)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip.split("%")[0])
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    replicas = [entry for entry in listeners if "ServeReplica" in entry[1]]
    assert replicas, f"no Serve replica listens in this process tree: {listeners}"
    assert [entry for entry in listeners if not loopback(entry[2].ip)] == []


# `serve run dist_nce.link.serve:build_app run=...` (docs/linking.md): Ray 2.60's CLI builds the app, then starts
# a local Ray unless one is up (ray.serve.scripts.run). "local" here, where the CLI has no address: on a machine
# where a `ray start` head is up (another test's), the CLI would join that head instead, and this would not test.
SERVE_RUN = r"""
import json, sys
import psutil
from dist_nce.link.serve import build_app

build_app({"run": sys.argv[1]})
import ray

ray.init(address="local", namespace="serve", num_cpus=1)
me = psutil.Process()
listeners = []
for proc in [me, *me.children(recursive=True)]:
    try:
        listeners += [[" ".join(proc.cmdline())[:60], c.laddr.ip] for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
print(json.dumps({"node_ip": ray.util.get_node_ip_address(), "listeners": listeners}))
ray.shutdown()
"""


def test_serve_run_of_the_app_builder_starts_ray_on_loopback(tiny_run):
    """Without the loopback switch in the shell's environment (the documented development command sets none),
    the Ray that `serve run` starts after calling the builder listened on the machine's routable address: GCS,
    raylet and every replica's gRPC server, none authenticated. The builder now sets the switch first."""
    import ipaddress

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-c", SERVE_RUN, str(tiny_run)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["node_ip"] == "127.0.0.1"
    assert len(seen["listeners"]) >= 2, seen  # the GCS and the raylet at least
    mapped = [ipaddress.ip_address(ip.split("%")[0]) for _, ip in seen["listeners"]]
    assert [entry for entry, a in zip(seen["listeners"], mapped)
            if not (getattr(a, "ipv4_mapped", None) or a).is_loopback] == []


def test_what_every_replica_would_fail_on_is_refused_before_any_starts(tiny_run, tiny_reranker, blink_files, tmp_path):
    """A wrong link.reranker started Ray and every deployment; the reranker's replicas then failed three times
    (178 lines of tracebacks) and the deploy ended in a RuntimeError. A default k over max_k started, and then
    refused every request that gave no k, naming a k its client never sent. Both now fail in the builder, as a
    wrong run directory does (serve_link: one line, exit 2)."""
    from dist_nce.cli.serve_link import main as serve_link
    from dist_nce.core.config import ConfigError
    from dist_nce.link.serve import build_app

    run = str(tiny_run)
    for reranker, why in ((tmp_path / "nope", r"nope: not found; expected a dist-nce reranker directory"),
                          (tiny_run / "model", r"model/manifest\.json: field 'kind' is 'retriever', expected 'reranker'"),
                          (blink_files[0], r"biencoder_wiki_large\.bin: unexpected keys cand_encoder\.")):
        with pytest.raises(ConfigError, match=rf"^serve args: link\.reranker: \S*{why}"):
            build_app({"run": run, "link": {"reranker": str(reranker)}})
    build_app({"run": run, "link": {"reranker": str(tiny_reranker)}})  # a reranker directory
    build_app({"run": run, "link": {"reranker": str(blink_files[1])}})  # BLINK's cross-encoder file
    with pytest.raises(ConfigError, match=r"link\.k: 101: over max_k \(100\), so every request that does not "):
        build_app({"run": run, "link": {"k": 101}})
    build_app({"run": run, "link": {"k": 101}, "max_k": 101})
    config = tmp_path / "serve.yaml"
    config.write_text(f"applications:\n- name: link\n  import_path: dist_nce.link.serve:build_app\n  args:\n"
                      f"    run: {tiny_run}\n    link: {{reranker: {tmp_path / 'nope'}}}\n")
    assert serve_link([str(config)]) == 2


def test_the_service_searcher_answers_as_the_local_index(ray_local, tiny_run, dev_file, tmp_path):
    from dist_nce.link import Linker

    docs = [json.loads(line) for line in open(dev_file, encoding="utf-8")]
    local = Linker.from_pretrained(tiny_run, k=4, progress=False).link(docs)
    # fp32 re-encoding, as the snapshot was made: encode_dtype auto is bf16 on a CPU with AVX512-BF16
    # or AMX, and bf16 embeddings move these scores by up to ~0.2 (a precision choice, not a bug).
    service = {"num_shards": 2, "num_cpus": 0.25, "shard_dir": str(tmp_path / "shards"), "encode_dtype": "fp32"}
    with Linker.from_pretrained(tiny_run, k=4, progress=False, searcher="service", service=service) as linker:
        assert linker.searcher.num_shards == 2
        assert_same_ranking(linker.link(docs), local)


def test_the_service_searcher_serves_the_stores_current_kb_version(ray_local, tiny_run, tmp_path, capsys):
    """A persisted index encoded before a KB delta (a run's shards, then jobs/update_kb.py): the service
    searcher serves the store's current version, as the in-process encode does: removed entities never
    returned, added ones ranked; k is bounded by the live entities."""
    import shutil

    from dist_nce.link import Linker
    from kb.delta import UpdateConfig, update
    from kb.store import EntityStore

    store = tmp_path / "store"
    shutil.copytree(tiny_run.parent / "data" / "prepared", store)
    service = {"num_shards": 2, "num_cpus": 0.25, "shard_dir": str(tmp_path / "shards"), "encode_dtype": "fp32"}
    docs = [{"text": "Paris is in France and Berlin in Germany .", "mentions": [[0, 5], [12, 18], [23, 29]]}]
    with Linker.from_pretrained(tiny_run, k=4, progress=False, searcher="service", store=str(store),
                                service=service) as linker:
        linker.link(docs)  # version 0 encoded and persisted in shard_dir
    before = EntityStore(store)
    gone = before.source_ids([0, 1, 2])
    (tmp_path / "gone.txt").write_text("".join(i + "\n" for i in gone))
    source = tiny_run.parent / "data" / "synthetic" / "kilt_knowledgesource.json"
    pages = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()[:2]]
    for i, page in enumerate(pages):
        page["wikipedia_id"] = page["_id"] = str(990000 + i)
    (tmp_path / "new.json").write_text("".join(json.dumps(p) + "\n" for p in pages))
    update(UpdateConfig(store=str(store), add=[str(tmp_path / "new.json")], remove=str(tmp_path / "gone.txt")),
           log=lambda s: None)
    after = EntityStore(store)
    live = after.num_live
    assert after.kb_version == 1 and live == before.num_entities - 1
    with pytest.raises(ValueError, match=r"changed by KB deltas since \(kb_version 1\): link with --searcher service"):
        Linker.from_pretrained(tiny_run, k=4, progress=False, store=str(store))  # the run's snapshot: version 0
    # The Serve app refuses that snapshot before any replica starts (each replica used to load the model and fail,
    # three times, and the deploy ended in a traceback), and the command line says so in one line
    from dist_nce.cli.serve_link import main as serve_link
    from dist_nce.core.config import ConfigError
    from dist_nce.link.serve import build_app

    with pytest.raises(ConfigError, match=r"serve args: .*kb_snapshot: \d+ entities, the store .* changed by KB del"):
        build_app({"run": str(tiny_run), "link": {"store": str(store)}})
    build_app({"run": str(tiny_run), "link": {"store": str(store), "kb": "encode"}})  # or searcher: service
    config = tmp_path / "serve.yaml"
    config.write_text(f"applications:\n- name: link\n  import_path: dist_nce.link.serve:build_app\n  args:\n"
                      f"    run: {tiny_run}\n    link: {{store: {store}}}\n")
    assert serve_link([str(config)]) == 2
    assert "changed by KB deltas since (kb_version 1)" in capsys.readouterr().err
    encoded = Linker.from_pretrained(tiny_run, k=live, progress=False, kb="encode", store=str(store)).link(docs)
    with Linker.from_pretrained(tiny_run, k=live, progress=False, searcher="service", store=str(store),
                                service=service) as linker:
        got = linker.link(docs)
        with pytest.raises(ValueError, match=rf"k must be an integer in \[1, {live}\]"):
            linker.link(docs, k=live + 1)
    ids = [{e["id"] for e in m["entities"]} for m in got[0]["mentions"]]
    assert all(not (set(gone) & m) and {"990000", "990001"} <= m for m in ids), ids
    assert_same_ranking(got, encoded)


def bound_deployments(app) -> dict:
    """name -> Deployment of an application and every deployment bound into it."""
    from ray.serve.deployment import Application

    out, todo = {}, [app]
    while todo:
        d = todo.pop()._bound_deployment
        out[d.name] = d
        todo += [a for a in [*d.init_args, *d.init_kwargs.values()] if isinstance(a, Application)]
    return out


def test_gpu_replicas_reserve_their_gpu_and_the_ingress_queue_is_bounded(tiny_run, tiny_reranker):
    from dist_nce.link.serve import build_app

    base = {"run": str(tiny_run), "replica_cpus": 0.5, "max_queued_requests": 7}
    cpu = bound_deployments(build_app({**base, "link": {"reranker": str(tiny_reranker)}}))
    assert set(cpu) == {"LinkIngress", "MentionEncoder", "KBSearcher", "RerankerScorer"}
    assert all(d.ray_actor_options == {"num_cpus": 0.5} for d in cpu.values())
    assert cpu["LinkIngress"].max_queued_requests == 7
    cuda = bound_deployments(build_app({**base, "link": {"device": "cuda", "reranker": str(tiny_reranker)}}))
    gpus = {name: d.ray_actor_options.get("num_gpus", 0) for name, d in cuda.items()}
    # the ingress runs no model (tokenizer and store only)
    assert gpus == {"LinkIngress": 0, "MentionEncoder": 1, "KBSearcher": 1, "RerankerScorer": 1}
    shared = bound_deployments(build_app({**base, "replica_gpus": 0.5, "link": {"device": "cuda:1",
                                                                                 "searcher": "service"}}))
    # a service searcher's replica only hands the weights to the shards (their GPUs: service.num_gpus)
    assert {n: d.ray_actor_options.get("num_gpus", 0) for n, d in shared.items()} == {
        "LinkIngress": 0, "MentionEncoder": 0.5, "KBSearcher": 0}


def test_http_replicas_share_one_set_of_shards(server, tiny_run, dev_file, tmp_path):
    """Two HTTP replicas, searcher: service: one KBSearcher, so one set of shard actors, and both
    replicas' answers equal the Python API's."""
    from ray import serve
    from ray.util.state import list_actors

    from dist_nce.link import Linker
    from dist_nce.link.serve import build_app

    import ray

    # This cluster's state API by its address: with other local clusters up (pytest-xdist's other
    # worker), autodetection refuses to pick one.
    here = ray.get_runtime_context().gcs_address

    def shards() -> int:
        return len(list_actors(address=here, filters=[("class_name", "=", "EntityShard"), ("state", "=", "ALIVE")]))

    before = shards()
    service = {"num_shards": 2, "num_cpus": 0.25, "shard_dir": str(tmp_path / "shards"), "encode_dtype": "fp32"}
    args = {"run": str(tiny_run), "link": {"k": 4, "searcher": "service", "service": service}, "replica_cpus": 0,
            "ingress_replicas": 2}
    serve.run(build_app(args), name="shared", route_prefix="/shared", logging_config=QUIET)
    try:
        assert shards() - before == 2
        replicas = list_actors(address=here, filters=[("class_name", "=", "ServeReplica:shared:LinkIngress"),
                                                      ("state", "=", "ALIVE")])
        assert len(replicas) == 2
        docs = [json.loads(line) for line in open(dev_file, encoding="utf-8")][:4]
        want = Linker.from_pretrained(tiny_run, k=4, progress=False).link(docs)
        with ThreadPoolExecutor(8) as pool:  # enough at once that both HTTP replicas answer some
            got = list(pool.map(lambda _: post(f"{server}/shared", {"docs": docs}), range(16)))
        for status, body in got:
            assert status == 200, body
            assert_same_ranking(body["docs"], want)
    finally:
        serve.delete("shared")
    deadline = time.time() + 60
    while shards() != before and time.time() < deadline:  # the searcher replica stopped its shards
        time.sleep(1)
    assert shards() == before

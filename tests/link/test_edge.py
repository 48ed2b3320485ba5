"""The linker's HTTP edge (dist_nce/link/edge.py) on loopback with a stand-in for the ingress (no Ray):
what it refuses before reading, its timeouts, its memory budget and its load shedding."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dist_nce.link.edge import Admission, Edge, EdgeLimits, Shed, ShortDeadline, media_type

LIMITS = EdgeLimits(route="/link", max_request_bytes=1000, max_header_bytes=2048, max_buffered_bytes=3000,
                    max_connections=50, header_timeout_s=0.3, idle_timeout_s=0.3, body_timeout_s=0.5,
                    request_timeout_s=5.0, slots=2, max_queued=4)


class Server:
    """An Edge in a thread of its own; ``calls`` records what reached the stand-in ingress."""

    def __init__(self, limits: EdgeLimits = LIMITS, work_s: float = 0.0):
        self.calls: list[tuple[int, float]] = []
        self.work_s = work_s
        self.loop = asyncio.new_event_loop()
        self.edge = Edge(limits, self.link)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(self.edge.start("127.0.0.1", 0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def link(self, body: bytes, deadline_at: float) -> tuple[int, bytes]:
        self.calls.append((len(body), deadline_at - time.time()))
        await asyncio.sleep(self.work_s)
        return 200, json.dumps({"docs": [], "bytes": len(body)}).encode()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # connections still lingering after a refusal
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def edge():
    server = Server()
    yield server
    server.close()


def request(port: int, body: bytes = b"{}", method: str = "POST", path: str = "/link",
            headers: dict | None = None) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def raw(port: int, data: bytes, read_timeout: float = 5.0) -> tuple[bytes, float]:
    """Send ``data``, read until the edge closes; (what came back, seconds until it closed)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(read_timeout)
    t0 = time.perf_counter()
    try:
        if data:
            s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got, time.perf_counter() - t0
    finally:
        s.close()


def test_accepted_requests_reach_the_ingress_with_their_deadline(edge):
    edge.calls.clear()
    assert request(edge.port, b'{"docs": []}') == (200, {"docs": [], "bytes": 12})
    assert request(edge.port, b"{}", path="/link/?x=1")[0] == 200
    assert request(edge.port, headers={"Content-Type": "application/json; charset=UTF-8"})[0] == 200
    assert request(edge.port, headers={"X-Request-Timeout-Seconds": "0.8"})[0] == 200
    left = [d for _, d in edge.calls]
    assert 4.5 < left[0] <= 5.0 and 0.3 < left[-1] <= 0.8, left


def test_two_requests_on_one_connection(edge):
    c = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
    for _ in range(2):
        c.request("POST", "/link", body=b"{}", headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert (r.status, r.getheader("connection")) == (200, None)
        r.read()
    c.close()


@pytest.mark.parametrize("kwargs, status, needle", [
    ({"path": "/nope"}, 404, "no such path '/nope'; POST to /link"),
    ({"path": "/link/x"}, 404, "no such path '/link/x'"),
    ({"method": "GET", "body": None}, 405, "POST a JSON body"),
    ({"method": "PUT"}, 405, "POST a JSON body"),
    ({"headers": {"Content-Type": "text/plain"}}, 415, "Content-Type must be application/json"),
    ({"headers": {"Content-Type": "application/json; charset=latin-1"}}, 415, "charset=latin-1"),
    ({"body": b"x" * 1001}, 413, "body of 1001 bytes; the limit is 1000"),
    ({"headers": {"X-Request-Timeout-Seconds": "soon"}}, 400, "is not a number"),
    ({"headers": {"X-Request-Timeout-Seconds": "-1"}}, 400, "must be positive"),
    ({"headers": {"X-Request-Timeout-Seconds": "nan"}}, 400, "must be positive"),  # min(15, nan) was 15
    ({"headers": {"X-Big": "y" * 3000}}, 431, "the limit is 2048"),
])
def test_refused_on_the_head_without_reaching_the_ingress(edge, kwargs, status, needle):
    edge.calls.clear()
    got, answer = request(edge.port, **kwargs)
    assert got == status and needle in answer["error"], answer
    assert edge.calls == []


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(edge):
    head = b"POST /link HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10485760\r\n\r\n"
    got, seconds = raw(edge.port, head)  # no body sent at all: the answer comes anyway
    assert got.startswith(b"HTTP/1.1 413") and b"body of 10485760 bytes; the limit is 1000" in got, got
    assert seconds < 3.5  # the answer, then at most 2 s of lingering for the client's bytes


def test_a_chunked_body_is_cut_at_the_limit():
    server = Server()
    try:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /link HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            for _ in range(2000):  # up to 1 MB, 512 bytes a chunk; the edge answers after ~1 kB
                s.sendall(b"200\r\n" + b"x" * 512 + b"\r\n")
                sent += 512
        except OSError:
            pass
        s.settimeout(5)
        got = s.recv(65536)
        s.close()
        assert got.startswith(b"HTTP/1.1 413") and b"body larger than 1000 bytes" in got, got
        assert server.calls == [] and server.edge.buffered == 0
    finally:
        server.close()


def test_idle_connections_and_slow_heads_are_closed(edge):
    got, seconds = raw(edge.port, b"")
    assert got == b"" and 0.25 < seconds < 2, seconds
    got, seconds = raw(edge.port, b"POST /link HTTP/1.1\r\nHost: x\r\n")
    assert got.startswith(b"HTTP/1.1 408") and b"request head not received within 0.3 s" in got, got


def test_a_slow_body_gets_408(edge):
    got, _ = raw(edge.port, b"POST /link HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{")
    assert got.startswith(b"HTTP/1.1 408") and b"request body not received within 0.5 s" in got, got


def test_bodies_past_the_buffer_budget_get_503():
    """max_buffered_bytes 3000: four 900-byte bodies sent slowly, at once, do not all fit."""
    server = Server()
    try:
        def slow_body(_: int) -> bytes:
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /link HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 950\r\n\r\n" + b" " * 900)
            time.sleep(0.2)  # all four are in the edge's buffers now
            try:
                s.sendall(b" " * 50)
            except OSError:
                pass
            s.settimeout(5)
            got = s.recv(65536)
            s.close()
            return got[:12]

        with ThreadPoolExecutor(4) as pool:
            statuses = sorted(pool.map(slow_body, range(4)))
        assert statuses.count(b"HTTP/1.1 200") == 3 and statuses.count(b"HTTP/1.1 503") == 1, statuses
        assert server.edge.buffered == 0
    finally:
        server.close()


def test_connections_past_the_limit_get_503():
    server = Server(EdgeLimits(**{**LIMITS.__dict__, "max_connections": 2, "idle_timeout_s": 5.0}))
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        time.sleep(0.1)
        got, _ = raw(server.port, b"")
        assert got.startswith(b"HTTP/1.1 503") and b"2 connections are open" in got, got
        for s in held:
            s.close()
    finally:
        server.close()


def test_a_storm_is_shed_within_its_deadline():
    """2 slots, 0.2 s of work each, a 1 s deadline, 30 clients at once: about 10 can be served in
    time; the rest are shed with 503 before their deadline."""
    server = Server(EdgeLimits(**{**LIMITS.__dict__, "request_timeout_s": 1.0, "max_queued": 100}), work_s=0.2)
    try:
        barrier = threading.Barrier(30)

        def client(_: int) -> tuple[int, float]:
            barrier.wait()
            t0 = time.perf_counter()
            status, _ = request(server.port)
            return status, time.perf_counter() - t0

        with ThreadPoolExecutor(30) as pool:
            answers = list(pool.map(client, range(30)))
        statuses = [s for s, _ in answers]
        assert set(statuses) == {200, 503} and 4 <= statuses.count(200) <= 12, statuses
        assert max(t for _, t in answers) < 1.5, answers
    finally:
        server.close()


def test_admission_sheds_a_full_queue_and_a_late_request():
    async def run() -> None:
        now = [0.0]
        adm = Admission(slots=1, max_queued=1, clock=lambda: now[0])
        assert await adm.enter(10.0) == 0.0
        waiter = asyncio.ensure_future(adm.enter(10.0))  # waits: the one slot is taken
        await asyncio.sleep(0)
        with pytest.raises(Shed, match="1 requests are already waiting"):
            await adm.enter(10.0)
        adm.leave(2.0)  # the first took 2 s once in
        assert await waiter == 0.0 and adm.service_s == 2.0
        adm.leave(4.0)
        assert adm.service_s == pytest.approx(2.4)
        with pytest.raises(ShortDeadline, match="deadline leaves 2 s, and requests take 2.4 s once in; give it more"):
            await adm.enter(2.0)  # 2 s left, 2.4 s needed, none waiting: the client's deadline, not a load
        assert await adm.enter(10.0) == 0.0  # the slot is taken now
        with pytest.raises(Shed, match="recent requests take 2.4 s"):
            await adm.enter(2.0)  # too little time while the slot is taken: shed at once

    asyncio.run(run())


def test_a_deadline_shorter_than_requests_take_is_a_504_and_every_answer_has_its_reason_phrase():
    server = Server(work_s=0.05)
    try:
        def post(headers: dict) -> tuple[int, str, dict]:
            c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                c.request("POST", "/link", body=b"{}", headers={"Content-Type": "application/json", **headers})
                r = c.getresponse()
                return r.status, r.reason, json.loads(r.read())
            finally:
                c.close()

        assert post({})[:2] == (200, "OK")  # requests take ~0.05 s once in from now on
        status, reason, answer = post({"X-Request-Timeout-Seconds": "0.001"})
        assert (status, reason) == (504, "Gateway Timeout"), answer
        assert "give it more time (X-Request-Timeout-Seconds)" in answer["error"]
        assert "overloaded" not in answer["error"] and len(server.calls) == 1
    finally:
        server.close()


def test_media_type():
    assert media_type(b"Application/JSON; Charset=\"UTF-8\"") == ("application/json", "utf-8")
    assert media_type(None) == ("", None)

"""benchmarks/serve_load.py's load generator and statistics, against the HTTP edge with a stand-in for
the linker (no Ray; the whole benchmark needs a Serve app: ``python -m benchmarks.serve_load --quick``)."""
from __future__ import annotations

import asyncio
import json
import threading

from benchmarks import serve_load
from dist_nce.link.edge import Edge, EdgeLimits


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert [serve_load.percentile(values, q) for q in (50, 95, 99, 100)] == [50.0, 95.0, 99.0, 100.0]
    assert serve_load.percentile([3.0], 99) == 3.0 and serve_load.percentile([], 50) is None


def test_a_storm_counts_answers_and_sheds():
    """One slot, 0.1 s a request, a 0.35 s deadline, 8 clients x 2 requests at once: some are
    answered, the rest shed, every one counted once."""
    loop = asyncio.new_event_loop()

    async def link(body: bytes, deadline_at: float) -> tuple[int, bytes]:
        await asyncio.sleep(0.1)
        return 200, json.dumps({"docs": []}).encode()

    edge = Edge(EdgeLimits(route="/link", slots=1, request_timeout_s=0.35), link)
    server = loop.run_until_complete(edge.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        results, wall = serve_load.storm(server.sockets[0].getsockname()[1], "/link", [b"{}"], 8, 2, timeout_s=10)
    finally:
        async def stop() -> None:
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    s = serve_load.summary(results, wall)
    assert s["requests"] == 16 and s["failed"] == 0 and s["late"] == 0
    assert 2 <= s["ok"] <= 14 and s["shed"] == (16 - s["ok"]) / 16, s
    assert 0.09 < s["p50_s"] <= s["p95_s"] <= s["p99_s"] < 0.35 + 0.5 and s["ok_per_s"] > 0
    assert serve_load.spread_of([s, {**s, "p50_s": None}], "p50_s")["median"] == s["p50_s"]

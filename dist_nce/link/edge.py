"""The linker's HTTP edge: the server clients talk to, in front of the Serve app's ingress.

Ray Serve's own HTTP proxy (uvicorn) reads a request's whole body into its memory as fast as
the client sends it, whatever the app then answers; it keeps a connection that sends nothing,
or half a head, open for ever; and no clock runs while a request waits for a replica (issue
39: 20 bodies of 10 MB took the proxy from 282 to 570 MB, idle connections stayed for minutes,
and 200 clients waited 27 s each with no 503). None of that is configurable there, so the
linker answers HTTP here, an HTTP/1.1 server (h11 over asyncio streams) that decides before
it reads:

* **Connections.** At most ``max_connections`` open (more get 503 and are closed); a connection
  that starts no request within ``idle_timeout_s`` is closed, and one whose head is not complete
  within ``header_timeout_s`` of its first byte gets 408; a head over ``max_header_bytes`` gets 431.
* **The head.** Not POST: 405; a path other than ``route``: 404; a Content-Type other than JSON
  (UTF-8): 415; a Content-Length over ``max_request_bytes``: 413, all before any of the body is read.
* **The body** is read as the client sends it (asyncio pauses the socket at 64 KiB buffered) and
  cut at ``max_request_bytes`` plus one chunk (413), within ``body_timeout_s`` (408); the bodies
  being read together may hold at most ``max_buffered_bytes`` (more: 503). So the edge holds at most
  ``max_buffered_bytes`` + ``max_connections`` x 128 KiB of requests, however many bytes clients send.
* **The deadline** starts when the head arrives: ``request_timeout_s`` for the whole request, or
  less if the client asks for less (``X-Request-Timeout-Seconds``).
  :class:`Admission` lets ``slots`` requests at a time on to the ingress; the others wait, and are
  shed with 503 when ``max_queued`` already wait or when the time they have left falls below what
  recent requests took to be served: a client knows within its deadline (a deadline shorter than that
  with none waiting is the client's, not a load: 504 at once). The ingress gets the
  deadline as a wall-clock time and answers 504 naming the stage that ran past it.
* **Answers** are the ingress's ``(status, JSON bytes)``; refusals are ``{"error": message}`` and
  their connection is closed (after a short lingering read, so that the client sees the answer
  rather than a reset).

The edge knows nothing of Ray: ``link(body, deadline_at)`` is the call that answers a request
(:class:`dist_nce.link.serve.LinkEdge` runs it in a Serve replica and calls the ingress).

    edge = Edge(limits, link)                    # link: async (bytes, wall-clock deadline) -> (status, bytes)
    server = await edge.start("127.0.0.1", 8000)
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import AsyncIterator, Awaitable, Callable

import h11

from dist_nce.link.request import BadRequest, read_body

LOG = logging.getLogger("ray.serve")
READ_CHUNK = 65536  # bytes read from a socket at a time (also the streams' buffer limit)
LINGER_S = 2.0  # after a refusal, seconds spent reading (and dropping) what the client still sends
GRACE_S = 1.0  # past the deadline, seconds the edge waits for the ingress's own 504 before answering one


@dataclass(frozen=True)
class EdgeLimits:
    """What the edge lets through (ServeConfig's fields of the same names; :meth:`ServeConfig.edge_limits`)."""

    route: str = "/"
    max_request_bytes: int = 1_000_000
    max_header_bytes: int = 16384
    max_buffered_bytes: int = 64_000_000
    max_connections: int = 512
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    request_timeout_s: float = 15.0
    slots: int = 64
    max_queued: int = 256


class Shed(Exception):
    """A request the edge refuses with 503 rather than let it wait past its deadline."""


class ShortDeadline(Exception):
    """A request whose own deadline is shorter than requests take once in, with none waiting: 504, since
    no retry with that deadline is served (the service is not overloaded, the client asked for too little)."""


class Admission:
    """``slots`` requests at a time go on to the ingress; the others wait, first come first served.

    A request is shed (:class:`Shed`) when ``max_queued`` already wait, or when it could not be
    served before its deadline: it waits for a slot only until the time it has left falls below
    ``service_s``, the recent requests' time from slot to answer (an exponential average), and
    is shed on getting a slot too late."""

    def __init__(self, slots: int, max_queued: int, clock: Callable[[], float] = time.monotonic):
        self._slots = asyncio.Semaphore(slots)
        self.max_queued, self.clock = max_queued, clock
        self.waiting = 0
        self.service_s = 0.0

    async def enter(self, end: float) -> float:
        """Take a slot for a request due at ``end`` (``clock`` time); returns when it took it."""
        if self.waiting >= self.max_queued and self._slots.locked():
            raise Shed(f"{self.waiting} requests are already waiting")
        budget = end - self.clock() - self.service_s
        if budget <= 0:
            if self.waiting == 0 and not self._slots.locked():
                raise ShortDeadline(f"the request's deadline leaves {max(0.0, end - self.clock()):.3g} s, and requests "
                                    f"take {self.service_s:.3g} s once in; give it more time "
                                    "(X-Request-Timeout-Seconds)")
            raise Shed(self._late(end))
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), budget)
        except asyncio.TimeoutError:
            raise Shed(self._late(end)) from None
        finally:
            self.waiting -= 1
        now = self.clock()
        if end - now < self.service_s:
            self._slots.release()
            raise Shed(self._late(end))
        return now

    def leave(self, served_s: float | None) -> None:
        """Give the slot back; ``served_s``: how long the request took once in (None: it failed)."""
        self._slots.release()
        if served_s is not None:
            self.service_s = served_s if self.service_s == 0 else 0.8 * self.service_s + 0.2 * served_s

    def _late(self, end: float) -> str:
        return (f"{max(0.0, end - self.clock()):.1f} s of the deadline left, recent requests take "
                f"{self.service_s:.1f} s once in")


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()  # ASCII: any character escaped


def media_type(value: bytes | None) -> tuple[str, str | None]:
    """(media type, charset or None) of a Content-Type header value, lower case."""
    if value is None:
        return "", None
    kind, *params = value.decode("latin-1").split(";")
    charset = None
    for p in params:
        name, _, v = p.partition("=")
        if name.strip().lower() == "charset":
            charset = v.strip().strip('"').lower()
    return kind.strip().lower(), charset


class Edge:
    """The HTTP server; ``link(body, deadline_at)`` answers an accepted request with (status, JSON bytes)."""

    def __init__(self, limits: EdgeLimits, link: Callable[[bytes, float], Awaitable[tuple[int, bytes]]]):
        self.limits, self.link = limits, link
        self.admission = Admission(limits.slots, limits.max_queued)
        self.open: set[asyncio.StreamWriter] = set()
        self.buffered = 0  # bytes of bodies being read or waiting for a slot
        route = "/" + limits.route.strip("/")
        self._paths = {route, route.rstrip("/") + "/"}

    async def start(self, host: str, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._connection, host, port, limit=READ_CHUNK, backlog=1024)

    # ---------------------------------------------------------------- one connection

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        if len(self.open) >= self.limits.max_connections:
            # No lingering: the client has sent nothing yet, and a flood must not hold sockets here.
            await self._refuse(conn, reader, writer, 503, f"{len(self.open)} connections are open; retry later",
                               linger=False)
            writer.close()
            return
        self.open.add(writer)
        try:
            while await self._exchange(conn, reader, writer):
                conn.start_next_cycle()
        except (ConnectionError, asyncio.TimeoutError, h11.LocalProtocolError):
            pass  # the client left, or stopped reading its answer
        except Exception:  # noqa: BLE001 - a failure of ours on one connection: logged, the server goes on
            LOG.exception("edge: connection failed")
        finally:
            self.open.discard(writer)
            writer.close()

    async def _exchange(self, conn: h11.Connection, reader, writer) -> bool:
        """Serve one request on ``conn``; True if the connection may carry another."""
        try:
            request = await self._head(conn, reader)
        except BadRequest as e:
            await self._refuse(conn, reader, writer, e.status, e.message)
            return False
        if request is None:
            return False  # closed, or idle too long: nothing to answer
        arrived = time.monotonic()
        end = arrived + self.limits.request_timeout_s
        charged = [0]  # bytes of this body counted in self.buffered

        def release() -> None:
            self.buffered -= charged[0]
            charged[0] = 0

        try:
            try:
                declared, timeout_s = self._check_head(request)
                end = arrived + timeout_s
                if conn.they_are_waiting_for_100_continue:
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                body = await read_body(self._body(conn, reader, charged), declared, self.limits.max_request_bytes,
                                       min(self.limits.body_timeout_s, timeout_s))
            except BadRequest as e:
                release()  # what was read is dropped before the refusal's lingering
                await self._refuse(conn, reader, writer, e.status, e.message)
                return False
            status, answer = await self._answer(body, end)
            del body
        finally:
            release()
        await self._send(conn, writer, status, answer, retry=status == 503)
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    async def _head(self, conn: h11.Connection, reader) -> h11.Request | None:
        """The next request's head: None if the client closed or sent nothing within ``idle_timeout_s``;
        BadRequest 408 for a head not complete within ``header_timeout_s``, 400/431 for a bad one."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.limits.idle_timeout_s
        started = False
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                raise BadRequest(e.error_status_hint, f"bad request head: {e}") from None
            if isinstance(event, h11.Request):
                return event
            if isinstance(event, h11.ConnectionClosed):
                return None
            try:
                data = await asyncio.wait_for(reader.read(READ_CHUNK), max(0.0, end - loop.time()))
            except asyncio.TimeoutError:
                if not started:
                    return None
                raise BadRequest(408, f"request head not received within {self.limits.header_timeout_s:g} s") \
                    from None
            if data and not started:
                started, end = True, loop.time() + self.limits.header_timeout_s
            conn.receive_data(data)

    def _check_head(self, request: h11.Request) -> tuple[str | None, float]:
        """405, 404 or 415 for a request the linker does not answer; else its Content-Length (413 over the
        limit) and its deadline in seconds: ``request_timeout_s``, or less if the client asks for less
        (header ``X-Request-Timeout-Seconds``)."""
        size = len(request.target) + sum(len(k) + len(v) + 4 for k, v in request.headers)
        if size > self.limits.max_header_bytes:  # h11 bounds a head arriving in pieces; this, one read at once
            raise BadRequest(431, f"request head of {size} bytes; the limit is {self.limits.max_header_bytes}")
        if request.method != b"POST":
            raise BadRequest(405, "POST a JSON body")
        path = request.target.split(b"?", 1)[0].decode("latin-1")
        if path not in self._paths:
            raise BadRequest(404, f"no such path {path[:60]!r}; POST to {min(self._paths)}")
        headers = dict(request.headers)  # h11 lower-cases names
        kind, charset = media_type(headers.get(b"content-type"))
        if kind != "application/json" or charset not in (None, "utf-8"):
            raise BadRequest(415, f"Content-Type must be application/json (UTF-8), got "
                                  f"{headers.get(b'content-type', b'none')[:60].decode('latin-1')!r}")
        declared = headers.get(b"content-length")
        if declared is not None:
            declared = declared.decode("latin-1")
            if int(declared) > self.limits.max_request_bytes:  # h11 checked it is a number
                raise BadRequest(413, f"body of {int(declared)} bytes; the limit is {self.limits.max_request_bytes}")
        timeout_s = self.limits.request_timeout_s
        asked = headers.get(b"x-request-timeout-seconds")
        if asked is not None:
            try:
                wanted = float(asked)
            except ValueError:
                raise BadRequest(400, f"X-Request-Timeout-Seconds {asked[:40].decode('latin-1')!r} is not a number") \
                    from None
            if not wanted > 0:  # NaN too (checked before min(), which answers its first argument for a NaN)
                raise BadRequest(400, "X-Request-Timeout-Seconds must be positive")
            timeout_s = min(timeout_s, wanted)
        return declared, timeout_s

    async def _body(self, conn: h11.Connection, reader, charged: list[int]) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, each charged to ``buffered`` (503 past ``max_buffered_bytes``)."""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                raise BadRequest(e.error_status_hint, f"bad request body: {e}") from None
            if isinstance(event, h11.Data):
                if self.buffered + len(event.data) > self.limits.max_buffered_bytes:
                    raise BadRequest(503, "the server is reading too many bodies at once; retry later")
                self.buffered += len(event.data)
                charged[0] += len(event.data)
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("client closed during the body")
            else:  # NEED_DATA
                data = await reader.read(READ_CHUNK)
                conn.receive_data(data)

    async def _answer(self, body: bytes, end: float) -> tuple[int, bytes]:
        """(status, JSON) of an accepted request due at ``end`` (monotonic)."""
        try:
            entered = await self.admission.enter(end)
        except Shed as e:
            return 503, _error(f"the service is overloaded ({e}); retry later")
        except ShortDeadline as e:
            return 504, _error(str(e))
        served = None
        try:
            deadline_at = time.time() + (end - time.monotonic())  # the wall clock the ingress shares
            status, answer = await asyncio.wait_for(self.link(body, deadline_at),
                                                    max(0.0, end - time.monotonic()) + GRACE_S)
            if status in (200, 504):  # a 504's time is a lower bound of what it needed
                served = time.monotonic() - entered
            return status, answer
        except asyncio.TimeoutError:
            served = time.monotonic() - entered
            return 504, _error("request timed out: no answer from the linker by its deadline")
        except Exception:  # noqa: BLE001 - the call failed: logged here, never shown to the client
            incident = uuid.uuid4().hex
            LOG.exception("edge: request failed (id %s)", incident)
            return 500, _error(f"internal error (id {incident}); see the edge's log")
        finally:
            self.admission.leave(served)

    # ---------------------------------------------------------------- answering

    async def _send(self, conn: h11.Connection, writer, status: int, body: bytes, retry: bool = False) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if retry:
            headers.append((b"retry-after", b"1"))
        writer.write(conn.send(h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)))
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        # A client that does not read its answer holds a connection, not the server.
        await asyncio.wait_for(writer.drain(), self.limits.idle_timeout_s)

    async def _refuse(self, conn: h11.Connection, reader, writer, status: int, message: str,
                      linger: bool = True) -> None:
        """Answer ``{"error": message}`` and close; read (and drop) what the client still sends for
        up to LINGER_S first, so that closing with its bytes unread does not reset the connection
        before it reads the answer. Written by hand, not through ``conn``: h11 has no answer to
        send before a whole head, and the connection ends here anyway."""
        body = _error(message)
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n" + ("retry-after: 1\r\n" if status == 503 else "")
                + "\r\n")
        loop = asyncio.get_running_loop()
        try:
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), self.limits.idle_timeout_s)
            if not linger:
                return
            if writer.can_write_eof():
                writer.write_eof()
            end = loop.time() + LINGER_S
            while await asyncio.wait_for(reader.read(READ_CHUNK), max(0.0, end - loop.time())):
                pass
        except (ConnectionError, asyncio.TimeoutError, OSError):
            pass

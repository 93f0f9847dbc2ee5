"""A small fault-injecting HTTP/1.1 proxy on loopback, for putting in front of SeaweedFS (or any server).

Clients talk to `proxy.endpoint` as if it were the server; requests are relayed unchanged (the
Host header too, so signatures stay valid) over one upstream connection per client connection.
Faults are rules a test adds while the proxy runs; each matches by method and a regular expression
searched in the request target (path and query), skips the first `skip` matching requests, then
hits `times` of them (None: all):

- `status`: answer with an S3-style XML error (default 503 SlowDown) without forwarding;
- `reset`: abort the client connection with a TCP RST, while the request body arrives
  (`where="request"`, after fraction `at` of it) or while the response body goes out
  (`where="response"`, after fraction `at` of it);
- `truncate`: send the response headers and fraction `at` of its body, then close cleanly;
- `stall`: hold the request (`where="request"`) or the rest of the response (`where="response"`,
  after fraction `at`) for `delay` seconds;
- `corrupt`: flip one byte of the request body (an upload) or of the response body (a download)
  at fraction `at`.

A test may also play the server's part: `on_request(method, target, headers, body) -> (headers, body)`
sees each whole request body (only requests no fault matched) and may change it and its headers
before it is relayed, and `on_response(method, target, status_line, headers) -> headers` may change
the response's headers (a store that lies: tests/test_hostile_round4_store.py).

Every request seen and every fault injected is recorded (`requests`, `injected`, `Fault.hits`,
`Fault.engaged`) so tests can assert that faults really happened. `Expect: 100-continue` is
answered by the proxy itself and not forwarded.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("status", "reset", "truncate", "stall", "corrupt")
CHUNK = 1 << 20


@dataclass
class Fault:
    kind: str
    method: str | None = None
    match: str | None = None
    times: int | None = 1
    skip: int = 0
    where: str = "response"
    at: float = 0.5
    status: int = 503
    code: str = "SlowDown"
    delay: float = 30.0
    hits: int = 0
    seen: int = 0
    engaged: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.where not in ("request", "response"):
            raise ValueError("where is 'request' or 'response'")

    def matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.match is None or re.search(self.match, target) is not None)

    @property
    def active(self) -> bool:
        return self.times is None or self.hits < self.times


class _Closed(Exception):
    pass


class _Conn:
    """A socket with a read buffer: header lines, exact counts, and raw relays."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(CHUNK)
        if not data:
            raise _Closed
        self.buf += data

    def read_head(self) -> bytes:
        while (i := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > 1 << 20:
                raise _Closed
            self._fill()
        head = bytes(self.buf[: i + 4])
        del self.buf[: i + 4]
        return head

    def read_some(self, limit: int) -> bytes:
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out

    def read_line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[: i + 2])
        del self.buf[: i + 2]
        return line

    def read_to_eof(self):  # noqa: ANN201 - generator of bytes
        if self.buf:
            yield bytes(self.buf)
            self.buf.clear()
        while data := self.sock.recv(CHUNK):
            yield data


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers.append((k.strip(), v.strip()))
    return lines[0], headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _build_head(first: str, headers: list[tuple[str, str]]) -> bytes:
    return (first + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    def __init__(self, upstream: str):
        hostport = upstream.split("://", 1)[-1].rstrip("/")
        host, _, port = hostport.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.injected: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.endpoint = ""
        self.on_request: Callable[[str, str, list[tuple[str, str]], bytes],
                                  tuple[list[tuple[str, str]], bytes]] | None = None
        self.on_response: Callable[[str, str, str, list[tuple[str, str]]], list[tuple[str, str]]] | None = None

    # -- control -------------------------------------------------------------------------------------
    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def start(self) -> FaultProxy:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        self._listener = s
        self.endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- relay ---------------------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(client)
            threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn", daemon=True).start()

    def _pick(self, method: str, target: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, target))
            for f in self.faults:
                if f.active and f.matches(method, target):
                    f.seen += 1
                    if f.seen <= f.skip:
                        continue
                    f.hits += 1
                    self.injected.append((f.kind, method, target))
                    f.engaged.set()
                    return f
        return None

    def _serve(self, client_sock: socket.socket) -> None:
        client = _Conn(client_sock)
        upstream: _Conn | None = None
        try:
            while not self._stop.is_set():
                first, headers = _parse_head(client.read_head())
                method, target = first.split(" ")[0], first.split(" ")[1]
                length = int(_header(headers, "content-length") or 0)
                if (_header(headers, "expect") or "").lower() == "100-continue":
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                    client_sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                fault = self._pick(method, target)
                kind = fault.kind if fault else None

                if kind == "status" or (kind == "reset" and fault.where == "request"):
                    cut = int(length * fault.at) if kind == "reset" else length
                    self._drain(client, cut)
                    if kind == "reset":
                        _reset(client_sock)
                        return
                    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
                            f"<Message>injected by faultproxy</Message></Error>").encode()
                    client_sock.sendall(_build_head(f"HTTP/1.1 {fault.status} Injected", [
                        ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]) + body)
                    continue
                if kind == "stall" and fault.where == "request":
                    self._stop.wait(fault.delay)

                if upstream is None:
                    up = socket.create_connection(self.upstream)
                    with self._lock:
                        self._socks.add(up)
                    upstream = _Conn(up)
                if self.on_request is not None and fault is None:
                    body = self._read_all(client, length)
                    headers, body = self.on_request(method, target, headers, body)
                    upstream.sock.sendall(_build_head(first, headers) + body)
                else:
                    upstream.sock.sendall(_build_head(first, headers))
                    self._relay_body(client, upstream.sock, length,
                                     corrupt_at=int(length * fault.at)
                                     if kind == "corrupt" and fault.where == "request" else None)

                status_line, rheaders = _parse_head(upstream.read_head())
                status = int(status_line.split(" ")[1])
                if self.on_response is not None:
                    rheaders = self.on_response(method, target, status_line, rheaders)
                client_sock.sendall(_build_head(status_line, rheaders))
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                rlength = _header(rheaders, "content-length")
                chunked = (_header(rheaders, "transfer-encoding") or "").lower() == "chunked"
                if no_body:
                    total = 0
                elif rlength is not None:
                    total = int(rlength)
                else:
                    total = -1  # chunked or until EOF
                cut = None
                if kind in ("truncate", "reset", "stall") and fault.where == "response" and total > 0:
                    cut = int(total * fault.at)
                if kind == "corrupt" and fault.where == "response" and total > 0:
                    self._relay_body(upstream, client_sock, total, corrupt_at=int(total * fault.at))
                elif cut is not None:
                    self._relay_body(upstream, client_sock, cut)
                    if kind == "stall":
                        self._stop.wait(fault.delay)
                        self._relay_body(upstream, client_sock, total - cut)
                    elif kind == "truncate":
                        client_sock.shutdown(socket.SHUT_RDWR)
                        client_sock.close()
                        return
                    else:
                        _reset(client_sock)
                        return
                elif total > 0:
                    self._relay_body(upstream, client_sock, total)
                elif total < 0 and chunked:
                    self._relay_chunked(upstream, client_sock)
                elif total < 0:
                    for data in upstream.read_to_eof():
                        client_sock.sendall(data)
                    return
                if (_header(rheaders, "connection") or "").lower() == "close":
                    upstream.sock.close()
                    upstream = None
        except (_Closed, OSError, ValueError, IndexError):
            pass
        finally:
            for s in (client_sock, upstream.sock if upstream else None):
                if s is not None:
                    with self._lock:
                        self._socks.discard(s)
                    try:
                        s.close()
                    except OSError:
                        pass

    @staticmethod
    def _read_all(conn: _Conn, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            out += conn.read_some(min(n - len(out), CHUNK))
        return bytes(out)

    @staticmethod
    def _drain(conn: _Conn, n: int) -> None:
        while n > 0:
            n -= len(conn.read_some(min(n, CHUNK)))

    @staticmethod
    def _relay_body(src: _Conn, dst: socket.socket, n: int, *, corrupt_at: int | None = None) -> None:
        pos = 0
        while pos < n:
            data = src.read_some(min(n - pos, CHUNK))
            if corrupt_at is not None and pos <= corrupt_at < pos + len(data):
                b = bytearray(data)
                b[corrupt_at - pos] ^= 0xFF
                data = bytes(b)
            dst.sendall(data)
            pos += len(data)

    @staticmethod
    def _relay_chunked(src: _Conn, dst: socket.socket) -> None:
        while True:
            line = src.read_line()
            dst.sendall(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := src.read_line()) != b"\r\n":
                    dst.sendall(trailer)
                dst.sendall(b"\r\n")
                return
            FaultProxy._relay_body(src, dst, size + 2)

"""A browser's network side for the class benchmark's client (``client.Student``): what one browser
profile does with the page's files, so that a class of clients loads the server as a class of
browsers would, and a session's first page is not the client's own queue.

- **Six connections per host.** Chromium keeps at most six HTTP/1.1 connections open to one host and
  sends one request at a time on each; a page's files go out over all six, each kept alive for the
  next file. ``Pool`` does the same: up to ``CONNECTIONS_PER_HOST`` threads, each with its own kept-
  alive connection, take the next file from one queue.
- **Its HTTP cache.** A response is stored with its validators (``ETag``, ``Last-Modified``) and its
  ``Cache-Control``; while it is fresh (``max-age`` not run out, and no ``no-cache``) it is used
  without a request, as a browser does on a normal navigation; once stale, or marked ``no-cache``
  (Streamlit's ``index.html`` and health check), it is revalidated with a conditional GET and a 304
  keeps the stored body. ``no-store`` is never stored. Streamlit serves its hashed bundles
  ``public, immutable, max-age=31536000``, so a second page load in the same profile asks only for
  the page itself. A heuristic freshness (a response with ``Last-Modified`` and no ``max-age``, which
  Chromium may reuse for a while) is not applied: such a response is revalidated, which can only cost
  the client a request, never save one the browser would make.
- **Compression.** Every request says ``Accept-Encoding: gzip, deflate`` and a compressed answer is
  decoded; what Streamlit compresses is its choice (this Streamlit serves ``/static/`` and the page
  uncompressed, and gzips its other answers over 1000 bytes).
- **The page's files in the browser's order.** First the page; then the files it names (its
  stylesheet, scripts, module preloads, preloaded font and icon); then, once its script would run,
  the health check and the host config (and the websocket, ``client.Student.connect``); and as the
  server's elements arrive, each new kind's lazily loaded chunk and the chunks that chunk imports
  (the main script's own table of them, ``__vite__mapDeps``), as React asks for them when it first
  draws that kind. Fonts the stylesheet names are fetched by a browser only when text in them is
  drawn; the client, drawing nothing, fetches only the one the page preloads.
"""

from __future__ import annotations

import gzip
import http.client
import posixpath
import queue
import re
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field

#: Chromium's limit of HTTP/1.1 connections to one host (net::ClientSocketPoolManager, normal sockets)
CONNECTIONS_PER_HOST = 6
ACCEPT_ENCODING = "gzip, deflate"
TIMEOUT_S = 60


@dataclass
class Stored:
    """One cached response: its body (decoded), its validators, and until when it is fresh."""

    body: bytes
    etag: str | None
    last_modified: str | None
    fresh_until: float  # time.monotonic(); 0 when it must be revalidated before every use


@dataclass
class Tally:
    """What a profile's fetches cost: requests sent, bytes on the wire, bodies decoded, cache answers."""

    requests: int = 0
    wire_bytes: int = 0
    decoded_bytes: int = 0
    from_cache: int = 0  # used fresh, no request
    revalidated: int = 0  # a conditional GET answered 304
    compressed: int = 0  # answers sent with a Content-Encoding
    connections: int = 0  # connections opened (the server closes one idle past its keep-alive: a new one then)
    open_now: int = 0
    most_open: int = 0  # connections open at once, at most
    paths: list[str] = field(default_factory=list)  # every path asked for, in order


def freshness(cache_control: str, now: float) -> tuple[bool, float]:
    """(storable, fresh_until) from a ``Cache-Control`` header."""
    directives = {d.strip().split("=", 1)[0].lower(): d.strip().split("=", 1)[-1] for d in cache_control.split(",") if d.strip()}
    if "no-store" in directives:
        return False, 0.0
    if "no-cache" in directives or "max-age" not in directives:
        return True, 0.0
    try:
        return True, now + max(0, int(directives["max-age"]))
    except ValueError:
        return True, 0.0


def decode(body: bytes, encoding: str | None) -> bytes:
    """A body as the server meant it (``Content-Encoding`` gzip or deflate undone)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:  # some servers send deflate without its zlib wrapper
            return zlib.decompress(body, -zlib.MAX_WBITS)
    if encoding == "identity":
        return body
    raise RuntimeError(f"the server answered with Content-Encoding {encoding!r}, which was not asked for")


class Pool:
    """One browser profile's network side for one host: a queue of requests served by up to
    ``connections`` threads, each holding one kept-alive connection (opened at its first request),
    and the profile's HTTP cache."""

    def __init__(self, host: str, port: int, connections: int = CONNECTIONS_PER_HOST):
        self.host, self.port, self.connections = host, port, connections
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.workers: list[threading.Thread] = []
        self.cache: dict[str, Stored] = {}
        self.tally = Tally()
        self.cookies: dict[str, str] = {}
        self.process = ""  # behind kvsim serve: the Streamlit process that answered last (its X-Kvsim-Process)
        self.lock = threading.Lock()

    def submit(self, path: str) -> Future:
        """Queue a GET; its future holds the body (an answer other than 200 or 304 raises, naming the path)."""
        with self.lock:
            if not self.workers:  # the connections' threads, started with the profile's first request
                self.workers = [threading.Thread(target=self._work, daemon=True) for _ in range(self.connections)]
                for t in self.workers:
                    t.start()
        done: Future = Future()
        self.todo.put((path, done))
        return done

    def get_all(self, paths: list[str]) -> dict[str, bytes]:
        """GET every path once, in order, over the profile's connections; the bodies by path."""
        pending = {path: self.submit(path) for path in dict.fromkeys(paths)}
        return {path: done.result(timeout=2 * TIMEOUT_S) for path, done in pending.items()}

    def close(self) -> None:
        """End the connections (their threads finish what is queued first); the cache is kept, and a
        later request opens new ones, as a browser reopens a host's sockets."""
        with self.lock:
            workers, self.workers = self.workers, []
        for _ in workers:
            self.todo.put(None)

    def _work(self) -> None:
        conn: list[http.client.HTTPConnection] = []  # this thread's connection, once opened
        try:
            while (item := self.todo.get()) is not None:
                path, done = item
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    done.set_result(self._get(path, conn))
                except BaseException as e:  # the caller's future carries it
                    done.set_exception(e)
        finally:
            if conn:
                self._drop(conn)

    def _get(self, path: str, conn: list) -> bytes:
        """One GET as the browser would make it: from the cache when fresh, conditional when stale."""
        with self.lock:
            stored = self.cache.get(path)
            self.tally.paths.append(path)
        if stored is not None and time.monotonic() < stored.fresh_until:
            with self.lock:
                self.tally.from_cache += 1
            return stored.body
        headers = {"Accept-Encoding": ACCEPT_ENCODING}
        if stored is not None and stored.etag:
            headers["If-None-Match"] = stored.etag
        if stored is not None and stored.last_modified:
            headers["If-Modified-Since"] = stored.last_modified
        with self.lock:
            if self.cookies:
                headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        status, head, wire = self._request(path, headers, conn)
        storable, fresh_until = freshness(head.get("cache-control", ""), time.monotonic())
        with self.lock:
            self.tally.requests += 1
            self.tally.wire_bytes += len(wire)
            # every cookie set (Streamlit's XSRF cookie; behind kvsim serve, the proxy's kvsim_process), as a
            # browser keeps them and sends them back on every later request, the websocket's included
            for name, value in re.findall(r"(?:^|,\s*)([A-Za-z0-9_-]+)=([^;,]*)", head.get("set-cookie", "")):
                self.cookies[name] = value
            if "x-kvsim-process" in head:  # behind kvsim serve: the process that answered
                self.process = head["x-kvsim-process"]
        if status == 304 and stored is not None:
            stored.fresh_until = fresh_until
            with self.lock:
                self.tally.revalidated += 1
            return stored.body
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}")
        body = decode(wire, head.get("content-encoding"))
        with self.lock:
            self.tally.decoded_bytes += len(body)
            self.tally.compressed += "content-encoding" in head
            if storable:
                self.cache[path] = Stored(body, head.get("etag"), head.get("last-modified"), fresh_until)
        return body

    def _request(self, path: str, headers: dict, conn: list) -> tuple[int, dict[str, str], bytes]:
        """Send on this thread's kept-alive connection (opened if none); one the server closed while
        idle is replaced once, as a browser retries an idempotent request on a reused socket."""
        for attempt in range(2):
            reused = bool(conn)
            if not conn:
                conn.append(http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S))
                with self.lock:
                    self.tally.connections += 1
                    self.tally.open_now += 1
                    self.tally.most_open = max(self.tally.most_open, self.tally.open_now)
            try:
                conn[0].request("GET", path, headers=headers)
                r = conn[0].getresponse()
                wire = r.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop(conn)
                if not reused or attempt:
                    raise
                continue
            if r.will_close:
                self._drop(conn)
            head: dict[str, str] = {}
            for k, v in r.getheaders():  # a header sent twice (Set-Cookie) kept whole, as one list
                head[k.lower()] = f"{head[k.lower()]}, {v}" if k.lower() in head else v
            return r.status, head, wire
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _drop(self, conn: list) -> None:
        conn.pop().close()
        with self.lock:
            self.tally.open_now -= 1


# --- what the page names, and what its script loads later ------------------------------------------

_NAMED = re.compile(r'<(?:script|link)\b[^>]*?\s(?:src|href)="\./([^"]+\.(?:js|css|woff2|png))"')
_MAIN = re.compile(r'<script\b[^>]*type="module"[^>]*\ssrc="\./([^"]+\.js)"')
_DEPS_TABLE = re.compile(r"m\.f=\[([^\]]*)\]")
_LAZY = re.compile(r"import\(`\./([^`]+\.js)`\)(?:\.then\([^)]*\))?,__vite__mapDeps\(\[([\d,]*)\]\)")


def named_files(index_html: str) -> list[str]:
    """The files the page itself names (scripts, module preloads, stylesheet, preloaded font, icon),
    in document order, as paths from the server's root."""
    return ["/" + name for name in dict.fromkeys(_NAMED.findall(index_html))]


def main_script(index_html: str) -> str | None:
    match = _MAIN.search(index_html)
    return "/" + match.group(1) if match else None


def lazy_chunks(main_js: str, folder: str) -> dict[str, list[str]]:
    """Each lazily loaded element chunk's name (``PlotlyChart``) -> the files the page loads for it
    (the chunk and every chunk it imports), from the main script's own preload table; empty when
    the script has none (a Streamlit built otherwise: then no chunk is fetched for an element)."""
    table = _DEPS_TABLE.search(main_js)
    if table is None:
        return {}
    # entries are relative to the script's folder: "./X.js", and "../css/X.css" for a chunk's stylesheet
    files = [posixpath.normpath(posixpath.join(folder, f)) for f in re.findall(r'"([^"]+)"', table.group(1))]
    chunks: dict[str, list[str]] = {}
    for chunk, ids in _LAZY.findall(main_js):
        deps = [files[int(i)] for i in ids.split(",") if i and int(i) < len(files)]
        chunks.setdefault(chunk.split(".", 1)[0], list(dict.fromkeys([f"{folder}/{chunk}", *deps])))
    return chunks


def chunk_name(element_kind: str) -> str:
    """The chunk the page loads to draw an element of this kind: ``plotly_chart`` -> ``PlotlyChart``."""
    return "".join(part.capitalize() for part in element_kind.split("_"))

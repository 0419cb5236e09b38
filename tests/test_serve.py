"""``kvsim serve``: K Streamlit processes behind nginx (deploy/nginx.conf.template, kvsim/serve.py).

Through the proxy: the page and a file of the frontend come from nginx (its headers, Streamlit's cache
headers, gzip), a browser's cookie keeps its requests and its websocket on one process, another cookie
reaches the other. Each bad input is one line on stderr: a port in use starts nothing; nginx missing,
or failing its config test, serves one plain Streamlit process; more processes than cores is capped.
Skipped where nginx is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import gzip
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvsim import serve

ROOT = Path(__file__).resolve().parents[1]
needs_nginx = pytest.mark.skipif(serve.find_nginx() is None, reason="nginx is not installed (apt-get install nginx)")
START_S = 90


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, int]:
    """``kvsim serve`` on a free loopback port with ``args``; returns once it says it is serving."""
    port = serve.free_port()
    err = tmp_path / f"serve-{port}.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvsim", "serve", "--port", str(port), "--address", "127.0.0.1", *args],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=f, text=True)
    deadline = time.monotonic() + START_S
    while "Ctrl-C stops" not in err.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"kvsim serve did not start: {err.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, err, port


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, as a service manager stops it; what it printed on stdout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


def get(port: int, path: str, cookie: str = "", gzip_ok: bool = False):
    headers = {**({"Cookie": cookie} if cookie else {}), **({"Accept-Encoding": "gzip"} if gzip_ok else {})}
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers), timeout=30) as r:
        return r.headers, r.read()


def pin(headers) -> str:
    """The proxy's cookie from a response's Set-Cookie headers, as ``name=value``."""
    (value,) = [c.split(";")[0] for c in headers.get_all("Set-Cookie") or [] if c.startswith("kvsim_process=")]
    return value


@needs_nginx
def test_serve_behind_nginx_serves_the_frontend_itself_and_pins_a_browser_to_one_process(tmp_path):
    import websockets.sync.client

    proc, err, port = start(tmp_path, "--processes", "2")
    try:
        page_head, page = get(port, "/")
        assert page_head["Server"] == "nginx" and page_head["X-Kvsim-Served-By"] == "nginx"
        assert page_head["Cache-Control"] == "no-cache" and "X-Kvsim-Process" not in page_head
        cookie = pin(page_head)

        # a hashed bundle the page names: nginx's, gzipped, cached as Streamlit caches it, the same bytes
        script = re.search(r'src="\./(static/js/[^"]+\.js)"', page.decode()).group(1)
        head, body = get(port, "/" + script, cookie, gzip_ok=True)
        assert head["X-Kvsim-Served-By"] == "nginx" and head["Content-Encoding"] == "gzip"
        assert head["Cache-Control"] == "public, immutable, max-age=31536000"
        assert gzip.decompress(body) == (serve.streamlit_static_dir() / script).read_bytes()
        assert head.get_all("Set-Cookie") is None  # the browser has its cookie: none is set again

        # the page's cookie keeps every request on one process; the health check is Streamlit's
        seen = set()
        for path in ("/_stcore/health", "/_stcore/host-config", "/_stcore/health", "/_stcore/host-config"):
            head, body = get(port, path, cookie)
            assert "X-Kvsim-Served-By" not in head
            seen.add(head["X-Kvsim-Process"])
        (mine,) = seen
        # the websocket, opened with the page's cookie, lands on that process
        with websockets.sync.client.connect(f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=["streamlit"],
                                            additional_headers={"Cookie": cookie}, open_timeout=30) as ws:
            assert ws.response.headers["X-Kvsim-Process"] == mine
        # other browsers' cookies reach the other process too
        others = {get(port, "/_stcore/health", f"kvsim_process={uuid.uuid4().hex}")[0]["X-Kvsim-Process"] for _ in range(24)}
        assert len(others) == 2 and mine in others
        # a first request that goes to a process (no cookie yet) is pinned to the process that answered it
        head, _ = get(port, "/_stcore/health")
        first = head["X-Kvsim-Process"]
        assert {get(port, "/_stcore/health", pin(head))[0]["X-Kvsim-Process"] for _ in range(4)} == {first}
    finally:
        out = stop(proc)
    assert proc.returncode == 0, err.read_text()
    assert re.fullmatch(r"served http://127\.0\.0\.1:\d+ \(nginx in front of 2 Streamlit processes\) for \d+ s; "
                        r"stopped by SIGTERM\n", out)
    assert err.read_text().count("\n") == 1 and "nginx in front of 2 Streamlit processes" in err.read_text()


def test_a_port_in_use_is_one_line_and_starts_nothing(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvsim", "serve", "--port", str(port), "--address", "127.0.0.1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"kvsim: error: --port {port}: 127.0.0.1:{port} is in use (another kvsim serve or app?); "
                           "stop it or choose another --port\n")


def _one_plain_process(tmp_path, *args: str) -> list[str]:
    """``kvsim serve ARGS`` whose proxy cannot run: the lines it said, once its one plain Streamlit
    process answered (uvicorn's, no nginx header) on the port asked for."""
    proc, err, port = start(tmp_path, *args)
    try:
        head, body = get(port, "/_stcore/health")
        assert body == b"ok" and head["Server"] == "uvicorn" and "X-Kvsim-Process" not in head
    finally:
        out = stop(proc)
    assert proc.returncode == 0 and "(one Streamlit process)" in out
    lines = err.read_text().splitlines()
    assert lines[-1].startswith(f"kvsim serve: http://127.0.0.1:{port}: one Streamlit process, started in ")
    return lines[:-1]


def test_without_nginx_one_line_then_one_plain_process_and_more_processes_than_cores_capped(tmp_path):
    cores = serve.cores()
    lines = _one_plain_process(tmp_path, "--processes", str(cores + 1), "--nginx", str(tmp_path / "no-nginx"))
    assert len(lines) == 2
    assert lines[0] == (f"kvsim serve: --processes {cores + 1} is more than this machine's {cores} cores (a Streamlit "
                        f"process uses about one); starting {cores}")
    assert lines[1].startswith(f"kvsim serve: --nginx {tmp_path / 'no-nginx'}: no such program; serving one Streamlit "
                               "process without a proxy on http://127.0.0.1:")


@needs_nginx
def test_a_config_that_fails_nginx_t_is_one_line_then_one_plain_process(tmp_path):
    template = tmp_path / "broken.conf.template"
    template.write_text(serve.TEMPLATE.read_text().replace("sendfile on;", "sendfile maybe;"))
    (line,) = _one_plain_process(tmp_path, "--processes", "1", "--template", str(template))
    assert line.startswith(f"kvsim serve: nginx -t failed on {template}: [emerg] invalid value \"maybe\" in \"sendfile\" "
                           f"directive, it must be \"on\" or \"off\" in {template} as filled in:")
    assert "; serving one Streamlit process without a proxy on http://127.0.0.1:" in line

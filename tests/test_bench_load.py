"""The class benchmark (``kvsim bench --load``): its verdicts and table without a server, its client
against a real server (two sessions: one's control change and one's upload stay in that session),
and the sampler that profiles the server. The timing itself is a benchmark, never asserted here."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvsim import cli
from kvsim.bench import checkout_env, client, load, sampler
from kvsim.bench.browser.server import Server, server_env


def figures(seconds, target=3.0, files=None):
    return load.StepFigures("tour 1: attention sinks", target, list(seconds), [], 0.05, files)


def test_a_step_passes_only_when_every_session_is_within_its_target():
    assert figures([0.5, 2.9, 1.0]).doc()["result"] == "PASS"
    slow = figures([0.5, 3.2, 1.0]).doc()
    assert slow["result"] == "FAIL" and slow["median_s"] == 1.0 and slow["worst_s"] == 3.2
    # a session without a time is a miss: the step fails, its median is over those that finished
    missed = load.StepFigures("x", 3.0, [0.5, None, 1.5], ["TimeoutError: never finished"], 0.1).doc()
    assert missed["result"] == "FAIL" and missed["misses"] == 1 and missed["worst_s"] is None and missed["median_s"] == 1.0


def _doc():
    open_step = load.StepFigures("open the default view", 5.0, [4.0, 4.5], [], 0.12, [1.0, 2.0]).doc()
    tour = figures([0.5, 3.5]).doc()
    return {"kind": "load", "machine": "2 cores", "load_before": [1.0, 2.0, 3.0], "load_after": [1.5, 2.0, 3.0],
            "result": "FAIL", "classes": [{"sessions": 2, "steps": [open_step, tour], "warm_s": 9.0, "idle_mb": 380.0,
                                           "peak_rss_mb": 400.0, "vmhwm_mb": 401.0, "isolation": "PASS", "bench_cpu_s": 0.2}]}


def test_the_table_shows_each_step_its_page_files_and_the_server_memory():
    text = cli.render("bench", _doc())
    row = next(x for x in text.splitlines() if x.strip().startswith("open the default view"))
    assert "4.25" in row and "4.50" in row and "5.0" in row and "0.12s" in row and row.rstrip().endswith("PASS")
    assert "of which the page's files" in text and "1.50" in text and "of which its first run" in text
    assert " FAIL" in next(x for x in text.splitlines() if "tour 1" in x)
    assert "peak 400.00 MB resident, VmHWM 401.00 MB" in text and "load average before [1.0, 2.0, 3.0]" in text
    assert "upload offered in that session only: PASS" in text and text.rstrip().endswith("overall: FAIL")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--load", "0"], "positive integer"),
    (["bench", "--load", "8,x"], "expected N[,N...]"),
    (["bench", "--load", "8", "--browser"], "--browser and --load are separate benchmarks; run one at a time"),
    (["bench", "--load", "8", "--rounds", "2"], "--rounds only applies with --browser"),
    (["bench", "--long", "--lengths", "2048"], "--lengths only applies with --generate"),
    (["bench", "--generate", "--full-reference"], "--full-reference applies to the speed benchmark, not to --generate"),
    (["bench", "--profile", "p.txt"], "--profile only applies with --load"),
    (["bench", "--serve", "2"], "--serve only applies with --load"),
    (["bench", "--load", "8", "--serve", "2", "--profile", "p.txt"], "--profile samples one plain Streamlit process"),
])
def test_the_cli_refuses_load_flags_that_do_not_go_together(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error:") and message in err and err.count("\n") == 1


def test_the_lesson_is_well_formed():
    assert isinstance(load.LESSON[0].action, client.Open) and load.LESSON[0].target_s == load.OPEN_TARGET_S
    assert all(s.target_s == load.STEP_TARGET_S and not isinstance(s.action, client.Open) for s in load.LESSON[1:])
    assert len({s.name for s in load.LESSON}) == len(load.LESSON) and all(s.expect for s in load.LESSON)


def test_two_sessions_on_a_real_server_keep_their_settings_and_uploads_to_themselves(tmp_path):
    """The client speaks the real protocol: each session opens the default view, one changes the budget
    and uploads a trace, and the other's page shows neither."""
    server = Server(server_env(None), tmp_path / "server.log")

    async def lesson():
        a, b = client.Student(server.url), client.Student(server.url)
        try:
            for s in (a, b):
                seconds, error = await s.timed(load.LESSON[0].action, load.LESSON[0].expect)
                assert seconds is not None, error
            assert "budget=256" in a.query and a.files_bytes > 1_000_000  # the page's scripts came too
            # as Chromium: the widgets' and Plotly's chunks asked for when drawn, over at most six connections
            drawn = {p.rsplit("/", 1)[-1].split(".", 1)[0] for p in a.http.tally.paths}
            assert {"PlotlyChart", "NumberInput", "Selectbox"} <= drawn and a.http.tally.most_open <= 6
            seconds, error = await a.timed(client.Number("budget", 128), "budget=128")
            assert seconds is not None, error
            assert await load.isolation([a, b]) == ""
            assert "budget=256" in b.query and f"uploaded: {client.UPLOAD_NAME}" not in b.texts
        finally:
            await asyncio.gather(a.close(), b.close(), return_exceptions=True)

    try:
        asyncio.run(lesson())
    finally:
        server.stop()


def test_the_sampler_charges_a_busy_thread_cpu_to_its_stack(tmp_path):
    out = tmp_path / "stacks.txt"
    s = sampler.Sampler(str(out))
    s.start()
    s.on.set()

    def spin_for_the_test():
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass

    busy = threading.Thread(target=spin_for_the_test)
    busy.start()
    idle = threading.Thread(target=time.sleep, args=(0.5,))  # waits: charged nothing
    idle.start()
    busy.join()
    idle.join()
    s.write()
    text = sampler.summary(str(out))
    share = next(float(line.split("%")[0]) for line in text.splitlines() if "spin_for_the_test" in line)
    assert share > 50 and "sleep" not in text


def test_the_app_server_does_not_collect_all_its_garbage_after_every_run():
    """Streamlit's default gc.collect(2) after each script run was a third of the server's CPU under a
    class of thirty (docs/classroom.md): the app's server settings turn it off."""
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).resolve().parents[1] / ".streamlit" / "config.toml").read_text())
    assert config["runner"]["postScriptGC"] is False


# --- the client fetches as a browser does: six connections, its HTTP cache, gzip -------------------


class _Site:
    """A page naming twelve scripts, served on 127.0.0.1 as Streamlit serves its own: the page
    ``no-cache`` with an ETag (304 when it matches), the hashed scripts ``public, immutable,
    max-age=31536000``, the main script gzipped when asked. A script is held until six requests are
    in flight together (or 5 s pass), so a client that fetches with fewer connections is seen to."""

    FILES = [f"static/js/part{i}.js" for i in range(12)]
    MAIN = ('const m={f:["./PlotlyChart.abc.js","./part0.js","./extra.def.js","../css/chart.css"]};'
            'lazy(()=>H(()=>import(`./PlotlyChart.abc.js`),__vite__mapDeps([0,1,2,3]),import.meta.url));'
            'm.f=["./PlotlyChart.abc.js","./part0.js","./extra.def.js","../css/chart.css"];')

    def __init__(self):
        import gzip
        import http.server

        site = self
        self.log: list[tuple[str, int]] = []  # (path, client port) per request
        self.in_flight = self.most_in_flight = 0
        self.together = threading.Barrier(6, timeout=5)
        self.lock = threading.Lock()
        names = "".join(f'<link rel="modulepreload" crossorigin href="./{f}">' for f in self.FILES)
        index = f'<html><script type="module" crossorigin src="./static/js/index.main.js"></script>{names}</html>'.encode()
        bodies = {"/": index, "/static/js/index.main.js": self.MAIN.encode(), "/_stcore/health": b"ok",
                  "/_stcore/host-config": b"{}", **{f"/{f}": f"// {f}\n".encode() * 50 for f in self.FILES},
                  **{f"/static/{p}": p.encode() for p in ("js/PlotlyChart.abc.js", "js/extra.def.js", "css/chart.css")}}
        self.bodies = bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept alive, as Streamlit's server does

            def log_message(self, *args):
                pass

            def do_GET(self):
                with site.lock:
                    site.log.append((self.path, self.client_address[1]))
                    site.in_flight += 1
                    site.most_in_flight = max(site.most_in_flight, site.in_flight)
                try:
                    if self.path.startswith("/static/js/part"):
                        try:
                            site.together.wait()
                        except threading.BrokenBarrierError:
                            pass
                    self.answer()
                finally:
                    with site.lock:
                        site.in_flight -= 1

            def answer(self):
                body = bodies.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/" and self.headers.get("If-None-Match") == '"page-1"':
                    self.send_response(304)
                    self.send_header("ETag", '"page-1"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                if self.path == "/":
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("ETag", '"page-1"')
                elif self.path.startswith("/static/"):
                    self.send_header("Cache-Control", "public, immutable, max-age=31536000")
                if self.path == "/static/js/index.main.js" and "gzip" in self.headers.get("Accept-Encoding", ""):
                    body = gzip.compress(body)
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def site():
    s = _Site()
    yield s
    s.close()


def _open_page(student: client.Student) -> None:
    async def go():
        try:
            await student.fetch_page()
        finally:
            student.http.close()

    asyncio.run(go())


def test_a_students_page_files_go_out_over_six_kept_alive_connections_at_once(site):
    """Chromium keeps six connections to a host: the first page's files are fetched six at a time,
    never more, and every connection is kept for the next file (one connection at a time made the
    thirty-session first page a measure of the client)."""
    student = client.Student(site.url)
    _open_page(student)
    assert site.most_in_flight == 6 and student.http.tally.most_open == 6
    assert len({port for _, port in site.log}) == 6  # kept alive: sixteen requests, six connections
    assert {path for path, _ in site.log} == {"/", "/static/js/index.main.js", *(f"/{f}" for f in site.FILES),
                                              "/_stcore/health", "/_stcore/host-config"}


def test_a_second_page_load_takes_the_immutable_files_from_the_browsers_cache(site):
    """A new page in the same browser asks again for the page (``no-cache``: revalidated, 304) and the
    uncacheable health check, never for a script served ``immutable, max-age``."""
    student = client.Student(site.url)
    _open_page(student)
    first = len(site.log)
    _open_page(student)
    again = sorted(path for path, _ in site.log[first:])
    assert again == ["/", "/_stcore/health", "/_stcore/host-config"]
    assert student.http.tally.revalidated == 1 and student.http.tally.from_cache == 1 + len(site.FILES)


def test_a_gzipped_script_is_read_as_sent_and_its_elements_code_is_fetched_when_drawn(site):
    """The main script comes gzipped (asked for with Accept-Encoding) and is read as the page reads it:
    its table of lazily loaded chunks. An element's first arrival fetches its chunk and what that
    imports, relative paths resolved, each file once per page (``part0.js`` came with the page)."""
    student = client.Student(site.url)

    async def go():
        try:
            await student.fetch_page()
            student._load_code("plotly_chart")
            student._load_code("plotly_chart")  # a second chart of the same kind: nothing more to fetch
            student._load_code("markdown")  # drawn by the main script: no chunk
            await asyncio.gather(*student.loading)
        finally:
            student.http.close()

    asyncio.run(go())
    assert student.http.tally.compressed == 1
    assert student.chunks["PlotlyChart"] == ["/static/js/PlotlyChart.abc.js", "/static/js/part0.js",
                                             "/static/js/extra.def.js", "/static/css/chart.css"]
    later = [path for path, _ in site.log[-3:]]
    assert sorted(later) == ["/static/css/chart.css", "/static/js/PlotlyChart.abc.js", "/static/js/extra.def.js"]
    assert [p for p, _ in site.log].count("/static/js/part0.js") == 1


def test_the_client_against_browser_comparison_refuses_a_bad_run_count_in_one_line():
    """``kvsim/bench/scripts/client_vs_browser.py`` (docs/classroom.md quotes its figures) checks its flag before it
    starts a server or a browser."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "kvsim" / "bench" / "scripts" / "client_vs_browser.py"
    out = subprocess.run([sys.executable, str(script), "--runs", "0"], capture_output=True, text=True, timeout=120,
                         env=checkout_env())  # this checkout's kvsim, as installed (the script no longer puts it on sys.path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "--runs 0: expected 1 to 50" in out.stderr

"""``kvsim serve --processes K``: a class on one machine, K ``streamlit run app.py`` processes behind nginx.

One Streamlit process is one Python interpreter: its scripts, its event loop and its serving of the
page's files share one lock, so it uses about one core (docs/classroom.md). ``Serve`` starts K of them,
each on its own free loopback port with the checkout's ``.streamlit/config.toml``, and one nginx in
front (Debian's package, run unprivileged-style in the foreground with its own prefix, temp folders
and configuration in a run folder of its own): nginx serves the frontend's files itself (a mirror of
the installed Streamlit's ``static/`` folder with a gzipped copy of every text file) and pins each
browser to one process by a cookie it sets (``deploy/nginx.conf.template`` says how). Without nginx
(not installed, or its configuration test failing) ``Serve`` runs one plain Streamlit process on the
address and port asked for.

A foundation (docs/architecture.md): it imports nothing of kvsim, so the command (``kvsim.cli``) and
the class benchmark (``kvsim.bench.load``) both start it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_SCRIPT = ROOT / "app.py"
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"
DEFAULT_PORT = 8501
#: how long a process may take to answer its health check (a fresh one on a busy two-core machine)
START_S = 120
#: files of the frontend nginx sends gzipped from a copy made once per start
COMPRESSED = (".js", ".mjs", ".css", ".html", ".json", ".map", ".svg", ".txt")
#: where nginx is looked for when it is not on the PATH (Debian puts it in /usr/sbin, which a user's PATH lacks)
SBIN = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


class ServeError(ValueError):
    """What stops ``kvsim serve`` before anything starts (a port in use, no app to serve): one line."""


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def port_in_use(address: str, port: int) -> bool:
    """Whether ``address:port`` cannot be listened on now (something holds it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nginx and uvicorn bind: a TIME_WAIT is no holder
        try:
            s.bind((address, port))
        except OSError:
            return True
    return False


def find_nginx(given: str | None = None) -> str | None:
    """The nginx binary: ``given`` (a path or a name on the PATH), else nginx on the PATH, else Debian's
    /usr/sbin/nginx and the like; None when there is none."""
    if given:
        return shutil.which(given) if os.sep not in given else (given if os.access(given, os.X_OK) else None)
    return shutil.which("nginx") or next((p for p in SBIN if os.access(p, os.X_OK)), None)


def streamlit_static_dir() -> Path:
    """The installed Streamlit's frontend build (index.html and static/), found without importing Streamlit."""
    import importlib.util

    spec = importlib.util.find_spec("streamlit")
    if spec is None or spec.origin is None:
        raise ServeError("Streamlit is not installed in this interpreter (pip install -e . in the checkout)")
    return Path(spec.origin).parent / "static"


def max_upload_mb(root: Path = ROOT) -> int:
    """``server.maxUploadSize`` of the checkout's .streamlit/config.toml (Streamlit's default: 200)."""
    try:
        with open(root / ".streamlit" / "config.toml", "rb") as f:
            return int(tomllib.load(f).get("server", {}).get("maxUploadSize", 200))
    except (OSError, tomllib.TOMLDecodeError, ValueError):
        return 200


def mirror_static(source: Path, target: Path, jobs: int = 2) -> int:
    """``target``: every file of ``source`` as a symbolic link, and NAME.gz beside each text file (level 9,
    for gzip_static). Returns the files compressed."""
    todo = []
    for folder, _, files in os.walk(source):
        rel = Path(folder).relative_to(source)
        (target / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            (target / rel / name).symlink_to(Path(folder) / name)
            if name.endswith(COMPRESSED):
                todo.append((Path(folder) / name, target / rel / f"{name}.gz"))

    def compress(pair) -> None:
        src, dst = pair
        dst.write_bytes(gzip.compress(src.read_bytes(), compresslevel=9, mtime=0))

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:  # zlib lets go of the lock
        list(pool.map(compress, todo))
    return len(todo)


def render_config(template: str, *, run_dir: Path, static_dir: Path, listen: str, upstreams: list[int],
                  max_body_mb: int) -> str:
    """The template with every ``{{NAME}}`` filled in; a ServeError naming any it does not know."""
    user = ""
    if os.geteuid() == 0:  # nginx's workers would otherwise run as nobody, who cannot read root's run folder
        import grp
        import pwd

        user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};"
    values = {"USER": user, "RUN_DIR": str(run_dir), "STATIC_DIR": str(static_dir), "LISTEN": listen,
              "UPSTREAMS": "\n".join(f"        server 127.0.0.1:{p} max_fails=0;" for p in upstreams),
              "MAX_BODY_MB": str(max_body_mb + 1)}
    unknown = sorted(set(re.findall(r"\{\{(\w+)\}\}", template)) - set(values))
    if unknown:
        raise ServeError(f"the nginx template names {{{{{unknown[0]}}}}}, which kvsim serve does not fill in "
                         f"(it fills {', '.join(values)})")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the process that started it dies (Linux), so that a killed
    ``kvsim serve`` leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _first_error(text: str) -> str:
    """nginx's one line that says what is wrong (its [emerg]), without the ``nginx: `` prefix."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = next((x for x in lines if "[emerg]" in x or "[alert]" in x), lines[0] if lines else "no message")
    return line.removeprefix("nginx: ")


class Serve:
    """K Streamlit processes behind nginx on ``address:port``, or one plain Streamlit process there when
    nginx is missing (``nginx`` None) or its configuration fails ``nginx -t``. ``note`` gets each
    one-line message (a fallback, a cap). ``start`` returns when every process answers; ``stop`` ends
    them all and removes the run folder."""

    def __init__(self, processes: int, port: int = DEFAULT_PORT, address: str = "0.0.0.0", nginx: str | None = None,
                 template: Path = TEMPLATE, env: dict | None = None, note: Callable[[str], None] | None = None,
                 streamlit_args: tuple[str, ...] = ()):
        self.processes, self.port, self.address = processes, port, address
        self.nginx, self.template, self.note = nginx, Path(template), note or (lambda line: None)
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH")]))
        self.streamlit_args = tuple(streamlit_args)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvsim-serve-"))
        self.upstreams: list[int] = []
        self.procs: list[subprocess.Popen] = []  # the Streamlit processes, in the order of upstreams
        self.proxy: subprocess.Popen | None = None
        self.proxied = False
        self.start_s = 0.0
        self._static_source: Path | None = None  # Streamlit's frontend, once nginx is to serve it

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "::", "") else self.address
        return f"http://{host}:{self.port}"

    def pids(self) -> list[int]:
        """Every server process started (nginx's master first when there is one)."""
        return [p.pid for p in ([self.proxy] if self.proxy else []) + self.procs]

    # --- starting ---------------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.perf_counter()
        if not APP_SCRIPT.is_file():
            raise ServeError(f"kvsim serve runs the app from a checkout of kvsim (pip install -e . in it); there is no {APP_SCRIPT}")
        if port_in_use(self.address, self.port):
            raise ServeError(f"--port {self.port}: {self.address}:{self.port} is in use (another kvsim serve or app?); "
                             "stop it or choose another --port")
        try:
            conf = self._configured()
            if conf is None:  # one plain Streamlit process on the port asked for
                self.upstreams = [self.port]
                self.procs = [self._streamlit(self.port, self.address)]
                self._wait_healthy(self.url.removeprefix("http://").rsplit(":", 1)[0])
            else:
                self.procs = [self._streamlit(p, "127.0.0.1") for p in self.upstreams]
                self._wait_healthy()
                self._start_nginx(conf)
                self.proxied = True
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _configured(self) -> Path | None:
        """The run folder's nginx.conf, tested; None (and a note) when there is no nginx or it fails."""
        nginx = find_nginx(self.nginx)
        if nginx is None:
            where = f"--nginx {self.nginx}: no such program" if self.nginx else "nginx is not installed (not on the PATH, nor in /usr/sbin)"
            self.note(f"{where}; serving one Streamlit process without a proxy on {self.url} (apt-get install nginx for --processes)")
            return None
        self.nginx = nginx
        try:
            template = self.template.read_text(encoding="utf-8")
        except OSError as e:
            raise ServeError(f"--template: {self.template}: {e.strerror or type(e).__name__}") from None
        static = self.run_dir / "static"
        # the upstreams' ports are chosen now, so that the file nginx -t reads is the one it runs
        self.upstreams = [free_port() for _ in range(self.processes)]
        listen = f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"
        conf = self.run_dir / "nginx.conf"
        conf.write_text(render_config(template, run_dir=self.run_dir, static_dir=static, listen=listen,
                                      upstreams=self.upstreams, max_body_mb=max_upload_mb()))
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.run_dir / sub).mkdir(exist_ok=True)
        done = subprocess.run([nginx, *self._nginx_flags(conf), "-t", "-q"], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            said = _first_error(done.stderr or done.stdout).replace(str(conf), f"{self.template} as filled in")
            self.note(f"nginx -t failed on {self.template}: {said}; "
                      f"serving one Streamlit process without a proxy on {self.url}")
            return None
        self._static_source = streamlit_static_dir()
        return conf

    def _nginx_flags(self, conf: Path) -> list[str]:
        return ["-p", f"{self.run_dir}/", "-c", str(conf), "-e", str(self.run_dir / "error.log"), "-g", "daemon off;"]

    def _streamlit(self, port: int, address: str) -> subprocess.Popen:
        log = open(self.run_dir / f"streamlit-{port}.log", "wb")  # the child holds it
        cmd = [sys.executable, "-m", "kvsim.app.launch", "run", str(APP_SCRIPT), "--server.headless", "true",
               "--server.port", str(port), "--server.address", address, "--browser.gatherUsageStats", "false",
               "--server.fileWatcherType", "none", *self.streamlit_args]
        with log:
            return subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_healthy(self, host: str = "127.0.0.1") -> None:
        """Until every process answers its health check; the frontend's mirror is made meanwhile."""
        mirror = None
        if self._static_source is not None:
            mirror = threading.Thread(target=mirror_static, args=(self._static_source, self.run_dir / "static"), daemon=True)
            mirror.start()
        deadline = time.monotonic() + START_S
        waiting = dict(zip(self.upstreams, self.procs, strict=True))
        while waiting:
            for port, proc in list(waiting.items()):
                if proc.poll() is not None:
                    raise ServeError(f"the Streamlit process on port {port} exited with status {proc.returncode}: "
                                     f"{self._log_tail(port)}")
                try:
                    with urllib.request.urlopen(f"http://{host}:{port}/_stcore/health", timeout=2) as r:
                        if r.read().strip() == b"ok":
                            del waiting[port]
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise ServeError(f"the Streamlit process on port {next(iter(waiting))} did not answer within {START_S} s")
            if waiting:
                time.sleep(0.2)
        if mirror is not None:
            mirror.join()

    def _log_tail(self, port: int) -> str:
        try:
            lines = (self.run_dir / f"streamlit-{port}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1].strip() if lines else "no output"

    def _start_nginx(self, conf: Path) -> None:
        with open(self.run_dir / "nginx.out", "wb") as out:
            self.proxy = subprocess.Popen([self.nginx, *self._nginx_flags(conf)], cwd=self.run_dir, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            if self.proxy.poll() is not None:
                said = "\n".join((self.run_dir / name).read_text(errors="replace") for name in ("nginx.out", "error.log")
                                 if (self.run_dir / name).is_file())
                raise ServeError(f"nginx exited with status {self.proxy.returncode}: {_first_error(said)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServeError(f"nginx did not answer on {self.url} within 30 s")
            time.sleep(0.1)

    # --- running and stopping ---------------------------------------------------------------------

    def exited(self) -> str | None:
        """What ended, when a server process has (a process's last log line), else None."""
        if self.proxy is not None and self.proxy.poll() is not None:
            return f"nginx exited with status {self.proxy.returncode}"
        for port, proc in zip(self.upstreams, self.procs, strict=True):
            if proc.poll() is not None:
                return f"the Streamlit process on port {port} exited with status {proc.returncode}: {self._log_tail(port)}"
        return None

    def stop(self) -> None:
        if self.proxy is not None:
            _end(self.proxy)
        for proc in self.procs:
            _end(proc)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Serve:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _end(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    """SIGTERM to the process's group (it leads one), SIGKILL when it is still there after ``timeout_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

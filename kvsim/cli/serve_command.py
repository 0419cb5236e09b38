"""``kvsim serve --processes K``: the app for a class, K Streamlit processes behind nginx (``kvsim.serve``),
in the foreground until Ctrl-C or SIGTERM (docs/classroom.md says how it is built and what it measured).

Each thing that keeps the proxy from running is one line on stderr, and the app still starts as one
plain Streamlit process on the port asked for: nginx not installed, or its configuration test failing.
--processes above this machine's cores is capped to the cores (a Streamlit process uses about one),
said in one line. A port in use starts nothing: one line, exit status 1."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from .. import serve
from .errors import InputError


def add_serve(sub, positive_int) -> None:
    p = sub.add_parser("serve", help="the app for a class: K Streamlit processes behind nginx, which serves the "
                       "page's files and pins each browser to one process",
                       description="Starts K `streamlit run app.py` processes on free loopback ports and nginx in front of "
                       "them on --address:--port (the config: deploy/nginx.conf.template, tested with nginx -t first). "
                       "Runs until Ctrl-C. Without nginx, or when its config test fails, it says so in one line and "
                       "serves one plain Streamlit process on that port. docs/classroom.md says how many processes a "
                       "class needs.")
    p.add_argument("--processes", type=positive_int, default=None, metavar="K", help="Streamlit processes (default: one "
                   f"per core, here {serve.cores()}; more than the cores is capped to the cores)")
    p.add_argument("--port", type=positive_int, default=serve.DEFAULT_PORT, help=f"the port students open (default: "
                   f"{serve.DEFAULT_PORT}, Streamlit's own)")
    p.add_argument("--address", default="0.0.0.0", help="the address to listen on (default: 0.0.0.0, every interface, "
                   "as streamlit run does; 127.0.0.1 for this machine only)")
    p.add_argument("--nginx", default=None, metavar="PROGRAM", help="the nginx to run (default: nginx on the PATH, else "
                   "/usr/sbin/nginx)")
    p.add_argument("--template", type=Path, default=serve.TEMPLATE, metavar="FILE", help="an nginx config template "
                   "(default: the shipped deploy/nginx.conf.template)")
    p.add_argument("--json", action="store_true", help="when it stops, print one JSON document on stdout and nothing else")


def cmd_serve(args: argparse.Namespace) -> dict:
    def note(line: str) -> None:
        print(f"kvsim serve: {line}", file=sys.stderr, flush=True)

    cores = serve.cores()
    processes = cores if args.processes is None else args.processes
    if processes > cores:
        note(f"--processes {processes} is more than this machine's {cores} cores (a Streamlit process uses about one); "
             f"starting {cores}")
        processes = cores
    stop = threading.Event()
    why = {"stopped": "interrupted"}

    def on_signal(signum, frame) -> None:
        why["stopped"] = signal.Signals(signum).name
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    server = serve.Serve(processes, port=args.port, address=args.address, nginx=args.nginx, template=args.template, note=note)
    try:
        try:
            server.start()
        except serve.ServeError as e:
            raise InputError(str(e)) from None
        if server.proxied:
            note(f"{server.url}: nginx in front of {processes} Streamlit process{'es' if processes > 1 else ''} (ports "
                 f"{', '.join(map(str, server.upstreams))}), started in {server.start_s:.1f} s; Ctrl-C stops them")
        else:
            note(f"{server.url}: one Streamlit process, started in {server.start_s:.1f} s; Ctrl-C stops it")
        t0 = time.monotonic()
        while not stop.wait(0.5):
            if (ended := server.exited()) is not None:
                raise InputError(f"{ended}; stopping the rest")
        return {"url": server.url, "proxy": "nginx" if server.proxied else None, "processes": len(server.procs),
                "ports": server.upstreams, "served_s": round(time.monotonic() - t0, 1), "stopped": why["stopped"]}
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def render_serve(doc: dict) -> str:
    how = f"nginx in front of {doc['processes']} Streamlit processes" if doc["proxy"] else "one Streamlit process"
    return f"served {doc['url']} ({how}) for {doc['served_s']:.0f} s; stopped by {doc['stopped']}"

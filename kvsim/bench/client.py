"""A student's browser tab without the browser, for ``kvsim bench --load``: a client that speaks
Streamlit's own websocket protocol (``/_stcore/stream``: protobuf ``BackMsg`` out, ``ForwardMsg``
in) as the page's JavaScript does. It fetches the page's files as the browser's network side does
(``fetch``: six kept-alive connections, the profile's HTTP cache, gzip accepted): the page, the
files it names, the health check (which sets the XSRF cookie) and the host config; opens the
websocket; fetches each element kind's chunk as its first element arrives (Plotly's, the widgets');
sends ``rerun_script`` with the URL's query string and the widget states it changed;
follows the server's ``page_info_changed`` (the link the app writes) and ``auto_rerun`` (a
fragment's timer: the curve view's background refinement) as the page would; uploads a file the
way the uploader does. A step is over when the server reports a whole script run finished
(``script_finished``, not cut short for a rerun, not a fragment's run) and the chunks of the
elements it drew have arrived.
"""

from __future__ import annotations

import asyncio
import io
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from . import fetch

STEP_TIMEOUT_S = 120.0

@dataclass(frozen=True)
class Open:
    """A new student opens the link: the page's files, then the websocket's first run."""


@dataclass(frozen=True)
class Click:
    """Press the button labelled ``label``, or the one whose key is ``key``."""

    label: str = ""
    key: str = ""


@dataclass(frozen=True)
class Number:
    """Type ``value`` into the number input keyed ``key`` (the sidebar's controls are keyed by name)."""

    key: str
    value: int


def _pb():
    """Streamlit's protobuf classes, imported when a client first needs them."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from streamlit.proto.WidgetStates_pb2 import WidgetState

    return BackMsg, ForwardMsg, WidgetState


class Student:
    """One browser tab's conversation with the server, without the browser."""

    def __init__(self, url: str):
        self.url = url
        self.query = ""
        self.widgets: dict[str, object] = {}  # element id -> its proto, the latest delivered last
        self.texts: list[str] = []  # markdown, captions and labels of the latest whole run
        self.charts = 0  # Plotly charts of the latest whole run
        self.finished = 0  # whole runs finished
        self.running = False
        self.fragments: dict[str, asyncio.Task] = {}
        self.session_id = ""
        self.upload_urls: asyncio.Future | None = None
        self.files_s = None
        self.cpu = None  # the server's CPU seconds so far, for a session alone on it (its files' share is then its own)
        self.files_cpu_s = None
        host, port = url.removeprefix("http://").split(":")
        self.http = fetch.Pool(host, int(port))  # this student's browser: its connections and its HTTP cache
        self.chunks: dict[str, list[str]] = {}  # an element chunk's name -> the files it loads (the main script's table)
        self.page_files: set[str] = set()  # what this page load has fetched (a browser's module map: never twice)
        self.loading: list[asyncio.Future] = []  # element chunks asked for and not yet here
        self._changed = asyncio.Event()

    @property
    def xsrf(self) -> str:
        """The XSRF cookie the page was given: an upload sends it back."""
        return self.http.cookies.get("_streamlit_xsrf", "")

    @property
    def cookie_header(self) -> str:
        """The cookies this browser sends back (the XSRF cookie; behind kvsim serve, the proxy's pin)."""
        return "; ".join(f"{k}={v}" for k, v in self.http.cookies.items())

    @property
    def files_bytes(self) -> int:
        """Bytes the server sent this student's browser over HTTP (the page's files, its chunks)."""
        return self.http.tally.wire_bytes

    # --- the page's files ---------------------------------------------------------------------

    async def fetch_page(self) -> None:
        """A page load's files up to the point where the page's script opens the websocket: the page,
        then the files it names, then the health check and the host config (``fetch`` says how a
        browser fetches them and what it takes from its cache)."""
        t0, cpu0 = time.perf_counter(), self.cpu() if self.cpu else None
        self.page_files, self.loading = set(), []
        index = (await self._get_all(["/"]))["/"].decode()
        named = fetch.named_files(index)
        bodies = await self._get_all(named)
        main = fetch.main_script(index)
        if main in bodies and not self.chunks:
            self.chunks = fetch.lazy_chunks(bodies[main].decode(), main.rsplit("/", 1)[0])
        await self._get_all(["/_stcore/health", "/_stcore/host-config"])  # the health check sets the XSRF cookie
        self.files_s = time.perf_counter() - t0
        self.files_cpu_s = None if cpu0 is None else self.cpu() - cpu0

    async def _get_all(self, paths: list[str]) -> dict[str, bytes]:
        paths = [p for p in dict.fromkeys(paths) if p not in self.page_files]
        self.page_files.update(paths)
        futures = [asyncio.wrap_future(self.http.submit(p)) for p in paths]
        return dict(zip(paths, await asyncio.wait_for(asyncio.gather(*futures), STEP_TIMEOUT_S), strict=True))

    def _load_code(self, kind: str) -> None:
        """Ask for the chunk that draws ``kind`` (and what it imports) as React does on its first element."""
        files = [f for f in self.chunks.get(fetch.chunk_name(kind), []) if f not in self.page_files]
        if files:
            self.loading.append(asyncio.ensure_future(self._get_all(files)))

    def put_file(self, url: str, name: str, data: bytes) -> None:
        """PUT ``data`` to the upload URL as the page does: multipart, with the XSRF cookie and header."""
        boundary = "kvsimloadboundary"
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        if self.xsrf:
            headers |= {"X-Xsrftoken": self.xsrf}
        if self.http.cookies:
            headers["Cookie"] = self.cookie_header
        url = url if url.startswith("http") else self.url + "/" + url.lstrip("/")
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method="PUT"), timeout=60):
            pass

    # --- the websocket ------------------------------------------------------------------------

    async def connect(self) -> None:
        import websockets

        ws_url = self.url.replace("http://", "ws://") + "/_stcore/stream"
        cookies = {"Cookie": self.cookie_header} if self.http.cookies else None  # as the browser sends them
        self.ws = await websockets.connect(ws_url, subprotocols=["streamlit"], max_size=None, open_timeout=60,
                                           additional_headers=cookies)
        self.reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        for task in self.fragments.values():
            task.cancel()
        self.http.close()
        if hasattr(self, "ws"):
            await self.ws.close()
            self.reader.cancel()

    async def _read(self) -> None:
        _, ForwardMsg, _ = _pb()
        early, fragment = ForwardMsg.FINISHED_EARLY_FOR_RERUN, ForwardMsg.FINISHED_FRAGMENT_RUN_SUCCESSFULLY
        async for payload in self.ws:
            msg = ForwardMsg.FromString(payload)
            kind = msg.WhichOneof("type")
            if kind == "new_session":
                self.session_id = msg.new_session.initialize.session_id or self.session_id
                if not msg.metadata.run.fragment_ids:
                    self.texts, self.charts = [], 0
            elif kind == "delta":
                self._element(msg.delta)
            elif kind == "page_info_changed":
                self.query = msg.page_info_changed.query_string
            elif kind == "session_status_changed":
                self.running = msg.session_status_changed.script_is_running
            elif kind == "auto_rerun":
                self._auto_rerun(msg.auto_rerun.fragment_id, msg.auto_rerun.interval)
            elif kind == "stop_auto_rerun":
                for fid in msg.stop_auto_rerun.fragment_ids or list(self.fragments):
                    if (task := self.fragments.pop(fid, None)) is not None:
                        task.cancel()
            elif kind == "file_urls_response" and self.upload_urls is not None:
                self.upload_urls.set_result(msg.file_urls_response)
            elif kind == "script_finished" and msg.script_finished not in (early, fragment):
                self.finished += 1
            self._changed.set()

    def _element(self, delta) -> None:
        if delta.WhichOneof("type") != "new_element":
            return
        element = delta.new_element
        kind = element.WhichOneof("type")
        if kind is None:
            return
        proto = getattr(element, kind)
        for name in ("body", "label"):
            text = getattr(proto, name, None)
            if isinstance(text, str) and text:
                self.texts.append(text)
        if kind == "selectbox":
            self.texts.extend(proto.options)
        self.charts += kind == "plotly_chart"
        self._load_code(kind)
        wid = getattr(proto, "id", "")
        if isinstance(wid, str) and wid.startswith("$$ID"):
            self.widgets.pop(wid, None)
            self.widgets[wid] = (kind, proto)

    def _auto_rerun(self, fragment_id: str, interval: float) -> None:
        """Run the fragment every ``interval`` seconds, as the page's timer does."""
        if (task := self.fragments.pop(fragment_id, None)) is not None:
            task.cancel()

        async def tick():
            while True:
                await asyncio.sleep(interval)
                await self.rerun([], fragment_id=fragment_id)

        self.fragments[fragment_id] = asyncio.create_task(tick())

    async def rerun(self, states: list, fragment_id: str = "") -> None:
        BackMsg, _, _ = _pb()
        msg = BackMsg()
        client = msg.rerun_script
        client.query_string = self.query
        client.widget_states.widgets.extend(states)
        if fragment_id:  # the page's timer: a fragment's own run
            client.fragment_id, client.is_auto_rerun = fragment_id, True
        await self.ws.send(msg.SerializeToString())

    # --- the lesson's actions -----------------------------------------------------------------

    def find(self, kind: str, label: str = "", key: str = ""):
        """The latest delivered widget of ``kind`` with that label or whose id ends with that key."""
        for wid, (k, proto) in reversed(self.widgets.items()):
            if k == kind and ((key and wid.endswith("-" + key)) or (label and proto.label == label)):
                return wid, proto
        raise LookupError(f"no {kind} {'labelled ' + repr(label) if label else 'keyed ' + repr(key)} on the page")

    def states_for(self, action) -> list:
        _, _, WidgetState = _pb()
        if isinstance(action, Click):
            wid, _ = self.find("button", action.label, action.key)
            return [WidgetState(id=wid, trigger_value=True)]
        if isinstance(action, Number):
            wid, proto = self.find("number_input", key=action.key)
            as_int = proto.data_type == type(proto).INT
            return [WidgetState(id=wid, int_value=action.value) if as_int else WidgetState(id=wid, double_value=action.value)]
        return []

    async def act(self, action) -> None:
        if isinstance(action, Open):
            await self.fetch_page()
            await self.connect()
        await self.rerun(self.states_for(action))

    async def finish_after(self, seen: int, deadline: float) -> None:
        """Wait for a whole run finished after ``seen``, and for the code of every element it drew
        (the page cannot show an element before its chunk is here)."""
        while self.finished <= seen:
            self._changed.clear()
            if time.monotonic() > deadline:
                raise TimeoutError("the server never reported the run finished")
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                pass
        while self.loading:
            await asyncio.wait_for(self.loading.pop(0), timeout=max(0.01, deadline - time.monotonic()))

    async def quiet(self, timeout_s: float = STEP_TIMEOUT_S) -> None:
        """Wait while a run of this session (a fragment's included) is in progress."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def timed(self, action, expect: str) -> tuple[float | None, str]:
        """Run ``action``; its seconds (None on a miss: a timeout, or a page without a chart or without
        ``expect`` in its text or its link) and what went wrong."""
        seen, t0 = self.finished, time.perf_counter()
        try:
            await self.act(action)
            await self.finish_after(seen, time.monotonic() + STEP_TIMEOUT_S)
        except Exception as e:  # a timeout or a lost page is this session's result, not the benchmark's end
            return None, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        if not self.charts or not (expect in self.query or any(expect in text for text in self.texts)):
            return None, f"the page does not show {expect!r} beside a chart"
        return seconds, ""


# --- one student's upload, seen by nobody else ------------------------------------------------


def small_trace_npz(steps: int = 64, seed: int = 0) -> bytes:
    """A small valid trace file (each row a distribution over the positions so far)."""
    rng = np.random.default_rng(seed)
    a = np.tril(rng.random((steps + 1, steps + 1)).astype(np.float32))
    a /= a.sum(axis=1, keepdims=True)
    out = io.BytesIO()
    np.savez(out, attention=a)
    return out.getvalue()


UPLOAD_NAME = "class-upload.npz"


async def upload(student: Student, data: bytes, name: str = UPLOAD_NAME) -> None:
    """What the page's uploader does: ask for an upload URL, PUT the file there (multipart, with the
    XSRF cookie and header), then rerun with the uploader's state naming the file."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from streamlit.proto.Common_pb2 import FileUploaderState, FileURLs, UploadedFileInfo
    from streamlit.proto.WidgetStates_pb2 import WidgetState

    wid, _ = student.find("file_uploader", label="or upload a trace (.npz)")
    student.upload_urls = asyncio.get_running_loop().create_future()
    msg = BackMsg()
    msg.file_urls_request.request_id, msg.file_urls_request.session_id = "load-upload", student.session_id
    msg.file_urls_request.file_names.append(name)
    await student.ws.send(msg.SerializeToString())
    response = await asyncio.wait_for(student.upload_urls, STEP_TIMEOUT_S)
    urls = response.file_urls[0]
    await asyncio.to_thread(student.put_file, urls.upload_url, name, data)
    info = UploadedFileInfo(name=name, size=len(data), file_id=urls.file_id,
                            file_urls=FileURLs(file_id=urls.file_id, upload_url=urls.upload_url, delete_url=urls.delete_url))
    await student.rerun([WidgetState(id=wid, file_uploader_state_value=FileUploaderState(uploaded_file_info=[info]))])

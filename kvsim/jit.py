"""The one way kvsim compiles a kernel: ``@kernel`` (numba's ``njit``, cached on disk, releasing the
GIL) where numba is installed, the plain Python function where it is not, so every caller still
works (slower) without it. ``AVAILABLE`` says which.

``nogil``: a sweep runs its batches on several threads at once, and the app's solves and replays run
in background threads while the UI thread draws; ``cache``: the compiled code is kept beside the
module (``__pycache__``, or under ``NUMBA_CACHE_DIR``), so only the first process after an install
pays for compiling.

Compiling is what a brand-new install waits for (seconds per kernel family), so a caller that must
not wait (the app's page) can ask for the compiled paths only: inside ``compiled_only()``, ``use(group)``
is true only for a group of kernels ``mark_compiled`` has named (compiled, or loaded from numba's disk
cache, in this process); elsewhere it is simply ``AVAILABLE``. A caller that gets False takes its
reference or NumPy path, which gives the same results.

numba itself is imported only when a kernel is first called (or its disk cache asked about): importing
it costs a process 0.3-0.5 s, which ``kvsim --help``, a usage error, ``cache list`` and every other
command that runs no kernel do not pay (issue 36; tests/test_startup.py holds it). ``@kernel`` gives a
stand-in that compiles on its first call; at that moment every stand-in that the kernel's code names
(and, in turn, that those kernels' code names) is swapped for its numba dispatcher in their module
globals, because numba compiles a kernel's call of another kernel only when the name resolves to a
dispatcher. The module's other kernels stay stand-ins: a replay makes the dozen dispatchers its step
kernel calls, not the fifty of its module (0.02-0.06 s a process here, issue 36).

numba keys a kernel's disk cache by its own file's time stamp and its own bytecode: a kernel whose
helper in another module was edited would load its old compiled code, the old helper inlined. Each
dispatcher's cache key here also holds ``sources_digest`` of the kernel, a digest of every file its
code reaches (its own, and, transitively, those of the kernels and functions it names), so editing a
module recompiles the kernels that call into it and nothing else.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: True when kernels are compiled; False means the reference paths run instead (identical results).
#: Asked of the import system without importing numba (numba is in requirements.txt; without it every
#: kernel runs as Python)
AVAILABLE = importlib.util.find_spec("numba") is not None


class Kernel:
    """A function that numba compiles (``njit``, cached on disk, without the GIL) on its first call,
    importing numba then; until that call nothing of numba is loaded. Attributes other than calling
    (``py_func``, ``signatures``...) are the dispatcher's."""

    def __init__(self, fn) -> None:
        self.py_func = fn
        self._dispatcher = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return (self._dispatcher or self.dispatcher)(*args)

    @property
    def dispatcher(self):
        """numba's dispatcher of this kernel (made, not compiled, on first use)."""
        if self._dispatcher is None:
            with _swap_lock:
                _dispatch(self)
        return self._dispatcher

    def __getattr__(self, name):
        if name.startswith("__") or name in ("py_func", "_dispatcher"):
            raise AttributeError(name)
        return getattr(self.dispatcher, name)

    def __repr__(self) -> str:
        return f"<kvsim kernel {self.py_func.__module__}.{self.py_func.__qualname__}>"


_swap_lock = threading.RLock()
#: whether numba's ``Cache.load_overload`` is kvsim's short path (``_load_cached_code_only``)
_short_load = False
#: whether the addresses of numba's runtime functions are registered (``_runtime_symbols``)
_nrt_symbols = False


def _dispatch(k: Kernel) -> None:
    """Give ``k`` its dispatcher, swapping first every stand-in its code names (and, in turn, every one
    their code names) for its own in the globals it is read from: a thread that calls a dispatcher finds
    the kernels it calls swapped already. A kernel's globals change in one ``dict.update``, a callee's
    before its caller's; the stand-ins learn their dispatchers last."""
    try:
        from numba import njit
    except ImportError:  # found but not importable (built for another numpy): the same results, as Python
        njit = None
    else:
        _load_cached_code_only()
        _type_arrays_without_numpy_ma()
    made: dict[Kernel, object] = {}
    _make(k, made, njit, {})
    for stand_in, dispatcher in made.items():
        stand_in._dispatcher = dispatcher


def _make(k: Kernel, made: dict, njit, files: dict) -> None:
    if k._dispatcher is not None or k in made:
        return
    if njit is None:
        made[k] = k.py_func
    else:
        made[k] = dispatcher = njit(cache=True, nogil=True)(k.py_func)
        _key_by_sources(dispatcher, sources_digest([k.py_func], files))
        # numba reads every installed distribution's entry points for its extensions ahead of a first
        # call (0.04-0.09 s a process here, issue 36); code read from disk needs none, so they are
        # loaded where a kernel is compiled instead (``load_overload`` on a miss), before its compile
        if _short_load:  # else numba's own load, and its hook before it
            dispatcher._compilation_chain_init_hook = _no_extensions_yet
    names = k.py_func.__globals__
    found = {name: value for name in _names(k.py_func.__code__) if isinstance(value := names.get(name), Kernel)}
    for value in found.values():
        _make(value, made, njit, files)
    names.update({name: value._dispatcher or made[value] for name, value in found.items()})


def sources_digest(fns, files: dict | None = None) -> str:
    """A digest of the source files of ``fns`` and of every function or kernel they name, transitively
    (read from each function's module globals, as numba resolves them), and of the values of the constants
    they read there (numba freezes a global number, string or array into the code; one imported from
    another module, ``from .greedy_future import BLOCK``, is in no file the code reaches). ``files``: the
    digests of the files read so far, shared by the calls of one dispatch (a file is read once)."""
    files = {} if files is None else files
    seen, paths, consts, todo = set(), set(), set(), list(fns)
    while todo:
        f = todo.pop()
        f = getattr(f, "py_func", f)  # a kvsim kernel or a numba dispatcher: the function numba compiles
        if not isinstance(f, types.FunctionType) or f in seen:
            continue
        seen.add(f)
        paths.add(f.__code__.co_filename)
        for n in _names(f.__code__):
            g = f.__globals__.get(n)
            if callable(g):
                todo.append(g)
            elif (constant := _constant(g)) is not None:
                consts.add(f"{n}={constant}")
    digest = hashlib.sha256()
    for path in sorted(paths):
        if path not in files:
            try:
                files[path] = hashlib.sha256(Path(path).read_bytes()).digest()
            except OSError:  # no file to read (made in memory): its bytecode is numba's own key
                files[path] = b""
        digest.update(files[path])
    for constant in sorted(consts):
        digest.update(constant.encode())
    return digest.hexdigest()[:10]


def _constant(value) -> str | None:
    """What numba would freeze of a global ``value`` into a kernel's code, as text: a number's or a
    string's repr, an array's dtype, shape and a digest of its bytes; None for anything else."""
    if isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):
        return f"{value.dtype.str}{getattr(value, 'shape', ())}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return None


def _key_by_sources(dispatcher, digest: str) -> None:
    """Add ``digest`` (``sources_digest`` of the kernel) to every key of ``dispatcher``'s disk cache: numba
    keys an entry by the kernel's bytecode and finds the index by its own file's stamp, so an entry compiled
    before a helper in another file changed would still be loaded. Where numba's cache is not as this was
    written against (0.68), its own key."""
    cache = getattr(dispatcher, "_cache", None)
    own = getattr(cache, "_index_key", None)
    if own is None or not hasattr(cache, "_cache_file"):
        return

    def index_key(sig, codegen):
        key = own(sig, codegen)
        return (*key[:-1], (*key[-1], digest))

    cache._index_key = index_key
    dispatcher.kvsim_sources = digest


def _names(code: types.CodeType) -> set[str]:
    """Every name ``code`` and the code nested in it read as a global or an attribute (``co_names``):
    the globals numba may resolve when it compiles the function, and some names that are not globals
    (an attribute read), which only cost a lookup that finds no kernel."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _load_cached_code_only() -> None:
    """Let numba load a kernel's compiled code from its disk cache without installing its typing first.

    numba's ``Cache.load_overload`` refreshes the target context before it reads the cache, which imports
    and installs every implementation registry numba has (a thousand typing templates: as long again as
    ``import numba``, 0.2-0.3 s a process here, issue 36). Only a compile reads them; code read from disk
    needs numba's runtime (NRT) alone. A cache miss still goes through numba's own method (it refreshes,
    and the compile refreshes again), so what differs is only what a hit loads. Applied where numba's
    cache is as this was written against (0.68); elsewhere, or if the short path fails, numba's own.

    Of numba's runtime (NRT) a hit registers the addresses of its C functions alone (``_runtime_symbols``)."""
    try:
        from numba.core import entrypoints
        from numba.core.caching import Cache
    except ImportError:
        return
    global _short_load
    original = Cache.load_overload
    if getattr(original, "kvsim", False) or not hasattr(Cache, "_load_overload"):
        return

    def load_overload(self, sig, target_context):
        try:
            _runtime_symbols(target_context)
            with self._guard_against_spurious_io_errors(), _helper_modules_left_unimported():
                loaded = self._load_overload(sig, target_context)
        except Exception:  # another numba's internals: its own path decides
            loaded = None
        if loaded is None:  # a compile follows: with numba's extensions, as numba's own path has them
            entrypoints.init_all()
        return loaded if loaded is not None else original(self, sig, target_context)

    load_overload.kvsim = True
    Cache.load_overload = load_overload
    _short_load = True


def _runtime_symbols(target_context) -> None:
    """What compiled code read from disk needs of numba's runtime (NRT): the addresses of its C functions
    (allocation, the array adaptors), which the code calls by name. numba's ``rtsys.initialize`` also
    compiles the runtime's few LLVM functions (atomic reference counts, ``nrtdynmod``: an LLVM
    optimisation and code emission, 0.04-0.1 s a process here, issue 36); a compile links a copy of them
    into each kernel's code (``CPUCodeLibrary.finalize``, linkonce), so code read from disk carries them,
    and a compile initialises the runtime itself before it links them (numba's ``load_additional_registries``).
    numba's own ``initialize`` where its runtime is not as this was written against (0.68), or counts
    its allocations (``NUMBA_NRT_STATS``), which its ``initialize`` switches on."""
    from numba.core import config
    from numba.core.runtime import _nrt_python, rtsys

    global _nrt_symbols
    if rtsys._init or _nrt_symbols:
        return
    helpers = getattr(_nrt_python, "c_helpers", None)
    if config.NRT_STATS or not isinstance(helpers, dict):
        rtsys.initialize(target_context)
        return
    from llvmlite import binding as ll

    for name, address in helpers.items():  # named as numba's ``initialize`` names them
        ll.add_symbol(name if name.startswith("_") else f"NRT_{name}", address)
    _nrt_symbols = True


def _no_extensions_yet() -> None:
    """A kernel's stand-in for numba's ``_compilation_chain_init_hook``: nothing before its first call."""


@contextmanager
def _helper_modules_left_unimported() -> Iterator[None]:
    """While cached code is read: an environment of one of numba's own helpers (array and string code
    inlined into a kernel, from ``numba.np.arrayobj``, ``numba.cpython.unicode``) is rebuilt without
    importing its module when that is not imported yet (``arrayobj`` pulls in the string, hashing and
    sorting modules: 0.05-0.1 s a process here, issue 36). An environment's module globals are read
    only by object-mode code, which numba's nopython helpers do not have; its constants are kept.
    numba's own rebuild where the module is imported, or is not numba's. The swap is made under
    numba's compiler lock, which every load and compile holds."""
    from numba.core import environment

    rebuild = environment._rebuild_env

    def rebuild_env(modname, consts, env_name):
        if not modname.startswith("numba.") or modname in sys.modules or environment.lookup_environment(env_name):
            return rebuild(modname, consts, env_name)
        env = environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
        return env

    environment._rebuild_env = rebuild_env  # what a pickled environment names: read when it is unpickled
    try:
        yield
    finally:
        environment._rebuild_env = rebuild


def _type_arrays_without_numpy_ma() -> None:
    """numba types an array argument after asking whether it is a ``numpy.ma.MaskedArray``, which
    imports ``numpy.ma`` (0.02-0.03 s, issue 36) for the first kernel call of a process. No masked
    array exists before ``numpy.ma`` is imported, so until it is the question is skipped; the type is
    numba's own (``_typeof_ndarray`` after its check). Only where that function is numba's as this
    was written against (0.68)."""
    import numpy as np
    from numba.core import errors, types
    from numba.core.typing import typeof
    from numba.np import numpy_support

    own = typeof.typeof_impl.dispatch(np.ndarray)
    if own is not getattr(typeof, "_typeof_ndarray", None):
        return

    def typeof_ndarray(val, c):
        if "numpy.ma" in sys.modules:
            return own(val, c)
        try:
            dtype = numpy_support.from_dtype(val.dtype)
        except errors.NumbaNotImplementedError:
            raise errors.NumbaValueError(f"Unsupported array dtype: {val.dtype}") from None
        return types.Array(dtype, val.ndim, numpy_support.map_layout(val), readonly=not val.flags.writeable)

    typeof.typeof_impl.register(np.ndarray)(typeof_ndarray)


def kernel(fn):
    return Kernel(fn) if AVAILABLE else fn


_compiled: set[str] = set()
_lock = threading.Lock()
_only_compiled = contextvars.ContextVar("kvsim_only_compiled", default=False)


def mark_compiled(group: str) -> None:
    """Say that the kernels of ``group`` are compiled in this process: calling them costs no compiling."""
    with _lock:
        _compiled.add(group)


def compiled(group: str) -> bool:
    """Whether ``mark_compiled(group)`` was called in this process."""
    with _lock:
        return group in _compiled


@contextmanager
def compiled_only() -> Iterator[None]:
    """Within this block (in this thread or task only) ``use`` is true only for compiled groups."""
    token = _only_compiled.set(True)
    try:
        yield
    finally:
        _only_compiled.reset(token)


def use(group: str) -> bool:
    """Whether a caller should take the kernels of ``group`` now: numba is there, and either they are
    compiled or this caller is not inside ``compiled_only()`` (it may wait for a compile)."""
    return AVAILABLE and (not _only_compiled.get() or compiled(group))


def on_disk(*kernels) -> bool:
    """Whether numba's disk cache holds compiled code, fresh for the source as it is now, for every
    one of ``kernels`` (so that a first call loads it rather than compiling): one small index file
    read per kernel. True without numba (nothing to compile); False where numba's cache cannot be
    read this way (the cautious answer)."""
    if not AVAILABLE:
        return True
    try:
        return all(_fresh_on_disk(k.dispatcher if isinstance(k, Kernel) else k) for k in kernels)
    except Exception:  # another numba's internals, an unreadable index: assume a compile
        return False


def _fresh_on_disk(dispatcher) -> bool:
    """Whether ``dispatcher``'s cache index, fresh for its file's stamp, holds an entry for the sources
    as they are now (``_key_by_sources``: one whose key ends with their digest)."""
    index = dispatcher._cache._cache_file._load_index()
    digest = getattr(dispatcher, "kvsim_sources", None)
    return bool(index) if digest is None else any(key[-1][-1] == digest for key in index)

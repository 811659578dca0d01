"""llm_inference: a small, readable inference engine for Llama-family models.

The public names load on first use, so that `import llm_inference.core` (pure Python) and the
command line's start-up do not pay for torch and transformers before they need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_inference.engine.arg_utils import EngineArgs
    from llm_inference.engine.async_llm import AsyncLLM
    from llm_inference.entrypoints.llm import LLM
    from llm_inference.outputs import CompletionOutput, RequestOutput
    from llm_inference.sampling_params import (
        BeamSearchParams,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
           "BeamSearchParams", "RequestOutput", "CompletionOutput"]  # fmt: skip
__version__ = "0.1.0"

_WHERE = {
    "LLM": "llm_inference.entrypoints.llm",
    "AsyncLLM": "llm_inference.engine.async_llm",
    "EngineArgs": "llm_inference.engine.arg_utils",
    "SamplingParams": "llm_inference.sampling_params",
    "StructuredOutputsParams": "llm_inference.sampling_params",
    "BeamSearchParams": "llm_inference.sampling_params",
    "RequestOutput": "llm_inference.outputs",
    "CompletionOutput": "llm_inference.outputs",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'llm_inference' has no attribute {name!r}")

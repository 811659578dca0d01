"""llm_inference: a small, readable inference engine for Llama-family models."""

from llm_inference.entrypoints.llm import LLM
from llm_inference.outputs import CompletionOutput, RequestOutput
from llm_inference.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

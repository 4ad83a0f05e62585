"""nanoserve: a small, fast, readable LLM inference engine with an OpenAI-compatible server."""
from nanoserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSequence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing nanoserve for SamplingParams should not.
    if name == "LLM":
        from nanoserve.llm import LLM
        return LLM
    raise AttributeError(name)

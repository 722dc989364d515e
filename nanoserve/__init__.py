"""nanoserve: a small, fast LLM inference server."""

from nanoserve.beam_search import BeamSearchParams
from nanoserve.inputs import TextPairPrompt, TextPrompt, TokensPrompt
from nanoserve.lora.request import LoRARequest
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it on first use so `nanoserve --help` is fast.
    if name == "LLM":
        # The library's entry point, as cli.main is the CLI's: OpenMP's short spin
        # (envs.set_openmp_spin_default) must be in the environment before torch loads libgomp.
        # Here, not at `import nanoserve`: a client that only builds SamplingParams keeps its
        # environment as it was.
        from nanoserve import envs

        envs.set_openmp_spin_default()
        from nanoserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "TextPrompt",
    "TokensPrompt",
    "TextPairPrompt",
    "__version__",
]

"""nanoserve: a small, fast LLM inference server."""
import os

# OpenMP threads that finish a parallel region spin before they sleep (libgomp: 300,000 spins by
# default). Alone on its CPUs that wins a few percent; sharing them, it turns three servers on
# two cores into 20x slower each instead of ~4x (measured: a 200-token request, 6.7 s alone, 136-142 s
# three at once with the default, 27 s with 10,000 spins, 7.1 s alone). Read when libgomp loads,
# so it takes effect when nanoserve is imported before torch (the CLI, `from nanoserve import
# LLM` first); a value already in the environment wins.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

from nanoserve.inputs import TextPrompt, TokensPrompt
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it on first use so `nanoserve --help` is fast.
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "__version__"]

"""pdserve's LLM engine: a paged-KV Llama-family engine shared by the prefill and decode
roles. `from pdserve.engine import LLM, SamplingParams` for offline use; `Engine` is the
step-driven core and `AsyncEngine` runs it in its own thread for servers.

Owns: the model (Llama family from Hugging Face checkpoints), the paged KV cache (page pool,
prefix cache), the scheduler (continuous batching, chunked prefill, preemption), the
sampler and the detokenizer. Knows no wire format and no NIXL: where a role must act
mid-forward, the engine offers a hook (`AsyncEngine.add_layer_hook`). The plain data
(`SamplingParams`, `EngineConfig`, outputs, `OutOfPages`) imports without torch; the rest
loads torch when first used.
"""

from importlib import import_module

from .config import EngineConfig, SamplingParams
from .outputs import CompletionOutput, RequestOutput, Reservation
from .page_pool import OutOfPages

_LAZY = {"AsyncEngine": ".async_engine", "Engine": ".engine", "UnknownRequest": ".engine",
         "LLM": ".llm"}

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "LLM",
    "OutOfPages",
    "RequestOutput",
    "Reservation",
    "SamplingParams",
    "UnknownRequest",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

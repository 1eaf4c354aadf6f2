"""pdserve's LLM engine: a paged-KV Llama-family engine shared by the prefill and decode
roles. `from engine import LLM, SamplingParams` for offline use; `Engine` is the
step-driven core and `AsyncEngine` runs it in its own thread for servers."""

from .async_engine import AsyncEngine
from .config import EngineConfig, SamplingParams
from .engine import Engine, UnknownRequest
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput, Reservation
from .page_pool import OutOfPages

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

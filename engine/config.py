"""Plain configuration data: how a request wants its tokens (`SamplingParams`) and how an
engine is built (`EngineConfig`).

Both are dataclasses with defaults that work on a laptop. `validate` methods raise
`ValueError` whose message names the field and the offending value, so a server can pass it
straight back as INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")
DEFAULT_KV_CACHE_MEMORY_BYTES = 256 * 1024 * 1024


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None  # sample i of n draws from torch.Generator(seed + i)
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each chosen token; 0: only its own

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        def bad(name, value, why):
            raise ValueError(f"{name} must be {why}, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if max_model_len is not None and self.max_tokens > max_model_len:
            bad("max_tokens", self.max_tokens, f"<= max_model_len ({max_model_len})")
        if not self.temperature >= 0.0:
            bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "-1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", self.seed, "an integer or None")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", self.stop_token_ids, f"token ids in [0, {vocab_size})")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, int) or self.logprobs < 0:
                bad("logprobs", self.logprobs, "None or an integer >= 0")
            if vocab_size is not None and self.logprobs > vocab_size:
                bad("logprobs", self.logprobs, f"<= vocab_size ({vocab_size})")


@dataclass
class EngineConfig:
    model_dir: str
    page_size: int = 16
    num_pages: int | None = None  # None: as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # sequences running at once
    dtype: str = "float32"
    attention_backend: str = "torch"
    enable_prefix_cache: bool = True
    num_threads: int | None = None  # torch.set_num_threads; threads are never pinned
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def validate(self) -> None:
        def bad(name, value, why):
            raise ValueError(f"{name} must be {why}, got {value!r}")

        if not isinstance(self.page_size, int) or self.page_size < 1:
            bad("page_size", self.page_size, "an integer >= 1")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            bad("num_pages", self.num_pages, "None or an integer >= 1")
        if self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "> 0")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", self.max_num_seqs, ">= 1")
        if self.dtype not in DTYPES:
            bad("dtype", self.dtype, f"one of {DTYPES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", self.attention_backend, f"one of {ATTENTION_BACKENDS}")
        if self.num_threads is not None and self.num_threads < 1:
            bad("num_threads", self.num_threads, "None or >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", self.max_model_len, "None or >= 2")

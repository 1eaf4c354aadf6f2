"""Plain configuration data: how an engine is built (`EngineConfig`), and how a request
wants its tokens (`SamplingParams`, whose rules every layer shares: `pdserve.sampling`).

Both are dataclasses with defaults that work on a laptop. `validate` methods raise
`ValueError` whose message names the field and the offending value, so a server can pass it
straight back as INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.sampling import SamplingParams  # noqa: F401  (the engine's request type)

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_LAYOUTS = ("page-major", "layer-major")  # engine/kv_pool.py
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.25


def _flag(default, help: str, **more):
    """A field that is also a command-line flag of every worker (`runtime.options`)."""
    return field(default=default, metadata={"help": help, **more})


@dataclass
class EngineConfig:
    model_dir: str
    page_size: int = _flag(16, "tokens per KV page")
    num_pages: int | None = _flag(None, "KV pages in the pool (default: as many as "
                                        "--kv-cache-mb, else --kv-cache-memory-fraction, holds)",
                                  type=int)
    kv_cache_memory_bytes: int | None = None  # the flag is --kv-cache-mb
    kv_cache_memory_fraction: float = _flag(
        DEFAULT_KV_CACHE_MEMORY_FRACTION, "share of the memory free once the weights are loaded "
        "(the container's limit counts; on a GPU, of its total memory, at most 0.9 of what is "
        "free) that the KV pool takes, unless --num-pages or --kv-cache-mb says otherwise")
    # 2048, as vLLM's server on CPU: under Poisson load a prompt prefilled in one step stalls
    # the running decodes once, not up to three times. `bench serve --compare`, SmolLM2
    # fp32, 512-1536-token prompts: p90 inter-token latency of the 1P1D decode node (which
    # prefills what the saturated prefill node cannot) 1.9 s at 512, 0.3 s at 2048; of a
    # colocated node 1.4 s at 512, 0.2 s at 2048.
    max_num_batched_tokens: int = _flag(2048, "token budget of one engine step (prefill "
                                              "chunks and decodes)")
    max_num_seqs: int = _flag(64, "sequences running at once")
    decode_itl_target_ms: float | None = _flag(
        None, "while decodes run, prompt tokens (chunks) per step are cut so the step stays "
              "within this inter-token latency, by the measured step cost (default: twice the "
              "measured decode step, at least 50 ms; 0: no cut, the whole step budget)", type=float)
    dtype: str = _flag("float32", "weights and KV dtype", choices=DTYPES)
    attention_backend: str = _flag("auto", "attention kernels: torch (CPU), triton (GPU), or auto: "
                                           "triton on a CUDA device, else torch",
                                   choices=ATTENTION_BACKENDS)
    kv_layout: str = _flag("page-major", "memory order of the KV pool: page-major (a run of pages is "
                                         "one NIXL descriptor, for whole-window sends) or layer-major "
                                         "(a run's layer is two, for layer-wise sends: --kv-send layerwise); "
                                         "give both nodes of a pair the same", choices=KV_LAYOUTS)
    enable_prefix_cache: bool = _flag(True, "disable the prefix cache", flag="--no-prefix-cache")
    num_threads: int | None = _flag(None, "torch threads for the engine (default: torch's "
                                          "choice); threads are never pinned", type=int)
    device: str = _flag("cpu", "torch device: cpu, cuda or cuda:N (the KV pool lives there too)")
    cuda_graphs: bool = _flag(True, "replay no CUDA graphs for decode steps (GPU only)",
                              flag="--no-cuda-graphs")
    overlap_output: bool = _flag(True, "detokenize each step's tokens after it, not during the next "
                                       "step's forward (GPU only; streams one step sooner)",
                                 flag="--no-overlap-output")
    tensor_parallel_size: int = _flag(1, "ranks (processes) the model is split over, Megatron-style, "
                                         "each holding its share of the weights and KV heads", type=int)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    lora_modules: list[str] = field(default_factory=list, metadata={
        "help": "LoRA adapters served beside the model, as vLLM's flag: NAME=DIR, a PEFT adapter "
                "directory; a request names the adapter as its model", "nargs": "+",
        "metavar": "NAME=DIR"})

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

    def validate(self) -> None:
        def bad(name, value, why):
            raise ValueError(f"{name} must be {why}, got {value!r}")

        if not isinstance(self.page_size, int) or self.page_size < 1:
            bad("page_size", self.page_size, "an integer >= 1")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 1):
            bad("num_pages", self.num_pages, "None or an integer >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "None or > 0")
        if not 0 < self.kv_cache_memory_fraction < 1:
            bad("kv_cache_memory_fraction", self.kv_cache_memory_fraction, "in (0, 1)")
        if self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        if self.decode_itl_target_ms is not None and self.decode_itl_target_ms < 0:
            bad("decode_itl_target_ms", self.decode_itl_target_ms, "None, 0 (off) or > 0")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", self.max_num_seqs, ">= 1")
        if self.dtype not in DTYPES:
            bad("dtype", self.dtype, f"one of {DTYPES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", self.attention_backend, f"one of {ATTENTION_BACKENDS}")
        if self.kv_layout not in KV_LAYOUTS:
            bad("kv_layout", self.kv_layout, f"one of {KV_LAYOUTS}")
        if self.num_threads is not None and self.num_threads < 1:
            bad("num_threads", self.num_threads, "None or >= 1")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1")
        if self.tensor_parallel_size > 1 and not self.device.startswith("cpu"):
            # The ranks' pools are shared host memory that rank 0's agent registers; GPU pools
            # would need one agent per rank (or CUDA IPC), which is not built yet.
            bad("tensor_parallel_size", self.tensor_parallel_size,
                f"1 on device {self.device!r}: tensor parallelism runs on the CPU only so far")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", self.max_model_len, "None or >= 2")
        if self.lora_modules:
            from .lora import parse_modules, read_config  # its settings, before any weight loads

            for name, path in parse_modules(self.lora_modules):
                read_config(name, path)

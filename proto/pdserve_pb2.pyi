from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "structured_output", "min_tokens", "bad_words", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    min_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "token", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token: str
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("prefill_endpoint", "decode_endpoint", "prefix_matched_length", "kv_window_begin", "kv_window_end", "remote_send_skipped", "prefill_cached_tokens", "skip_reason")
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MATCHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SEND_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_REASON_FIELD_NUMBER: _ClassVar[int]
    prefill_endpoint: str
    decode_endpoint: str
    prefix_matched_length: int
    kv_window_begin: int
    kv_window_end: int
    remote_send_skipped: bool
    prefill_cached_tokens: int
    skip_reason: str
    def __init__(self, prefill_endpoint: _Optional[str] = ..., decode_endpoint: _Optional[str] = ..., prefix_matched_length: _Optional[int] = ..., kv_window_begin: _Optional[int] = ..., kv_window_end: _Optional[int] = ..., remote_send_skipped: _Optional[bool] = ..., prefill_cached_tokens: _Optional[int] = ..., skip_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "time_to_first_token_s", "cached_prompt_tokens", "route", "queue_time_s", "time_per_output_token_s", "time_per_output_token_p90_s", "prefill_time_s", "kv_transfer_time_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_P90_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    time_to_first_token_s: float
    cached_prompt_tokens: int
    route: RouteInfo
    queue_time_s: float
    time_per_output_token_s: float
    time_per_output_token_p90_s: float
    prefill_time_s: float
    kv_transfer_time_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ..., queue_time_s: _Optional[float] = ..., time_per_output_token_s: _Optional[float] = ..., time_per_output_token_p90_s: _Optional[float] = ..., prefill_time_s: _Optional[float] = ..., kv_transfer_time_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "text", "token_ids", "finish_reason", "logprobs", "usage", "prompt_logprobs", "tool_calls", "stop_string", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    stop_string: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "kv_write_settled", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WRITE_SETTLED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_write_settled: bool
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., kv_write_settled: _Optional[bool] = ..., lease_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "messages", "sampling", "kv_window_end", "cache_salt", "priority", "tools", "tool_choice", "parallel_tool_calls", "prompt_cache_key", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    kv_window_end: int
    cache_salt: str
    priority: int
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    parallel_tool_calls: bool
    prompt_cache_key: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_window_end: _Optional[int] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., prompt_cache_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "eos_token_ids", "role", "lora_names")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    role: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., role: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareReceiveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_window_end", "lease_ms", "local_prefill", "writer_address", "cache_salt", "priority", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    WRITER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_window_end: int
    lease_ms: int
    local_prefill: bool
    writer_address: str
    cache_salt: str
    priority: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_window_end: _Optional[int] = ..., lease_ms: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., writer_address: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class PrepareReceiveResponse(_message.Message):
    __slots__ = ("request_id", "prefix_matched_length", "kv_window_end", "kv_append_metadata", "lease_id", "lease_ms", "decode_agent_name", "lease_expires_unix_ms", "capability", "issued_unix_ms", "queued_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MATCHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix_matched_length: int
    kv_window_end: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    lease_ms: int
    decode_agent_name: str
    lease_expires_unix_ms: int
    capability: bytes
    issued_unix_ms: int
    queued_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prefix_matched_length: _Optional[int] = ..., kv_window_end: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., decode_agent_name: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., capability: _Optional[bytes] = ..., issued_unix_ms: _Optional[int] = ..., queued_ms: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "num_layers", "num_kv_heads", "head_dim", "page_size", "num_slots", "base_addr", "layer_stride", "kv_stride", "slot_stride", "device", "page_stride")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int
    base_addr: int
    layer_stride: int
    kv_stride: int
    slot_stride: int
    device: str
    page_stride: int
    def __init__(self, dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., base_addr: _Optional[int] = ..., layer_stride: _Optional[int] = ..., kv_stride: _Optional[int] = ..., slot_stride: _Optional[int] = ..., device: _Optional[str] = ..., page_stride: _Optional[int] = ...) -> None: ...

class KVShard(_message.Message):
    __slots__ = ("layout", "head_begin", "rank")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HEAD_BEGIN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    head_begin: int
    rank: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., head_begin: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class TransferInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layout", "role", "model", "model_hash", "host_id", "shards", "total_kv_heads")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    role: str
    model: str
    model_hash: str
    host_id: str
    shards: _containers.RepeatedCompositeFieldContainer[KVShard]
    total_kv_heads: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., model_hash: _Optional[str] = ..., host_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[KVShard, _Mapping]]] = ..., total_kv_heads: _Optional[int] = ...) -> None: ...

class RemoteSendRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "kv_window_begin", "kv_window_end", "kv_append_metadata", "lease_id", "decode_agent_name", "decode_address", "decode_transfer_info", "lease_expires_unix_ms", "window_follows", "lease_remaining_ms", "capability", "lease_ms", "issued_unix_ms", "cache_salt", "priority", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_END_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_window_begin: int
    kv_window_end: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    decode_agent_name: str
    decode_address: str
    decode_transfer_info: TransferInfo
    lease_expires_unix_ms: int
    window_follows: bool
    lease_remaining_ms: int
    capability: bytes
    lease_ms: int
    issued_unix_ms: int
    cache_salt: str
    priority: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., kv_window_begin: _Optional[int] = ..., kv_window_end: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., decode_agent_name: _Optional[str] = ..., decode_address: _Optional[str] = ..., decode_transfer_info: _Optional[_Union[TransferInfo, _Mapping]] = ..., lease_expires_unix_ms: _Optional[int] = ..., window_follows: _Optional[bool] = ..., lease_remaining_ms: _Optional[int] = ..., capability: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., issued_unix_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class RemoteSendWindow(_message.Message):
    __slots__ = ("request_id", "kv_window_begin", "kv_append_metadata", "lease_id", "decode_agent_name", "decode_address", "lease_expires_unix_ms", "lease_remaining_ms", "capability", "lease_ms", "issued_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    KV_APPEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_window_begin: int
    kv_append_metadata: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    decode_agent_name: str
    decode_address: str
    lease_expires_unix_ms: int
    lease_remaining_ms: int
    capability: bytes
    lease_ms: int
    issued_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., kv_window_begin: _Optional[int] = ..., kv_append_metadata: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., decode_agent_name: _Optional[str] = ..., decode_address: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ..., capability: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., issued_unix_ms: _Optional[int] = ...) -> None: ...

class DeliverWindowResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RemoteSendResponse(_message.Message):
    __slots__ = ("request_id", "num_tokens_sent", "num_bytes", "num_descriptors", "prefill_cached_tokens", "prefill_s", "transfer_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens_sent: int
    num_bytes: int
    num_descriptors: int
    prefill_cached_tokens: int
    prefill_s: float
    transfer_s: float
    def __init__(self, request_id: _Optional[str] = ..., num_tokens_sent: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_descriptors: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class StartGenerationRequest(_message.Message):
    __slots__ = ("request_id", "kv_window_begin", "lease_id", "expect_kv_notification", "prepare")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECT_KV_NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_window_begin: int
    lease_id: str
    expect_kv_notification: bool
    prepare: PrepareReceiveRequest
    def __init__(self, request_id: _Optional[str] = ..., kv_window_begin: _Optional[int] = ..., lease_id: _Optional[str] = ..., expect_kv_notification: _Optional[bool] = ..., prepare: _Optional[_Union[PrepareReceiveRequest, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("role", "num_running", "num_parked", "free_pages", "total_pages", "requests_total", "prefix_hit_tokens_total", "remote_sends_total", "last_kv_window_begin", "leases_expired_total", "kv_bytes_sent_total", "num_quarantined", "late_writes_total", "fenced_writers", "fenced_pages", "identity", "max_lease_ms", "num_decoding", "prompt_backlog_tokens", "decode_step_ms", "prompt_token_ms", "itl_target_ms")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SENDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_KV_WINDOW_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    LATE_WRITES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FENCED_WRITERS_FIELD_NUMBER: _ClassVar[int]
    FENCED_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BACKLOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_parked: int
    free_pages: int
    total_pages: int
    requests_total: int
    prefix_hit_tokens_total: int
    remote_sends_total: int
    last_kv_window_begin: int
    leases_expired_total: int
    kv_bytes_sent_total: int
    num_quarantined: int
    late_writes_total: int
    fenced_writers: _containers.RepeatedScalarFieldContainer[str]
    fenced_pages: int
    identity: TransferInfo
    max_lease_ms: int
    num_decoding: int
    prompt_backlog_tokens: int
    decode_step_ms: float
    prompt_token_ms: float
    itl_target_ms: float
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_parked: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., requests_total: _Optional[int] = ..., prefix_hit_tokens_total: _Optional[int] = ..., remote_sends_total: _Optional[int] = ..., last_kv_window_begin: _Optional[int] = ..., leases_expired_total: _Optional[int] = ..., kv_bytes_sent_total: _Optional[int] = ..., num_quarantined: _Optional[int] = ..., late_writes_total: _Optional[int] = ..., fenced_writers: _Optional[_Iterable[str]] = ..., fenced_pages: _Optional[int] = ..., identity: _Optional[_Union[TransferInfo, _Mapping]] = ..., max_lease_ms: _Optional[int] = ..., num_decoding: _Optional[int] = ..., prompt_backlog_tokens: _Optional[int] = ..., decode_step_ms: _Optional[float] = ..., prompt_token_ms: _Optional[float] = ..., itl_target_ms: _Optional[float] = ...) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class FenceResponse(_message.Message):
    __slots__ = ("agent_name", "was_sending", "wrote")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    WAS_SENDING_FIELD_NUMBER: _ClassVar[int]
    WROTE_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    was_sending: bool
    wrote: bool
    def __init__(self, agent_name: _Optional[str] = ..., was_sending: _Optional[bool] = ..., wrote: _Optional[bool] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatOptions(_message.Message):
    __slots__ = ("tools_json", "tool_choice_json", "single_tool_call", "chat_template", "chat_template_kwargs_json")
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_JSON_FIELD_NUMBER: _ClassVar[int]
    SINGLE_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    tools_json: str
    tool_choice_json: str
    single_tool_call: bool
    chat_template: str
    chat_template_kwargs_json: str
    def __init__(self, tools_json: _Optional[str] = ..., tool_choice_json: _Optional[str] = ..., single_tool_call: _Optional[bool] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "allowed_token_ids", "top_logprobs", "include_stop_str_in_output", "keep_special_tokens", "bad_words", "structured", "n", "prompt_logprobs", "speculate")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    include_stop_str_in_output: bool
    keep_special_tokens: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    structured: StructuredOutput
    n: int
    prompt_logprobs: int
    speculate: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., keep_special_tokens: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., speculate: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "token_ids", "messages", "sampling", "request_id", "timeout_ms", "chat")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    request_id: str
    timeout_ms: int
    chat: ChatOptions
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., chat: _Optional[_Union[ChatOptions, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "times_ms", "top_logprobs", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMES_MS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    times_ms: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., times_ms: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprob(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: TopLogprobs
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "draft_tokens", "accepted_draft_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "transfer_ms", "e2e_ms", "prefill_ms", "decode_ms", "kv_pull_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    transfer_ms: float
    e2e_ms: float
    prefill_ms: float
    decode_ms: float
    kv_pull_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., kv_pull_ms: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "timing", "prefill_worker", "decode_worker", "index", "tool_calls")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    prefill_worker: str
    decode_worker: str
    index: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., index: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: Token
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: ChatMessages
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "vocab_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    vocab_size: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "by", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    by: str
    timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., by: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("moved", "left")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    moved: int
    left: int
    def __init__(self, moved: _Optional[int] = ..., left: _Optional[int] = ...) -> None: ...

class UpgradeRequest(_message.Message):
    __slots__ = ("config_yaml", "model", "pace")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PACE_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    model: str
    pace: int
    def __init__(self, config_yaml: _Optional[str] = ..., model: _Optional[str] = ..., pace: _Optional[int] = ...) -> None: ...

class UpgradeResponse(_message.Message):
    __slots__ = ("started", "removed", "revisions")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    revisions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, started: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., revisions: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ("traces",)
    TRACES_FIELD_NUMBER: _ClassVar[int]
    traces: int
    def __init__(self, traces: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "alive", "running", "waiting", "queued_prompt_tokens", "kv_blocks_total", "kv_blocks_used", "kv_exports_held", "error", "state", "waiting_for_blocks", "pulling", "router_active", "prefill_tokens_per_s", "prefix_blocks", "node_id", "node_type", "waiting_for_node", "preemptions", "kv_cache_tokens", "max_model_len", "max_concurrency", "kv_bytes_per_token", "expert_tokens", "expert_window_s", "expert_ranks", "prefix_reuse", "restarts", "sequence_errors", "revision", "speculation", "lora_adapters")
    class SequenceErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoraAdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_EXPORTS_HELD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLING_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_NODE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    alive: bool
    running: int
    waiting: int
    queued_prompt_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_exports_held: int
    error: str
    state: str
    waiting_for_blocks: int
    pulling: int
    router_active: int
    prefill_tokens_per_s: float
    prefix_blocks: int
    node_id: str
    node_type: str
    waiting_for_node: bool
    preemptions: int
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency: float
    kv_bytes_per_token: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    expert_window_s: float
    expert_ranks: int
    prefix_reuse: PrefixReuse
    restarts: int
    sequence_errors: _containers.ScalarMap[str, int]
    revision: str
    speculation: Speculation
    lora_adapters: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., alive: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_exports_held: _Optional[int] = ..., error: _Optional[str] = ..., state: _Optional[str] = ..., waiting_for_blocks: _Optional[int] = ..., pulling: _Optional[int] = ..., router_active: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefix_blocks: _Optional[int] = ..., node_id: _Optional[str] = ..., node_type: _Optional[str] = ..., waiting_for_node: _Optional[bool] = ..., preemptions: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_concurrency: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., expert_window_s: _Optional[float] = ..., expert_ranks: _Optional[int] = ..., prefix_reuse: _Optional[_Union[PrefixReuse, _Mapping]] = ..., restarts: _Optional[int] = ..., sequence_errors: _Optional[_Mapping[str, int]] = ..., revision: _Optional[str] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., lora_adapters: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("method", "draft_tokens", "accepted_tokens", "drafts")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    method: str
    draft_tokens: int
    accepted_tokens: int
    drafts: int
    def __init__(self, method: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., drafts: _Optional[int] = ...) -> None: ...

class PrefixReuse(_message.Message):
    __slots__ = ("device_tokens", "host_tokens", "import_held_tokens", "import_moved_tokens", "host_capacity_blocks", "host_held_blocks", "host_saved_blocks", "host_reloaded_blocks", "host_dropped_blocks", "host_corrupt_blocks", "pulled_tokens", "lent_tokens", "pulls", "pull_failures")
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMPORT_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMPORT_MOVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_RELOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    device_tokens: int
    host_tokens: int
    import_held_tokens: int
    import_moved_tokens: int
    host_capacity_blocks: int
    host_held_blocks: int
    host_saved_blocks: int
    host_reloaded_blocks: int
    host_dropped_blocks: int
    host_corrupt_blocks: int
    pulled_tokens: int
    lent_tokens: int
    pulls: int
    pull_failures: int
    def __init__(self, device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., import_held_tokens: _Optional[int] = ..., import_moved_tokens: _Optional[int] = ..., host_capacity_blocks: _Optional[int] = ..., host_held_blocks: _Optional[int] = ..., host_saved_blocks: _Optional[int] = ..., host_reloaded_blocks: _Optional[int] = ..., host_dropped_blocks: _Optional[int] = ..., host_corrupt_blocks: _Optional[int] = ..., pulled_tokens: _Optional[int] = ..., lent_tokens: _Optional[int] = ..., pulls: _Optional[int] = ..., pull_failures: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("role", "replicas", "workers")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("mode", "model", "pools", "inflight_requests", "placements", "handover_ms", "given_up", "traces", "transfer_failures", "routers", "answered_by")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_MS_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    model: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    inflight_requests: int
    placements: _containers.RepeatedCompositeFieldContainer[PlacementCount]
    handover_ms: float
    given_up: _containers.RepeatedCompositeFieldContainer[GivenUpWorker]
    traces: _containers.RepeatedCompositeFieldContainer[RequestTrace]
    transfer_failures: _containers.RepeatedCompositeFieldContainer[TransferFailureCount]
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    answered_by: int
    def __init__(self, mode: _Optional[str] = ..., model: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., inflight_requests: _Optional[int] = ..., placements: _Optional[_Iterable[_Union[PlacementCount, _Mapping]]] = ..., handover_ms: _Optional[float] = ..., given_up: _Optional[_Iterable[_Union[GivenUpWorker, _Mapping]]] = ..., traces: _Optional[_Iterable[_Union[RequestTrace, _Mapping]]] = ..., transfer_failures: _Optional[_Iterable[_Union[TransferFailureCount, _Mapping]]] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., answered_by: _Optional[int] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("index", "node_id", "address", "http_address", "alive", "inflight_requests", "admitted", "max_inflight_requests")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    node_id: str
    address: str
    http_address: str
    alive: bool
    inflight_requests: int
    admitted: int
    max_inflight_requests: int
    def __init__(self, index: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., alive: _Optional[bool] = ..., inflight_requests: _Optional[int] = ..., admitted: _Optional[int] = ..., max_inflight_requests: _Optional[int] = ...) -> None: ...

class RequestTrace(_message.Message):
    __slots__ = ("request_id", "outcome", "prompt_tokens", "cached_prompt_tokens", "output_tokens", "prefill_worker", "decode_worker", "kv_bytes", "kv_pull_ms", "spans", "marks", "prefix_pulled_tokens", "prefix_pulled_from", "prefill_revision", "decode_revision")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULLED_FROM_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DECODE_REVISION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: str
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    prefill_worker: str
    decode_worker: str
    kv_bytes: int
    kv_pull_ms: float
    spans: _containers.RepeatedCompositeFieldContainer[TraceSpan]
    marks: _containers.RepeatedCompositeFieldContainer[TraceMark]
    prefix_pulled_tokens: int
    prefix_pulled_from: str
    prefill_revision: str
    decode_revision: str
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., kv_pull_ms: _Optional[float] = ..., spans: _Optional[_Iterable[_Union[TraceSpan, _Mapping]]] = ..., marks: _Optional[_Iterable[_Union[TraceMark, _Mapping]]] = ..., prefix_pulled_tokens: _Optional[int] = ..., prefix_pulled_from: _Optional[str] = ..., prefill_revision: _Optional[str] = ..., decode_revision: _Optional[str] = ...) -> None: ...

class TraceSpan(_message.Message):
    __slots__ = ("name", "start", "duration_ms", "worker")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: float
    duration_ms: float
    worker: str
    def __init__(self, name: _Optional[str] = ..., start: _Optional[float] = ..., duration_ms: _Optional[float] = ..., worker: _Optional[str] = ...) -> None: ...

class TraceMark(_message.Message):
    __slots__ = ("name", "at", "worker", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    at: float
    worker: str
    detail: str
    def __init__(self, name: _Optional[str] = ..., at: _Optional[float] = ..., worker: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class GivenUpWorker(_message.Message):
    __slots__ = ("worker_id", "role", "reason", "at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    reason: str
    at: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., reason: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class TransferFailureCount(_message.Message):
    __slots__ = ("error", "action", "count")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    error: str
    action: str
    count: int
    def __init__(self, error: _Optional[str] = ..., action: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PlacementCount(_message.Message):
    __slots__ = ("placement", "reason", "count")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    placement: str
    reason: str
    count: int
    def __init__(self, placement: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

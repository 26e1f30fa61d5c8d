"""Engine configuration: one validated dataclass, shared by every process role.

Plain data (a router unpickles worker specs without torch); what ``device`` and
``dtype`` resolve to on a machine is ``engine.device``'s business."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "fp8", "int8")
SPECULATIVE_METHODS = ("ngram", "draft", "self", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``engine.speculative``): a proposer suggests up to
    ``num_tokens`` next tokens of a decoding sequence, the target model checks them in
    one step. ``method``:

    - ``ngram``: prompt lookup, the tokens that followed the latest earlier occurrence
      of the sequence's last ``ngram_min``..``ngram_max`` tokens (no model);
    - ``draft``: a smaller model with the target's vocabulary (``draft_model``: a path
      or name as ``EngineConfig.model`` takes) decodes greedily on its own paged KV;
    - ``self``: the target's own first ``draft_layers`` layers, its final norm and LM
      head (no extra weights; their KV cache is the draft's own);
    - ``mtp``: the checkpoint's multi-token prediction layer (DeepSeek-V3, GLM-4.5), which
      predicts the token after next from the target's last hidden state: one token
      per step whatever ``num_tokens`` allows (``engine.speculative.mtp``).

    Each request's number of proposed tokens adapts to its own acceptance and the
    measured price of a draft token (``engine.speculative.adaptive``); with
    ``adaptive`` off every step proposes ``num_tokens`` (a fixed k, as vLLM's: to
    measure a proposer, or to force one the price rule would not run). Invalid values
    raise ``ValueError``."""

    method: str = "ngram"
    num_tokens: int = 4  # the most tokens proposed per sequence and step
    ngram_min: int = 1
    ngram_max: int = 3
    draft_model: str | None = None  # method draft
    draft_layers: int = 0  # method self: the target's layers the draft runs (1 .. layers - 1)
    adaptive: bool = True  # False: num_tokens every step, whatever the acceptance and price

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative num_tokens must be in 1..16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "speculative n-grams need 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min}..{self.ngram_max}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method draft needs draft_model (the draft's path or name)")
        if self.method == "self" and self.draft_layers < 1:
            raise ValueError(
                "speculative method self needs draft_layers >= 1 (the target's first layers), "
                f"got {self.draft_layers}"
            )


@dataclass
class EngineConfig:
    """How to build and run one engine. Invalid values raise ``ValueError`` at construction.

    ``model`` is ``"smollm2"`` (the bundled SmolLM2-135M-Instruct GGUF), a ``.gguf``
    file or a Hugging Face model directory. With ``random_weights`` only the
    config is read and weights are drawn from ``seed``.
    """

    model: str = "smollm2"
    tokenizer: str | None = None  # directory; default: the model's own
    random_weights: bool = False
    dtype: str = "auto"  # auto: bfloat16 where the hardware has it natively, else float32
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: as many as the KV budget holds (engine.kv_sizing)
    kv_cache_memory_mib: int | None = None  # the KV budget; default: CUDA a fraction, CPU 1024 MiB
    kv_cache_memory_fraction: float = 0.9  # CUDA, no kv_cache_memory_mib: of free memory after weights
    kv_cache_dtype: str = "auto"  # auto: the model's dtype | fp8: e4m3 with scales (engine.kv_quant)
    max_num_batched_tokens: int = 512  # token budget per step; longer prompts are chunked
    max_num_seqs: int = 256  # running sequences at most
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # host memory (MiB) for prefix blocks evicted from the KV cache (engine.kv_tier); 0: none
    host_kv_tier_mib: int = 0
    # a model with both sliding-window and full layers: its cache in layer groups, the
    # sliding layers holding their window only (``KVLayout.grouped``); false: every layer
    # the whole sequence (what a host KV tier and self speculation need). Part of the KV
    # layout, so every worker of a cluster takes the same (the model section's)
    kv_layer_groups: bool = True
    attention_backend: str = "auto"  # auto (CUDA: flash_attn if installed, else triton) | sdpa | cpu | ...
    native_kernels: bool = True  # splitserve's kernels: C++ on CPU, Triton on CUDA (else pure torch)
    quantization: str = "none"  # none | fp8 (W8A8, prefill) | int8 (weight-only, decode)
    tp_size: int = 1  # tensor-parallel ranks; each rank's process builds an Engine with its TPGroup
    # expert-parallel ranks (MoE models): experts split over them, attention data-parallel
    # (each rank a whole attention replica with its own share of the KV cache); needs tp_size 1
    ep_size: int = 1
    cuda_graphs: bool | None = None  # replay decode steps from CUDA graphs; None: where they can be
    # captured (CUDA, triton attention, TP=1, no MLA; MoE layers only with True); True requires that
    seed: int = 0  # random weights and unseeded sampling
    generation_config: bool = True  # the model's generation_config.json sets defaults of unset fields
    # speculative decoding of this engine's decodes (a dict of SpeculativeConfig's fields is
    # taken); None: none
    speculative: SpeculativeConfig | None = None
    # run the checkpoint's multi-token prediction layer every step, so that its KV is
    # there for an MTP proposer: here (speculative method mtp implies it) or on the
    # engine a prefill hands its KV to (``engine.model.mtp``; the layer is a layer of
    # the KV cache, so both ends must agree)
    mtp_layer: bool = False
    # multi-LoRA (engine.lora): PEFT adapters by name (a request picks one:
    # SamplingParams.adapter), served from the start, each of rank at most max_lora_rank;
    # max_loras slots hold the adapters of one step (None: one per adapter named here),
    # max_cpu_loras host copies those read lately (None: max_loras, as vLLM's)
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_memory_mib is not None and self.kv_cache_memory_mib < 1:
            raise ValueError(f"kv_cache_memory_mib must be >= 1, got {self.kv_cache_memory_mib}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError(
                "ep_size > 1 runs attention data-parallel (every rank holds whole attention layers); "
                f"tp_size must be 1 with it, got {self.tp_size}"
            )
        if self.host_kv_tier_mib < 0:
            raise ValueError(f"host_kv_tier_mib must be >= 0, got {self.host_kv_tier_mib}")
        if self.host_kv_tier_mib and (self.group_size > 1 or not self.enable_prefix_caching):
            raise ValueError(
                "host_kv_tier_mib needs prefix caching on a single-rank worker (tp_size and ep_size 1): "
                "a tier per rank of a group is not built yet"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self._check_lora()
        if self.runs_mtp and self.group_size > 1:
            raise ValueError(
                "the multi-token prediction layer (speculative method mtp, mtp_layer) runs on engines "
                f"without tensor or expert parallelism; tp_size x ep_size is {self.group_size}"
            )

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if not self.enable_lora:
            return
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.num_lora_slots:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.num_lora_slots})"
            )
        why = (
            "expert parallelism"
            if self.ep_size > 1
            else "weight quantization"
            if self.quantization != "none"
            else None
        )
        if why is not None:
            raise ValueError(f"LoRA adapters (enable_lora) do not run with {why} yet")

    @property
    def num_lora_slots(self) -> int:
        """The adapters an engine holds at once: ``max_loras``, or one per adapter."""
        return self.max_loras if self.max_loras is not None else max(1, len(self.lora_modules))

    @property
    def runs_mtp(self) -> bool:
        """Whether the engine runs the checkpoint's MTP layer (``mtp_layer``)."""
        return self.mtp_layer or (self.speculative is not None and self.speculative.method == "mtp")

    @property
    def group_size(self) -> int:
        """The ranks (processes) one engine runs on: ``tp_size`` x ``ep_size``."""
        return self.tp_size * self.ep_size

"""How the engine runs a model: batch limits, cache budget, device, placements. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsinfer.config.model import ConfigError
from dsinfer.config.speculative import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from dsinfer.config.model import ModelConfig

ENGRAM_PLACEMENTS = ("device", "host", "sharded")
"""Where V4.1's Engram tables can live (``dsinfer.engram.fetch`` implements each)."""
V41_PREFILL_MODES = ("bounded", "exact")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
"""How the caches that have both forms store their rows (vLLM's ``--kv-cache-dtype``): ``auto`` the model's default
(V4: bf16, V4.1: FP8 / FP4 codes where its trained-in rounding is on), ``bf16`` the model dtype, ``fp8`` codes."""


def check_expert_offload(value: object, field: str) -> None:
    """None, ``auto`` or a GiB budget >= 0; anything else is one error naming ``field``."""
    budget = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if value is not None and value != "auto" and not budget:
        raise ConfigError(f"{field}: expected 'auto' or a GiB budget >= 0, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: batch limits, cache budget, device. Validated on construction."""

    max_num_seqs: int = 16
    # Tokens per step across all sequences (the chunked-prefill budget); None: 8192 on CUDA (vLLM's choice for
    # large GPUs: a long prompt's prefill in a few steps, each near full GPU occupancy), 512 on the CPU.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 16384)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_tokens: int | None = None  # None: the lcm of the compression ratios (128 for V4-Flash)
    cache_memory_bytes: int | None = None  # cache budget; None: 512 MiB on CPU, gpu_memory_utilization on CUDA
    num_cache_blocks: int | None = None  # exact number of compressed-cache blocks (overrides the byte budget)
    # Cache storage (vLLM's spelling, KV_CACHE_DTYPES): 'fp8' keeps V4's indexer keys as the release does (e4m3
    # codes, a ue8m0 scale per 128 channels: half of bf16, so more blocks fit) and V4.1's rows as FP8 / FP4 codes;
    # 'bf16' keeps both in the model dtype; 'auto' each model's default (V4 bf16, V4.1 codes under its rounding).
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    dtype: str = "float32"
    device: str = "cpu"
    # Schedule step N+1 while the device runs step N (dsinfer.engine.engine); None: on for CUDA, off on CPU,
    # where the forward itself runs on the host cores that the scheduler would compete for.
    async_scheduling: bool | None = None
    # Where V4.1's Engram tables live: 'device', 'host' (one shared-memory copy per host, read over PCIe) or
    # 'sharded' (split over the process group's ranks); None: $DSINFER_ENGRAM_PLACEMENT, else 'host' when they
    # exceed the GPU's budget, else 'device' (dsinfer.engram.placement). Ignored by models without Engram (V4).
    engram_placement: str | None = None
    # Decode steps of V4 models replay CUDA graphs captured per batch size (vLLM's spelling). enforce_eager turns
    # them off; cuda_graph_sizes are the buckets (None: powers of two up to max_num_seqs). On the CPU, giving
    # sizes runs the same static-shape decode eagerly (for tests); nothing is captured there.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Compile every prefill kernel shape a served prompt can reach at start-up (dsinfer.engine.warmup), so the
    # first long prompt runs as fast as the second; None: on for CUDA, off on the CPU (no kernels compile there).
    kernel_warmup: bool | None = None
    # Speculative decoding (vLLM's spelling): a SpeculativeConfig, its dict or its JSON; None: off.
    speculative_config: SpeculativeConfig | None = None
    # How V4.1 prompts prefill (dsinfer.models.ced): 'bounded' runs the decoder layers over only the last
    # v41_replay_tokens of each prompt (DeepInfer's CED default), 'exact' runs every layer over every token;
    # None: 'bounded' where the checkpoint has a CED decoder and no speculative decoding is on, else 'exact'.
    v41_prefill: str | None = None
    v41_replay_tokens: int = 140
    # Routed experts beyond the GPU's room kept in host memory (dsinfer.offload): None (off), 'auto', or a GPU
    # budget for routed experts in GiB; expert_stats: a JSON file of per-layer routing counts that chooses the
    # resident experts, read at start and written as traffic is served (None: an even split, not kept).
    expert_offload: str | float | None = None
    expert_stats: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"engine option {name!r}: expected a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"engine option 'max_model_len': expected an integer >= 2, got {self.max_model_len!r}")
        if self.num_cache_blocks is not None and self.num_cache_blocks <= 0:
            raise ConfigError(f"engine option 'num_cache_blocks': must be positive, got {self.num_cache_blocks}")
        if self.cache_memory_bytes is not None and self.cache_memory_bytes <= 0:
            raise ConfigError(f"engine option 'cache_memory_bytes': must be positive, got {self.cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"engine option 'gpu_memory_utilization': must lie in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"engine option 'kv_cache_dtype' (--kv-cache-dtype): expected one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.engram_placement is not None and self.engram_placement not in ENGRAM_PLACEMENTS:
            raise ConfigError(
                f"engine option 'engram_placement': expected one of {', '.join(ENGRAM_PLACEMENTS)} (or None), "
                f"got {self.engram_placement!r}"
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(
                f"engine option 'async_scheduling': expected true, false or null, got {self.async_scheduling!r}"
            )
        if self.kernel_warmup is not None and not isinstance(self.kernel_warmup, bool):
            raise ConfigError(
                f"engine option 'kernel_warmup': expected true, false or null, got {self.kernel_warmup!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"engine option 'enforce_eager': expected true or false, got {self.enforce_eager!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if isinstance(sizes, (str, bytes)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes
            ) or not sizes:  # fmt: skip
                raise ConfigError(
                    f"engine option 'cuda_graph_sizes': expected positive batch sizes, got {self.cuda_graph_sizes!r}"
                )
            object.__setattr__(self, "cuda_graph_sizes", tuple(sizes))
        if self.v41_prefill is not None and self.v41_prefill not in V41_PREFILL_MODES:
            raise ConfigError(
                f"engine option 'v41_prefill': expected one of {', '.join(V41_PREFILL_MODES)} (or None), "
                f"got {self.v41_prefill!r}"
            )
        replay = self.v41_replay_tokens
        if not isinstance(replay, int) or isinstance(replay, bool) or replay <= 0:
            raise ConfigError(f"engine option 'v41_replay_tokens': expected a positive integer, got {replay!r}")
        check_expert_offload(self.expert_offload, "engine option 'expert_offload'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"engine option 'dtype': expected 'float32' or 'bfloat16', got {self.dtype!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.step_token_budget < self.max_model_len:
                raise ConfigError(
                    "engine option 'max_num_batched_tokens': without chunked prefill it must be at least "
                    f"max_model_len ({self.max_model_len}), got {self.step_token_budget}"
                )

    @property
    def step_token_budget(self) -> int:
        """``max_num_batched_tokens`` as configured, else 8192 on a CUDA device and 512 on the CPU."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if self.device.startswith("cuda") else 512

    @property
    def resolved_async_scheduling(self) -> bool:
        """Overlap scheduling as configured, else on for a CUDA device and off on CPU.

        Speculative decoding runs without overlap: how far a sequence got is known only once its drafts are
        verified, so the next step cannot be planned before the current one ends."""
        if self.speculative_config is not None:
            return False
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda")

    @property
    def resolved_kernel_warmup(self) -> bool:
        """The start-up warm-up as configured, else on for a CUDA device."""
        return self.device.startswith("cuda") if self.kernel_warmup is None else self.kernel_warmup

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(model.max_position_embeddings, 16384)
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"engine option 'max_model_len': {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({model.max_position_embeddings})"
            )
        return self.max_model_len

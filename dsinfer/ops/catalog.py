"""Imports every op's modules so their backends register (the list of ops lives here, nowhere else)."""

# Each import registers the op's reference and any faster backends beside it.
import dsinfer.ops.argmax  # noqa: F401  greedy_argmax: reference, triton (CUDA)
import dsinfer.ops.cache_codec  # noqa: F401  cache_encode, cache_decode, cache_store: reference, triton (CUDA)
import dsinfer.ops.coded_attention  # noqa: F401  sparse_attention_decode_coded: reference, triton (CUDA)
import dsinfer.ops.compressor  # noqa: F401  compressor_pool; compressor_decode(_store), decode_entry_location: triton
import dsinfer.ops.engram_gate  # noqa: F401  engram_gate: reference, triton (CUDA)
import dsinfer.ops.engram_gather  # noqa: F401  engram_gather: reference, triton (CUDA)
import dsinfer.ops.engram_rows  # noqa: F401  engram_decode_rows: reference, triton (CUDA)
import dsinfer.ops.expert_fetch  # noqa: F401  copy_expert_rows: reference, triton (CUDA: reads pinned host memory)
import dsinfer.ops.fake_quant  # noqa: F401  fake_quant_fp8, fake_quant_fp4: reference, triton (CUDA)
import dsinfer.ops.fetch_list  # noqa: F401  offload_fetch_list: reference, triton (CUDA: one program a layer)
import dsinfer.ops.fp8_linear  # noqa: F401
import dsinfer.ops.index_scores  # noqa: F401  index_scores, index_topk: reference, triton (CUDA)
import dsinfer.ops.index_scores_paged  # noqa: F401  index_scores_paged: reference, triton (CUDA)
import dsinfer.ops.index_select  # noqa: F401  index_topk_decode, candidate_block_mask: reference, triton (CUDA)
import dsinfer.ops.indexer  # noqa: F401  indexer_topk_decode: reference, triton
import dsinfer.ops.mhc  # noqa: F401  hc_collapse, hc_expand, hc_mixes, hc_weights, hc_site_input: reference, triton
import dsinfer.ops.moe  # noqa: F401  routed_moe: reference, triton, grouped_mm
import dsinfer.ops.norm_rope  # noqa: F401  rms_norm, rms_normalize, rope, rms_normalize_rope: reference, triton (CUDA)
import dsinfer.ops.rope_angles  # noqa: F401  rope_angles: reference, triton (CUDA)
import dsinfer.ops.rope_round  # noqa: F401  rope_and_round, rope_round_store: reference, triton (CUDA)
import dsinfer.ops.router  # noqa: F401  moe_route: reference, triton
import dsinfer.ops.router_logits  # noqa: F401  router_logits: reference, bf16_parts (CUDA)
import dsinfer.ops.sinkhorn  # noqa: F401
import dsinfer.ops.sparse_attention  # noqa: F401  sparse_attention_decode, _prefill: reference, triton
import dsinfer.ops.step_plan  # noqa: F401  step_entry_index, step_pending_plan: reference, triton (CUDA)
import dsinfer.ops.swiglu  # noqa: F401  clamped_swiglu: reference, triton
import dsinfer.ops.topk.packed_key  # noqa: F401
import dsinfer.ops.topk.reference  # noqa: F401
import dsinfer.ops.vision  # noqa: F401  vision_attention: reference (per-image SDPA)

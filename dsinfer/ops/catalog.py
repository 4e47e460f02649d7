"""Imports every op's modules so their backends register (the list of ops lives here, nowhere else)."""

# Each import registers the op's reference and any faster backends beside it.
import dsinfer.ops.fp8_linear  # noqa: F401
import dsinfer.ops.indexer  # noqa: F401  indexer_topk_decode: reference, triton
import dsinfer.ops.moe  # noqa: F401  routed_moe: reference, triton, grouped_mm
import dsinfer.ops.sinkhorn  # noqa: F401
import dsinfer.ops.sparse_attention  # noqa: F401  sparse_attention_decode: reference, triton
import dsinfer.ops.topk.packed_key  # noqa: F401
import dsinfer.ops.topk.reference  # noqa: F401
import dsinfer.ops.vision  # noqa: F401  vision_attention: reference (per-image SDPA)

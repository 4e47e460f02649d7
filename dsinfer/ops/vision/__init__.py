"""``vision_attention(q, k, v, lengths)``: the vision tower's bidirectional attention over packed images.

Every image of a batch is one full sequence (no mask inside it, nothing across images), so the packed
[N, heads, dim] tensors attend block-diagonally. The reference runs one ``scaled_dot_product_attention`` per
image; a varlen flash-attention backend can register beside it.
"""

from dsinfer.ops.vision.reference import vision_attention_reference

__all__ = ["vision_attention_reference"]

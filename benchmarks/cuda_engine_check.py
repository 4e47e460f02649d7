"""The engine on CUDA gives the CPU's greedy tokens (tiny checkpoint, fp32).

python benchmarks/cuda_engine_check.py
"""

from __future__ import annotations

import tempfile

import torch

from dsinfer.llm import LLM
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=generator).tolist() for n in torch.randint(2, 300, (24,))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory)
        options = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 400}
        cpu = LLM(directory, device="cpu", **options).generate(prompts, params, use_tqdm=False)
        gpu = LLM(directory, device="cuda", **options).generate(prompts, params, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu, strict=True))
    print(f"CUDA engine greedy tokens equal the CPU's for {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()

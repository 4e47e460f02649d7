"""The engine on CUDA gives the CPU's greedy tokens (tiny V4 and V4.1 checkpoints, fp32).

python benchmarks/cuda_engine_check.py
"""

from __future__ import annotations

import gc
import tempfile

import torch

from dsinfer.llm import LLM
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=generator).tolist() for n in torch.randint(2, 300, (24,))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for arch in ("v4", "v41"):
        with tempfile.TemporaryDirectory() as directory:
            make_tiny_checkpoint(directory, arch=arch)
            options = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 400}
            outputs = {}
            for device in ("cpu", "cuda"):
                with LLM(directory, device=device, **options) as llm:
                    outputs[device] = llm.generate(prompts, params, use_tqdm=False)
                del llm
                gc.collect()
                torch.cuda.empty_cache()  # the next engine sizes its cache from free GPU memory
            cpu, gpu = outputs["cpu"], outputs["cuda"]
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu, strict=True))
        print(f"{arch}: CUDA engine greedy tokens equal the CPU's for {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()

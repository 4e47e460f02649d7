# The image the GPUStack backend (deploy/gpustack/dsinfer-backend.yaml) names: dsinfer on CUDA, torch and Triton
# of a pair the test suite passes with. Build from the repository root:
#   docker build -t dsinfer:0.1.0 .
# Run with the checkpoint mounted read-only and a volume for the kernel (JIT) and hub caches:
#   docker run --gpus all -p 8000:8000 -v /data/DeepSeek-V4-Flash:/models/model:ro -v dsinfer-cache:/cache dsinfer:0.1.0
# A Hugging Face repository id works in place of the mounted directory (fetched into /cache/huggingface):
#   docker run --gpus all -p 8000:8000 -v dsinfer-cache:/cache dsinfer:0.1.0 dsinfer serve deepseek-ai/DeepSeek-V4-Flash --host 0.0.0.0
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.9.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/dsinfer \
    PATH=/opt/dsinfer/bin:$PATH \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    HF_HOME=/cache/huggingface \
    DSINFER_PORT=8000

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/dsinfer

# torch first, from the CUDA index, and Triton pinned beside it: the pair the image was tested with.
RUN pip install --index-url ${TORCH_INDEX} "torch==${TORCH_VERSION}" \
    && pip install "triton==${TRITON_VERSION}" \
    && python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

WORKDIR /opt/src
COPY pyproject.toml README.md ./
COPY dsinfer ./dsinfer
RUN pip install . && rm -rf /opt/src

WORKDIR /
VOLUME ["/cache"]
EXPOSE 8000
# Start-up loads the weights and compiles kernels: minutes for a large checkpoint before /health answers.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${DSINFER_PORT}/health" || exit 1
CMD ["dsinfer", "serve", "/models/model", "--host", "0.0.0.0", "--port", "8000"]

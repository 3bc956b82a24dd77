# DCP on NVIDIA's PyTorch container (CUDA, cuDNN, NCCL, Transformer Engine and apex inside).
# Build: docker build -t dcp:latest .      Run: see docker/README.md (torchrun, SLURM + pyxis).
# The container's own torch/TE/apex are used as shipped; requirements-container.txt adds only
# megatron-core (no deps, so pip never replaces the container's torch) and DCP's pure-Python deps.
# 26.09: torch 2.14.0a0 (NVIDIA's build of the 2.14 branch), Transformer Engine 2.19.0, CUDA 13.4,
# Python 3.12 (docs/gpu.md, 'The container image'); DCP supports torch 2.11 to 2.15.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.09-py3
FROM ${BASE_IMAGE}

# expandable_segments: the caching allocator grows its segments instead of allocating new
# blocks when allocation sizes change from one use to the next (torch docs, CUDA semantics,
# 'Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF'); DCP's micro-step shapes vary.
ENV PYTHONUNBUFFERED=1 \
    WANDB_MODE=offline \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

WORKDIR /workspace/dcp
COPY docker/requirements-container.txt docker/install_requirements.sh /tmp/dcp-install/
# megatron-core without dependencies, so pip never replaces the image's torch; DCP's own deps
# under the image's /etc/pip/constraint.txt (pins the image already fixes are skipped).
RUN python -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" \
 && pip install --no-cache-dir --no-deps megatron-core==0.19.2 \
 && /tmp/dcp-install/install_requirements.sh /tmp/dcp-install/requirements-container.txt \
 && python -c "import transformer_engine, megatron.core; print('TE', transformer_engine.__version__)"

COPY dcp ./dcp
COPY megatron_patches ./megatron_patches
COPY pretrain ./pretrain
COPY tools ./tools
COPY tests ./tests
COPY pyproject.toml README.md ./
# A base image whose torch DCP does not support fails here, naming it (dcp/versions.py).
RUN python -c "from dcp.versions import require_supported_versions as r; r()"

ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node", "8", "-m", "pretrain.pretrain_gpt", "--config", "pretrain/configs/llama3_8b_h200.yaml"]

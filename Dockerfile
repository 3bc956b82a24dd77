# DCP on NVIDIA's PyTorch container (CUDA, cuDNN, NCCL, Transformer Engine and apex inside).
# Build: docker build -t dcp:latest .      Run: see docker/README.md (torchrun, SLURM + pyxis).
# The container's own torch/TE/apex are used as shipped; requirements-container.txt adds only
# megatron-core (no deps, so pip never replaces the container's torch) and DCP's pure-Python deps.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    WANDB_MODE=offline

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

ENTRYPOINT ["torchrun"]
CMD ["--nproc-per-node", "8", "-m", "pretrain.pretrain_gpt", "--config", "pretrain/configs/llama3_8b_h200.yaml"]

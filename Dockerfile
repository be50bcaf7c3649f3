# The OpenForge image the Helm chart runs: one image, one process per Deployment (`openforge <name>`,
# the entrypoint; the learner with several GPUs runs `python -m torch.distributed.run ... -m openforge`).
#
#   make image                      # docker build -t ghcr.io/openforge/openforge:<version> .
#
# The build installs into /opt/openforge with scripts/image/install.sh, the same script the test
# suite runs (tests/integration/processes/test_image_install.py), so what is checked is what ships.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install --yes --no-install-recommends build-essential ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    OPENFORGE_IMAGE_PYTHON=python3
WORKDIR /src
COPY pyproject.toml README.md ./
COPY openforge ./openforge
COPY schemas ./schemas
COPY stream ./stream
COPY producers ./producers
COPY proxy ./proxy
COPY consumers ./consumers
COPY learner ./learner
COPY scripts/lib ./scripts/lib
COPY scripts/image ./scripts/image
COPY scripts/learner ./scripts/learner
RUN bash scripts/image/install.sh /opt/openforge

FROM ${PYTHON_IMAGE}
# The chart runs every pod as this user and group (runAsUser/runAsGroup/fsGroup 10001).
RUN groupadd --gid 10001 openforge && useradd --uid 10001 --gid 10001 --create-home openforge
COPY --from=build /opt/openforge /opt/openforge
ENV PATH=/opt/openforge/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/openforge
ENTRYPOINT ["openforge"]
CMD ["--help"]

# Two images, each with the `distbelief` entry point and only what its commands need:
#   runtime (the last stage, the default target)  distbelief ps|worker ...  the job pods
#   operator                                      distbelief operator ...   the chart's Deployment
#
# Build from the repository root (make image builds both):
#   docker build --target operator -t distbelief/operator:0.1.0 .
#   docker build -t distbelief/distbelief:0.1.0 .
#
# Dependencies come from requirements/<image>.lock (tools/lock-image-deps), pinned with their
# hashes and installed from wheels only, so the image builds what the tests ran and no stage
# needs a compiler. The final stages hold the Python runtime and one virtualenv: no pip,
# setuptools, wheel or compiler.

# Every stage uses the same base: a virtualenv links to its Python. Its minor version is the
# one the locks are resolved for (tools/lock-image-deps checks it).
FROM python:3.11-slim-bookworm AS wheel
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY requirements/build.lock requirements/
RUN python -m venv /opt/build \
 && /opt/build/bin/python -m pip install --require-hashes --only-binary=:all: -r requirements/build.lock
COPY pyproject.toml README.md ./
COPY crds/ crds/
COPY operator/ operator/
COPY runtime/ runtime/
# operator/distbelief/operator/crds is a symlink to crds/: the wheel carries the CRD itself.
RUN /opt/build/bin/python -m pip wheel --no-build-isolation --no-deps --wheel-dir /tmp/wheels . \
 && /opt/build/bin/python -c "import glob, zipfile; (wheel,) = glob.glob('/tmp/wheels/distbelief-*.whl'); \
      zipfile.ZipFile(wheel).getinfo('distbelief/operator/crds/distbelief.io_distbeliefjobs.yaml')"

# Each image's virtualenv (tools/image-venv): its lock, the wheel, then tools/check-install,
# which imports every module the image serves and starts its commands, so a wheel or lock
# that leaves a module out fails the build here instead of crash-looping every pod. binutils
# strips the libraries' debug symbols; it stays in this stage.
FROM python:3.11-slim-bookworm AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY requirements/ requirements/
COPY tools/check-install tools/image-venv tools/
COPY --from=wheel /tmp/wheels /tmp/wheels

FROM venv AS operator-venv
RUN tools/image-venv operator /tmp/wheels

FROM venv AS runtime-venv
RUN tools/image-venv runtime /tmp/wheels

# The root filesystem both images run on (tools/image-rootfs): CPython and the Debian
# libraries that it and both virtualenvs load, CA certificates, time zones, /etc with the
# pods' user; no shell, no package manager, no docs. tools/check-install then runs each
# image's virtualenv on that root filesystem alone (chroot), so a library it left out fails
# the build here.
FROM python:3.11-slim-bookworm AS rootfs
WORKDIR /src
COPY pyproject.toml ./
COPY tools/check-install tools/image-rootfs tools/
COPY --from=operator-venv /opt/distbelief /venvs/operator
COPY --from=runtime-venv /opt/distbelief /venvs/runtime
RUN groupadd --system --gid 10001 distbelief \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin distbelief \
 && tools/image-rootfs /rootfs /venvs/operator /venvs/runtime \
 && mkdir /rootfs/check /rootfs/opt \
 && cp -a pyproject.toml tools /rootfs/check/ \
 && for image in operator runtime; do \
      cp -a "/venvs/$image" /rootfs/opt/distbelief \
      && chroot /rootfs /opt/distbelief/bin/python /check/tools/check-install --image "$image" \
      && rm -rf /rootfs/opt/distbelief || exit 1; \
    done \
 && rm -rf /rootfs/check

# What both images share: the root filesystem above, in one layer, and the pods' user.
FROM scratch AS base
LABEL org.opencontainers.image.licenses="Apache-2.0"
COPY --from=rootfs /rootfs /
# The pods run with a read-only root filesystem and an emptyDir at /tmp: everything a
# process writes (HOME, the shard's compiled update rules) goes there, and no bytecode is
# written.
ENV PATH=/opt/distbelief/bin:/usr/local/bin:/usr/bin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    NUMBA_CACHE_DIR=/tmp/numba
# The same uid and gid as the pods' securityContext (render.RUN_AS_ID, the chart's values).
USER 10001:10001
WORKDIR /tmp
# Kubernetes probes each role itself (the chart and the renderer set liveness and
# readiness probes on the role's own port), so the images declare no HEALTHCHECK.
HEALTHCHECK NONE
ENTRYPOINT ["distbelief"]
CMD ["--help"]

FROM base AS operator
LABEL org.opencontainers.image.title="distbelief-operator" \
      org.opencontainers.image.description="DistBelief-style training on Kubernetes: the operator"
COPY --from=operator-venv /opt/distbelief /opt/distbelief

FROM base AS runtime
LABEL org.opencontainers.image.title="distbelief" \
      org.opencontainers.image.description="DistBelief-style training on Kubernetes: the parameter shards and model replicas"
COPY --from=runtime-venv /opt/distbelief /opt/distbelief

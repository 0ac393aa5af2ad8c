# syntax=docker/dockerfile:1
# One image for the operator and the runtime roles: the entry point is `distbelief`, so
#   docker run IMAGE operator ...      the Kubernetes operator (the Helm chart runs this)
#   docker run IMAGE ps|worker ...     a parameter shard / a model replica (job pods)
#   docker run IMAGE run JOB.yaml      local mode
#
# Build from the repository root:  docker build -t distbelief/distbelief:0.1.0 .
#
# Dependencies come from requirements/*.lock (tools/lock-image-deps), pinned with their
# hashes and installed from wheels only, so the image builds what the tests ran and the
# build stage needs no compiler. The final stage holds the Python runtime and one
# virtualenv: no pip, setuptools, wheel or compiler.

# Both stages use the same base: the virtualenv links to its Python. Its minor version is
# the one the locks are resolved for (tools/lock-image-deps checks it).
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY requirements/ requirements/
# /opt/build: pip and the build backend, to make the project's wheel. /opt/distbelief:
# what the image runs, its dependencies first (a layer that changes only with the lock).
RUN python -m venv /opt/build \
 && /opt/build/bin/python -m pip install --require-hashes --only-binary=:all: -r requirements/build.lock \
 && python -m venv /opt/distbelief \
 && /opt/distbelief/bin/python -m pip install --require-hashes --only-binary=:all: --no-deps \
      -r requirements/image.lock
COPY pyproject.toml README.md ./
COPY crds/ crds/
COPY operator/ operator/
COPY runtime/ runtime/
COPY tools/check-install tools/
# operator/distbelief/operator/crds is a symlink to crds/: the wheel carries the CRD itself.
# tools/check-install imports every module of the installed wheel and starts
# `distbelief ps --help` and `distbelief worker --help`: a wheel that leaves a module out
# fails the build here instead of crash-looping every job pod.
RUN /opt/build/bin/python -m pip wheel --no-build-isolation --no-deps --wheel-dir /tmp/wheels . \
 && /opt/distbelief/bin/python -m pip install --no-deps --no-index /tmp/wheels/distbelief-*.whl \
 && /opt/distbelief/bin/python -c "from distbelief.operator.spec import spec; spec.load_crd()" \
 && /opt/distbelief/bin/python tools/check-install \
 && /opt/distbelief/bin/python -m pip uninstall --yes pip setuptools

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="distbelief" \
      org.opencontainers.image.description="DistBelief-style training on Kubernetes: the operator and the roles" \
      org.opencontainers.image.licenses="Apache-2.0"
# The base image's own installers go too: nothing in the final stage builds or installs.
RUN PIP_ROOT_USER_ACTION=ignore python -m pip uninstall --yes pip setuptools wheel \
 && groupadd --system --gid 10001 distbelief \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin distbelief
COPY --from=build /opt/distbelief /opt/distbelief
# The pods run with a read-only root filesystem and an emptyDir at /tmp: everything a
# process writes (HOME, matplotlib's cache, the shard's compiled update rules) goes
# there, and no bytecode is written.
ENV PATH=/opt/distbelief/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    NUMBA_CACHE_DIR=/tmp/numba \
    MPLBACKEND=Agg
# The same uid and gid as the pods' securityContext (render.RUN_AS_ID, the chart's values).
USER 10001:10001
WORKDIR /tmp
# Kubernetes probes each role itself (the chart and the renderer set liveness and
# readiness probes on the role's own port), so the image declares no HEALTHCHECK.
HEALTHCHECK NONE
ENTRYPOINT ["distbelief"]
CMD ["--help"]

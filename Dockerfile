# One image for `serve`, `subscribe`, `gateway` (and every other subcommand): the entrypoint is
# `inferencecache`, the arguments pick the binary, e.g. `docker run IMAGE serve --help`.
#
# Two ways to build (docs/deploy.md):
#   online:   docker build -t inferencecache .
#             the build stage installs gcc (and python3-dev when the base has no Python.h) and
#             compiles the package from this source tree, fetching dependencies from the index;
#   offline:  pip wheel . -w wheels/ && docker build -t inferencecache .
#             (or scripts/build-image) when `wheels/` holds an inferencecache wheel the build
#             installs only from it (`--no-index`): no network at all inside the build.
# Either way the compiled accelerators must be present: the build fails otherwise.
#
# BASE_IMAGE needs python3 (3.11 or newer, with the venv module) and a libc matching the
# wheels; both stages use it, so the virtual environment's interpreter path is the same in both.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
COPY . /src
RUN set -eux; \
    python3 -m venv /opt/inferencecache; \
    pip=/opt/inferencecache/bin/pip; \
    if ls /src/wheels/inferencecache-*.whl >/dev/null 2>&1; then \
        "$pip" install --no-index --find-links /src/wheels inferencecache; \
    else \
        apt-get update; \
        apt-get install -y --no-install-recommends gcc libc6-dev; \
        python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
          || apt-get install -y --no-install-recommends python3-dev; \
        "$pip" install /src; \
    fi; \
    "$pip" uninstall -y pip setuptools; \
    INFERENCECACHE_REQUIRE_NATIVE=1 /opt/inferencecache/bin/python -c \
      'import importlib, inferencecache.accelerators as a; [importlib.import_module(m) for m in a.MODULES]'

FROM ${BASE_IMAGE}
COPY --from=build /opt/inferencecache /opt/inferencecache
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin inferencecache
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
ENV PATH=/opt/inferencecache/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib INFERENCECACHE_REQUIRE_NATIVE=1
# serve: gRPC 9090, HTTP 8080; subscribe: metrics 9091; gateway: HTTP 8090.
EXPOSE 9090 8080 9091 8090
ENTRYPOINT ["inferencecache"]
CMD ["--help"]

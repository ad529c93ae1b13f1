# syntax=docker/dockerfile:1
# One image for every part of IOP Edge: `iop operator run`, `iop edge run`, `iop node run`,
# `iop fake-upstream` (the chart passes the subcommand as the container's args).
#
#   docker build -t ghcr.io/iop-edge/iop-edge:0.1.0 .
#
# Three stages, so that a change under src/ rebuilds only what is the project's: `dependencies`
# installs the locked dependencies (uv.lock, --frozen: exactly those versions, or the build fails)
# into a virtualenv and trims them; `project` installs the project into it as a regular,
# non-editable package and gathers the project's own files (the package, its bytecode, its
# dist-info, the `iop` script); the final stage copies the virtualenv of dependencies in one layer
# (unchanged, and so reused, until uv.lock changes) and the project's files over it in a small
# one, onto a slim Python, as a non-root user. Bytecode is compiled ahead (the root file system is
# read-only in the chart). The build context is pyproject.toml, uv.lock, README.md, LICENSE and
# src/ (.dockerignore lets nothing else in); tests/test_packaging.py builds and runs the package
# from exactly the files copied here.

ARG PYTHON_VERSION=3.11
# Match scripts/bootstrap.
ARG UV_VERSION=0.13.8

FROM python:${PYTHON_VERSION}-slim-bookworm AS dependencies
ARG UV_VERSION
RUN python -m pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}"
# `strip`, for the compiled extensions below.
RUN apt-get update \
 && apt-get install -y --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
ENV UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=/usr/local/bin/python \
    UV_PROJECT_ENVIRONMENT=/opt/iop
WORKDIR /src
COPY pyproject.toml uv.lock ./
# The locked dependencies, then what the image never runs stays behind (about 90 of their 226 MB):
# the asyncio client of the `kubernetes` package (`kubernetes.aio`, 66 MB with its bytecode; the
# operator uses only the package's kubeconfig and in-cluster loaders, iop/operator/kubeapi.py),
# test folders, and the symbol tables of the compiled extensions (what dynamic linking needs
# stays). Then every extension module is imported once, so a bad strip fails the build, not a pod.
RUN --mount=type=cache,target=/root/.cache/uv \
    UV_COMPILE_BYTECODE=1 uv sync --frozen --no-dev --no-install-project \
 && site=$(echo /opt/iop/lib/python3*/site-packages) \
 && rm -rf "$site/kubernetes/aio" "$site"/*/tests \
 && find /opt/iop -name '*.so' -exec strip --strip-unneeded {} + \
 && /opt/iop/bin/python -c "import importlib, pathlib, re, sys; site = pathlib.Path(sys.argv[1]); \
[importlib.import_module('.'.join([*p.relative_to(site).parent.parts, p.name.split('.')[0]])) \
 for p in site.rglob('*.so') if re.search(r'[.](cpython-|abi3[.])', p.name)]" "$site"

FROM dependencies AS project
COPY README.md LICENSE ./
COPY src/ ./src/
# The project into the same virtualenv (its dependencies are there: uv installs none), its
# bytecode compiled (only its own: the dependencies' is done), and its files, as RECORD lists
# them, gathered under /project at their paths in the image.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable \
 && /opt/iop/bin/iop --version \
 && cd /opt/iop/lib/python3*/site-packages \
 && /opt/iop/bin/python -m compileall -q iop \
 && mkdir /project \
 && { cut -d, -f1 iop_edge-*.dist-info/RECORD; find iop -name '*.pyc'; } \
  | xargs realpath -m --relative-to=/ | (cd / && xargs cp --parents -p -t /project)

FROM python:${PYTHON_VERSION}-slim-bookworm
LABEL org.opencontainers.image.title="iop-edge" \
      org.opencontainers.image.description="IOP Edge: the EdgeConfig operator, the Edge and the Node agent" \
      org.opencontainers.image.source="https://github.com/iop-edge/iop-edge" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 iop \
 && useradd --system --uid 10001 --gid iop --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin iop
# The dependencies in one layer (reused until uv.lock changes), the project in a small one.
COPY --from=dependencies /opt/iop /opt/iop
COPY --from=project /project/ /
ENV PATH=/opt/iop/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Numeric, so runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["iop"]
CMD ["--help"]

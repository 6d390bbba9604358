# One image for every gpuslice service (python -m gpuslice_<service>) and the
# gpuslice command. Built from the repository root: docker build -t gpuslice .

# The interposer, and the fake CUDA driver, NVML and probe the local stack uses.
# Built against an older glibc (2.31): the interposer is preloaded into every
# GPU container, whatever its base image, and must load there.
FROM debian:bullseye-slim AS native
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc make libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY native/ native/
# the headers native/ shares with the Python packages that read them through cffi
COPY libs/common/gpuslice_common/region_layout.h libs/common/gpuslice_common/
COPY services/scheduler/gpuslice_scheduler/engine_core.h services/scheduler/gpuslice_scheduler/
RUN make -C native all fakes build/probe

# The Python package, as a wheel.
FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY libs/ libs/
COPY apps/ apps/
COPY services/ services/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPUSLICE_NATIVE_DIR=/opt/gpuslice
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# the device plugin installs libgpuslice.so from here into the node's host directory;
# the scheduler loads its placement engine, libgsengine.so, from here
COPY --from=native /src/native/build/libgpuslice.so /src/native/build/libgsengine.so \
    /src/native/build/probe /opt/gpuslice/
COPY --from=native /src/native/build/fake/ /opt/gpuslice/fake/
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gpuslice
USER 10001
CMD ["gpuslice", "--help"]

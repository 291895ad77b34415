# streamctl in a container: what `streamctl transfer --k8s-job --image IMAGE` runs in every pod.
#   docker build -t REGISTRY/streamctl:VERSION . && docker push REGISTRY/streamctl:VERSION
FROM python:3.12-slim

# No .pyc files or pip cache in the image; unbuffered logs, so `kubectl logs` shows progress as it happens.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# This very checkout (see .dockerignore for what stays out), installed as a regular package; the sources go.
WORKDIR /src
COPY . .
RUN pip install . && cd / && rm -rf /src

# Never root: reading a repo and writing a bucket needs no privileges.
RUN useradd --create-home --uid 10001 streamctl
USER 10001
WORKDIR /home/streamctl

ENTRYPOINT ["streamctl"]
CMD ["--help"]

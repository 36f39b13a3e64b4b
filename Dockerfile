# CPU image for every Trident service (compose.yaml); the service is picked by the command.
FROM python:3.11-slim

# HF_HUB_OFFLINE: checkpoints are read from disk by path; nothing is ever fetched from a hub.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1

# torch first, pinned, from the CPU index: otherwise pip resolves the multi-GB CUDA build from PyPI.
# Its own layer, so changes to the project do not download it again.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
# The dependencies in a layer of their own, keyed on pyproject.toml alone: a change to the code
# rebuilds only the small layer below (seconds), not every dependency (a minute and more).
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY common ./common
COPY services ./services
COPY trident ./trident
RUN pip install --no-deps .

# A non-root user; /models is created here and owned by it, so the named volume mounted there starts with
# that owner and model-init (running as this user) can write the checkpoint into it.
RUN useradd --create-home --uid 10001 trident \
    && mkdir -p /models \
    && chown trident:trident /models
USER trident

ENV TRIDENT_BIND_HOST=0.0.0.0
EXPOSE 8000 9000
CMD ["python", "-m", "services.worker"]

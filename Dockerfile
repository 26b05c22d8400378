# One image for web, worker, beat and the demo emulator; the compose command picks the role.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 VAR_DIR=/app/var
WORKDIR /app
COPY pyproject.toml requirements.lock README.md ./
RUN pip install -c requirements.lock .
COPY . .
RUN useradd --create-home --uid 10001 app && mkdir -p /app/var && chown -R app /app/var
USER app
EXPOSE 8000
CMD ["uvicorn", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]

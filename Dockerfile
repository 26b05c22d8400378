# One image for web, worker, beat, the demo emulator and the fleet agent; the compose command
# picks the role.
# Front-end assets (htmx, uPlot) come from npm in a build stage; only their dist files ship.
FROM node:20-slim AS assets
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund --omit=dev

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VAR_DIR=/app/var
WORKDIR /app
# Dependencies first (a layer that survives code changes). pyproject names README.md; the
# wildcard lets the build work before it exists.
COPY pyproject.toml requirements.lock README.m[d] ./
# The fleet extra too: the same image runs the fleet agent (compose profile `agent`).
RUN test -f README.md || touch README.md; pip install -c requirements.lock '.[fleet]'
COPY . .
COPY --from=assets /src/node_modules/htmx.org/dist /app/node_modules/htmx.org/dist
COPY --from=assets /src/node_modules/uplot/dist /app/node_modules/uplot/dist
RUN useradd --create-home --uid 10001 app && mkdir -p /app/var && chown -R app /app/var
USER app
EXPOSE 8000
CMD ["uvicorn", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--workers", "2", "--http", "controlplane.http_protocol:HeaderDeadlineProtocol", "--timeout-keep-alive", "5"]

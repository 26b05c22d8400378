"""The scheduling app's one API router: routing decisions, live-state ingest, plans, and what
routers that decide in process need (live state, link reservations, outcomes)."""

from ninja import Router

from scheduling.api.live import router as live_router
from scheduling.api.outcomes import router as outcomes_router
from scheduling.api.plans import router as plans_router
from scheduling.api.route import router as route_router

router = Router()
router.add_router("", route_router)
router.add_router("", live_router)
router.add_router("", plans_router)
router.add_router("", outcomes_router)

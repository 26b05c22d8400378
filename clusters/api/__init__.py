"""The clusters app's one API router; each module below contributes its own sub-router."""

from ninja import Router

from clusters.api.inventory import router as inventory_router
from clusters.api.registrations import router as registrations_router
from clusters.api.topology import router as topology_router

router = Router()
router.add_router("", inventory_router)
router.add_router("", topology_router)
router.add_router("", registrations_router)

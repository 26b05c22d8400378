"""``GET /api/v1/audit``: the change log, newest first. Read-only by design: no write route."""

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.pagination import paginate

from controlplane.auth import TokenAuth
from controlplane.pagination import BoundedLimitOffsetPagination
from controlplane.selectors import change_record_list

router = Router(tags=["audit"])


class ChangeRecordOut(Schema):
    id: int
    at: datetime
    actor: str
    actor_user_id: int | None
    actor_token_id: int | None
    source: str
    request_id: str
    object_type: str
    object_id: str
    object_repr: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    cause: str


@router.get("/audit", response=list[ChangeRecordOut], auth=TokenAuth("read"))
@paginate(BoundedLimitOffsetPagination)
def audit_list(
    request: HttpRequest,
    object_type: str | None = None,
    object_id: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    request_id: str | None = None,
):
    return change_record_list(
        object_type=object_type,
        object_id=object_id,
        action=action,
        actor=actor,
        request_id=request_id,
    )

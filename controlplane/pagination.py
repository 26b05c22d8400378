"""The one pagination of the API: ``?limit=&offset=`` answering ``{items, count}``.

Both bounds are in the schema, so a client learns them from the OpenAPI document and an
out-of-range value is a 422 rather than a number PostgreSQL cannot take (OFFSET is a bigint).
"""

from ninja import Field, Schema
from ninja.pagination import LimitOffsetPagination

MAX_LIMIT = 1000
MAX_OFFSET = 10**9
DEFAULT_LIMIT = 100


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """Limit/offset pagination with both bounds stated in the schema and enforced."""

    class Input(Schema):
        limit: int = Field(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT, description="items per page")
        offset: int = Field(0, ge=0, le=MAX_OFFSET, description="items to skip")

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_limit=MAX_LIMIT, **kwargs)

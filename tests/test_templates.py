"""Templates: nothing of the template language can leak onto a page as text.

Django's ``{# #}`` comment is one line only: one spread over two lines is printed as it is.
(The browser tests check every rendered page for raw template syntax as well.)"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

TEMPLATES = Path(settings.BASE_DIR) / "templates"


def test_every_one_line_comment_closes_on_its_own_line() -> None:
    open_comments = [
        f"{path.relative_to(TEMPLATES)}:{number}"
        for path in sorted(TEMPLATES.rglob("*.html"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.count("{#") != line.count("#}")
    ]
    assert list(TEMPLATES.rglob("*.html")), TEMPLATES
    assert not open_comments, open_comments

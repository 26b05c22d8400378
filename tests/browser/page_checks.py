"""What every page must get right whatever it shows, checked in the browser on the rendered page
(tests/browser/test_page_checks.py on factory data, tests/browser/test_demo_ui.py on the live
demo), at a desktop and a phone width:

* no raw template syntax in the visible text (``{#``, ``{%``, ``{{`` and their closers): a
  Django comment spread over two lines is printed as it is;
* nothing overflows its card unseen: an element reaching past its card must sit in a scroll
  container that shows it scrolls (``.table-wrap[data-scrolls]``: static/js/live.js marks it,
  the stylesheet writes a note), and no element clips content it hides (overflow hidden with
  more inside than it shows); the page itself is never wider than the screen;
* axes that read: a time axis labels clock times (``HH:MM`` or ``HH:MM:SS``) at steps of whole
  seconds, minutes or hours; a duration axis whole seconds, minutes or hours; categories are
  named and drawn as bars; every chart says which it is.
"""

from __future__ import annotations

import re
from typing import Any

DESKTOP = {"width": 1360, "height": 900}
PHONE = {"width": 390, "height": 844}

RAW_TEMPLATE = re.compile(r"\{[#%{]|[#%]\}")
CLOCK_LABEL = re.compile(r"^\d\d:\d\d(:\d\d)?$")
DURATION_LABEL = re.compile(r"^\d+(\.\d)? (s|min|h)$")
# The steps a time or duration axis may take (static/js/live.js CLOCK_STEPS).
STEPS_S = {
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
}

_VISIBLE_TEXT = "() => [document.title, document.body.innerText].join('\\n')"

_OVERFLOW = """() => {
  const out = [];
  const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    (el.className && typeof el.className === 'string' ? '.' + el.className.trim().split(/\\s+/).join('.') : '');
  const hidden = el => el.closest('.visually-hidden, [hidden]') !== null;
  const scroller = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
  const clips = el => ['hidden', 'clip'].includes(getComputedStyle(el).overflowX);
  const says = el => el.hasAttribute('data-scrolls') &&
    getComputedStyle(el, '::after').content.includes('scroll sideways');
  for (const card of document.querySelectorAll('main .card, main .kpi')) {
    const box = card.getBoundingClientRect();
    for (const el of card.querySelectorAll('*')) {
      if (hidden(el)) continue;
      const r = el.getBoundingClientRect();
      if (!r.width || !r.height) continue;
      if (r.right <= box.right + 1 && r.left >= box.left - 1) continue;
      let a = el.parentElement, seen = false;
      while (a && a !== card.parentElement) {
        if (scroller(a)) { seen = says(a); break; }
        a = a.parentElement;
      }
      if (!seen) out.push(`${name(el)} reaches ${Math.round(r.right - box.right)} px past ${name(card)}`);
    }
    for (const el of [card, ...card.querySelectorAll('*')]) {
      if (hidden(el) || !clips(el)) continue;
      if (el.scrollWidth > el.clientWidth + 1) {
        out.push(`${name(el)} hides ${el.scrollWidth - el.clientWidth} px of its content`);
      }
    }
  }
  const page = document.documentElement.scrollWidth - window.innerWidth;
  if (page > 1) out.push(`the page is ${page} px wider than the screen`);
  return [...new Set(out)];
}"""

_CHARTS = """() => [...document.querySelectorAll('.uplot')].map(chart => {
  const node = chart.closest('[data-x-axis]');
  return node === null ? {id: chart.parentElement.id || '?', axis: null} : {
    id: node.id || '?', axis: node.dataset.xAxis, step: Number(node.dataset.xStep || 0),
    ticks: (node.dataset.xTicks || '').split('|').filter(Boolean),
    bars: Number(node.dataset.bars || 0)};
})"""


def raw_template_text(page: Any) -> list[str]:
    """Lines of the page's visible text (and title) holding template syntax."""
    text = str(page.evaluate(_VISIBLE_TEXT))
    return [line.strip() for line in text.splitlines() if RAW_TEMPLATE.search(line)]


def hidden_overflow(page: Any) -> list[str]:
    """Elements past their card without a visible scroll, content clipped, a too wide page."""
    return list(page.evaluate(_OVERFLOW))


def unreadable_axes(page: Any) -> list[str]:
    """Charts whose x axis does not read (see the module)."""
    out = []
    for chart in page.evaluate(_CHARTS):
        where, ticks = chart["id"], chart.get("ticks", [])
        if chart["axis"] is None:
            out.append(f"{where}: a chart that does not say what its x axis is")
        elif chart["axis"] == "time":
            bad = [t for t in ticks if not CLOCK_LABEL.match(t)]
            if not ticks or bad or int(chart["step"]) not in STEPS_S:
                out.append(f"{where}: time axis {ticks} at {chart['step']} s steps")
        elif chart["axis"] == "duration":
            bad = [t for t in ticks if not DURATION_LABEL.match(t)]
            if not ticks or bad or int(chart["step"]) not in STEPS_S:
                out.append(f"{where}: duration axis {ticks} at {chart['step']} s steps")
        elif chart["axis"] == "category":
            if not ticks or any(re.fullmatch(r"[\d.:]+", t) for t in ticks) or not chart["bars"]:
                out.append(f"{where}: categories {ticks} drawn with {chart['bars']} bars")
        else:
            out.append(f"{where}: unknown axis kind {chart['axis']!r}")
    return out


def page_problems(page: Any) -> dict[str, list[str]]:
    """Every problem of the page as it is now, by check (empty lists: none)."""
    return {
        "raw template syntax": raw_template_text(page),
        "hidden overflow": hidden_overflow(page),
        "axes": unreadable_axes(page),
    }

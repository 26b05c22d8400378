/* Live views: one websocket per page, subscribed to one group (see controlplane/live.py).
 *
 * Frames carry (epoch, seq). The server already sends them in order and resyncs on gaps; the
 * page checks too: a frame that does not follow the last one (or a new epoch) makes it ask for
 * a snapshot. A closed socket reconnects with backoff, and the server's first message after a
 * connect is always a snapshot, so a page never shows stale state for long.
 */
(function () {
  "use strict";

  function LiveSocket(group, handlers) {
    this.group = group;
    this.handlers = handlers || {};
    this.epoch = null;
    this.seq = 0;
    this.attempt = 0;
    this.closedByCode = null;
    this.connect();
  }

  LiveSocket.prototype.url = function () {
    var scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    return scheme + "//" + window.location.host + "/ws/live/" + encodeURIComponent(this.group) + "/";
  };

  LiveSocket.prototype.status = function (text, on) {
    if (this.handlers.quiet) return; // a page's second socket (the banner) leaves it alone
    var el = document.getElementById("live-status");
    if (!el) return;
    el.innerHTML = '<span class="live-dot" aria-hidden="true"></span>' + text;
    el.classList.toggle("live-on", !!on);
  };

  LiveSocket.prototype.connect = function () {
    var self = this;
    var ws = new WebSocket(this.url());
    this.ws = ws;
    ws.onopen = function () { self.attempt = 0; };
    ws.onmessage = function (event) { self.receive(JSON.parse(event.data)); };
    ws.onclose = function (event) {
      if (event.code === 4401) { self.status("Live updates need a login", false); return; }
      if (event.code === 4404) { self.status("Live updates unavailable", false); return; }
      self.status("Reconnecting…", false);
      var delay = Math.min(10000, 250 * Math.pow(2, self.attempt++));
      window.setTimeout(function () { self.connect(); }, delay);
    };
  };

  LiveSocket.prototype.resync = function () {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ type: "resync" }));
    }
  };

  LiveSocket.prototype.receive = function (msg) {
    if (msg.type === "error") { return; }
    if (msg.type === "snapshot") {
      this.epoch = msg.epoch;
      this.seq = msg.seq;
      this.status("Live", true);
      if (this.handlers.snapshot) this.handlers.snapshot(msg.data, msg);
      return;
    }
    if (msg.epoch !== this.epoch || msg.seq !== this.seq + 1) {
      if (msg.epoch === this.epoch && msg.seq <= this.seq) return; // already applied
      this.resync();
      return;
    }
    this.seq = msg.seq;
    var handler = this.handlers[msg.type];
    if (handler) handler(msg.data, msg);
    if (this.handlers.any) this.handlers.any(msg);
  };

  /* Small helpers the page scripts share. */
  function fmt(value, digits) {
    if (value === null || value === undefined || isNaN(value)) return "–";
    return Number(value).toFixed(digits === undefined ? 1 : digits);
  }
  function pct(value) { return fmt(100 * (value || 0), 0) + "%"; }
  function text(el, value) { if (el) el.textContent = value; }

  /* Charts (uPlot). Time axes read in clock time (UTC, like every time on these pages) at
   * steps of whole seconds, minutes or hours; a chart records the labels it drew on its node
   * (data-x-ticks) and what its x axis is (data-x-axis), which the browser tests read. */
  var CLOCK_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  function clockLabel(t, step) {
    var iso = new Date(1000 * t).toISOString();
    return step < 60 ? iso.slice(11, 19) : iso.slice(11, 16);
  }
  function clockAxis(node) {
    node.dataset.xAxis = "time";
    return {
      label: "UTC", labelSize: 18, space: 80, incrs: CLOCK_STEPS,
      values: function (u, splits, axisIdx, space, step) {
        var labels = splits.map(function (t) { return clockLabel(t, step); });
        node.dataset.xTicks = labels.join("|");
        node.dataset.xStep = String(step);
        return labels;
      }
    };
  }
  // At least ``minSpan`` seconds wide, ending at the data's end: a chart with a few seconds of
  // data does not zoom into fractions of a second.
  function clockScale(minSpan) {
    return {
      time: true,
      range: function (u, min, max) {
        if (min == null || max == null) { var now = Date.now() / 1000; return [now - minSpan, now]; }
        return [Math.min(min, max - minSpan), max];
      }
    };
  }
  // A duration axis (simulated seconds) at steps of whole seconds, minutes or hours.
  function durationLabel(t, step) {
    if (step >= 3600) return (t / 3600).toFixed(t % 3600 ? 1 : 0) + " h";
    if (step >= 60) return (t / 60).toFixed(t % 60 ? 1 : 0) + " min";
    return t.toFixed(0) + " s";
  }
  function durationAxis(node, label) {
    node.dataset.xAxis = "duration";
    return {
      label: label, labelSize: 18, space: 70, incrs: CLOCK_STEPS,
      values: function (u, splits, axisIdx, space, step) {
        var labels = splits.map(function (t) { return durationLabel(t, step); });
        node.dataset.xTicks = labels.join("|");
        node.dataset.xStep = String(step);
        return labels;
      }
    };
  }
  // Categories (one x position each) drawn as grouped bars: ``names`` label the positions.
  function categoryAxis(node, names) {
    node.dataset.xAxis = "category";
    return {
      space: 30, incrs: [1],
      values: function (u, splits) {
        var labels = splits.map(function (i) { return names[i] === undefined ? "" : names[i]; });
        node.dataset.xTicks = labels.filter(Boolean).join("|");
        return labels;
      }
    };
  }
  function groupedBars(node, index, count) {
    var width = 0.8 / count;
    return {
      paths: uPlot.paths.bars({
        size: [width, 60], align: count === 1 ? 0 : (index === 0 ? -1 : 1),
        each: function () { node.dataset.bars = String(Number(node.dataset.bars || 0) + 1); }
      }),
      points: { show: false }
    };
  }

  window.PrfaaS = {
    LiveSocket: LiveSocket, fmt: fmt, pct: pct, text: text,
    clockAxis: clockAxis, clockScale: clockScale, durationAxis: durationAxis,
    categoryAxis: categoryAxis, groupedBars: groupedBars
  };
})();

/* Buttons that ask first (templates/confirm_button.html): a form with data-confirm submits
 * only when the operator agrees. Here rather than in an inline handler: the pages'
 * Content-Security-Policy runs no inline script without the page's nonce. */
document.addEventListener("submit", function (event) {
  var form = event.target;
  if (form instanceof HTMLFormElement && form.hasAttribute("data-confirm")) {
    if (!window.confirm(form.getAttribute("data-confirm"))) event.preventDefault();
  }
});

/* A table wider than its card scrolls sideways, and says so: Chromium's overlay scrollbars
 * (and screenshots) show none, so a .table-wrap holding more than it shows gets data-scrolls,
 * which the stylesheet turns into a visible note and an edge shadow. */
(function () {
  "use strict";
  var due = false;
  function mark() {
    due = false;
    document.querySelectorAll(".table-wrap").forEach(function (el) {
      el.toggleAttribute("data-scrolls", el.scrollWidth > el.clientWidth + 1);
    });
  }
  function soon() { if (!due) { due = true; window.requestAnimationFrame(mark); } }
  document.addEventListener("DOMContentLoaded", function () {
    mark();
    window.addEventListener("resize", soon);
    document.addEventListener("htmx:afterSwap", soon);
    var main = document.getElementById("main");
    if (main) new MutationObserver(soon).observe(main, { childList: true, subtree: true, characterData: true });
  });
})();

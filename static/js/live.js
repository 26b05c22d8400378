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

  window.PrfaaS = { LiveSocket: LiveSocket, fmt: fmt, pct: pct, text: text };
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

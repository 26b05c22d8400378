/* Decisions: UTC times, and a live tail (the newest page reloads its rows every 2 s while the
 * tab is visible; older pages stay put so that a row being read does not move). */
(function () {
  "use strict";
  function utc(root) {
    root.querySelectorAll("[data-unix]").forEach(function (el) {
      var t = Number(el.dataset.unix);
      if (t) el.textContent = new Date(1000 * t).toISOString().replace("T", " ").slice(0, 23);
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    utc(document);
    var body = document.getElementById("decision-rows");
    if (!body || !body.dataset.liveUrl) return;
    var busy = false;
    window.setInterval(function () {
      if (busy || document.hidden) return;
      busy = true;
      fetch(body.dataset.liveUrl, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html !== null) { body.innerHTML = html; utc(body); body.dataset.refreshed = String(Date.now()); }
        })
        .catch(function () { /* the next beat tries again */ })
        .then(function () { busy = false; });
    }, 2000);
  });
})();

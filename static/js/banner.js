/* The alert banner every page shows: the active alerts, live over the "alerts" group. */
(function () {
  "use strict";
  var P = window.PrfaaS;
  function render(alerts) {
    var box = document.getElementById("alert-banner");
    if (!box) return;
    var list = box.querySelector("ul");
    list.innerHTML = "";
    alerts.forEach(function (a) {
      var li = document.createElement("li");
      li.className = "banner-item banner-" + a.code;
      li.dataset.code = a.code;
      li.dataset.subject = a.subject;
      var code = document.createElement("code");
      code.textContent = a.code;
      li.appendChild(code);
      li.appendChild(document.createTextNode(" " + a.message));
      list.appendChild(li);
    });
    box.hidden = alerts.length === 0;
    box.dataset.count = String(alerts.length);
    box.dataset.ready = "1"; // the live set arrived (tests wait for it)
  }
  document.addEventListener("DOMContentLoaded", function () {
    if (!document.getElementById("alert-banner")) return;
    new P.LiveSocket("alerts", {
      quiet: true,
      snapshot: function (data) { render(data.alerts); },
      alerts: function (data) { render(data.alerts); }
    });
  });
})();

/* What-if results: TTFT, link and queue charts of the current plan against the what-if. */
(function () {
  "use strict";
  var CUR = "#7d8da1", WHAT = "#1f4f8a", P = window.PrfaaS;

  function width(el) { return Math.max(280, el.clientWidth || 600); }

  function draw() {
    var node = document.getElementById("whatif-result-data");
    if (!node || node.dataset.drawn) return;
    node.dataset.drawn = "1";
    var r = JSON.parse(node.textContent), c = r.current, w = r.whatif;

    // Categories (mean and percentiles) as grouped bars: current plan against what-if.
    var ttft = document.getElementById("chart-ttft");
    var labels = ["mean", "p50", "p90", "p99"];
    new uPlot({
      width: width(ttft), height: 220,
      scales: { x: { time: false, range: [-0.5, labels.length - 0.5] }, y: { range: function (u, min, max) { return [0, Math.max(0.1, max * 1.1)]; } } },
      axes: [P.categoryAxis(ttft, labels), { label: "s", size: 50 }],
      hooks: { drawClear: [function () { ttft.dataset.bars = "0"; }] },
      series: [{},
        Object.assign({ label: "current plan", stroke: CUR, fill: CUR, width: 1 }, P.groupedBars(ttft, 0, 2)),
        Object.assign({ label: "what-if", stroke: WHAT, fill: WHAT, width: 1 }, P.groupedBars(ttft, 1, 2))]
    }, [[0, 1, 2, 3], labels.map(function (k) { return c.ttft[k]; }), labels.map(function (k) { return w.ttft[k]; })], ttft);

    var links = document.getElementById("chart-links");
    var all = c.links.concat(w.links), step = all.length ? all[0].series_step_s || 1 : 1, n = 0;
    all.forEach(function (l) { n = Math.max(n, l.series_gbps.length); });
    var xs = []; for (var i = 0; i < n; i++) xs.push(i * step);
    function pad(a) { var out = a.slice(); while (out.length < n) out.push(null); return out; }
    var series = [{}], cols = [];
    c.links.forEach(function (l) { series.push({ label: l.key + " (current)", stroke: CUR, width: 1.5 }); cols.push(pad(l.series_gbps)); });
    w.links.forEach(function (l) { series.push({ label: l.key + " (what-if)", stroke: WHAT, width: 1.5 }); cols.push(pad(l.series_gbps)); });
    new uPlot({ width: width(links), height: 220, scales: { x: { time: false } }, axes: [P.durationAxis(links, "simulated time"), { label: "Gbps", size: 50 }], series: series }, [xs].concat(cols), links);

    var queue = document.getElementById("chart-queue");
    new uPlot({ width: width(queue), height: 200, scales: { x: { time: false } }, axes: [P.durationAxis(queue, "simulated time"), { label: "requests", size: 50 }],
      series: [{}, { label: "current plan", stroke: CUR, width: 1.5 }] }, [c.queue.t, c.queue.in_system], queue);
    var queue2 = document.createElement("div");
    queue2.className = "chart";
    queue.parentNode.appendChild(queue2);
    new uPlot({ width: width(queue), height: 200, scales: { x: { time: false } }, axes: [P.durationAxis(queue2, "simulated time"), { label: "requests", size: 50 }],
      series: [{}, { label: "what-if", stroke: WHAT, width: 1.5 }] }, [w.queue.t, w.queue.in_system], queue2);
  }

  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSwap", draw);
})();

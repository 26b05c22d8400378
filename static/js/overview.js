/* Overview: topology, links, queues, decision mix and alerts, kept live over the websocket. */
(function () {
  "use strict";
  var P = window.PrfaaS;
  var COLORS = ["#1f4f8a", "#0b6e4f", "#a4262c", "#8a5a00", "#5b3791", "#00708a", "#6b4f2a", "#c2185b"];
  var REASON_COLORS = {
    below_threshold: "#7d8da1", above_threshold: "#1f4f8a", link_congested: "#a4262c",
    prfaas_backlog: "#8a5a00", cache_affinity: "#0b6e4f", telemetry_stale: "#5b3791",
    prfaas_unavailable: "#c2185b"
  };
  var state = null;          // the last snapshot, updated by frames
  var linkSeries = {};       // link key -> Map(second -> Gbps)
  var queueHistory = [];     // [ts, {cluster: queued}]
  var instanceLoad = {};     // instance -> {queued, running}
  var linkChart = null, queueChart = null, inflightChart = null, dirty = false;

  function el(id) { return document.getElementById(id); }
  function esc(s) { var d = document.createElement("div"); d.textContent = s == null ? "" : String(s); return d.innerHTML; }
  function colorOf(i) { return COLORS[i % COLORS.length]; }
  function now() { return Date.now() / 1000; }

  function applySnapshot(snap) {
    state = snap;
    linkSeries = {};
    snap.links.forEach(function (l) {
      var m = new Map();
      l.series.forEach(function (p) { m.set(Math.floor(p[0]), p[1]); });
      if (l.ts) m.set(Math.floor(l.ts), l.gbps);
      linkSeries[l.key] = m;
    });
    instanceLoad = {};
    snap.clusters.forEach(function (c) {
      c.instances.forEach(function (i) {
        if (i.queued !== null) instanceLoad[i.name] = { queued: i.queued, running: i.running };
      });
    });
    pushQueuePoint(snap.ts);
    buildCharts();
    renderAll();
  }

  function clusterOfInstance() {
    var map = {};
    state.clusters.forEach(function (c) { c.instances.forEach(function (i) { map[i.name] = c.name; }); });
    return map;
  }

  function pushQueuePoint(ts) {
    var owner = clusterOfInstance(), sums = {};
    state.clusters.forEach(function (c) { sums[c.name] = 0; });
    Object.keys(instanceLoad).forEach(function (name) {
      var c = owner[name];
      if (c !== undefined) sums[c] += instanceLoad[name].queued;
    });
    state.clusters.forEach(function (c) { c.queued = sums[c.name]; });
    queueHistory.push([ts, sums]);
    var cutoff = now() - state.window_s;
    while (queueHistory.length && queueHistory[0][0] < cutoff) queueHistory.shift();
  }

  function chartWidth(node) { return Math.max(280, node.clientWidth || 600); }

  function buildCharts() {
    var lc = el("link-chart"), qc = el("queue-chart"), ic = el("inflight-chart");
    lc.innerHTML = ""; qc.innerHTML = ""; ic.innerHTML = "";
    var series = [{}], iseries = [{}];
    function gbps(u, v) { return v == null ? "–" : v.toFixed(2) + " Gbps"; }
    function gb(u, v) { return v == null ? "–" : v.toFixed(2) + " GB"; }
    state.links.forEach(function (l, i) {
      series.push({ label: l.label, stroke: colorOf(i), width: 2, spanGaps: true, value: gbps });
      series.push({ label: "budget", stroke: colorOf(i), width: 1, dash: [6, 4], value: gbps });
      series.push({ label: "capacity", stroke: colorOf(i), width: 1, dash: [2, 3], value: gbps });
      iseries.push({ label: l.label + " in flight", stroke: colorOf(i), width: 2, spanGaps: true, value: gb });
      iseries.push({ label: "in-flight budget", stroke: colorOf(i), width: 1, dash: [6, 4], value: gb });
    });
    // Auto-scaled: a degraded link's few Gbps stay readable; capacity and budget are lines.
    var auto = { range: function (u, min, max) { return [0, Math.max(0.1, (max || 0) * 1.08)]; } };
    // The window's last 15 minutes (a chart opened a moment ago still spans a minute).
    linkChart = new uPlot({
      width: chartWidth(lc), height: 220,
      scales: { x: P.clockScale(60), y: auto },
      axes: [P.clockAxis(lc), { label: "Gbps", size: 50 }],
      series: series
    }, linkData(), lc);
    inflightChart = new uPlot({
      width: chartWidth(ic), height: 200,
      scales: { x: P.clockScale(60), y: auto },
      axes: [P.clockAxis(ic), { label: "GB in flight", size: 50 }],
      series: iseries
    }, inflightData(), ic);
    var qseries = [{}];
    state.clusters.forEach(function (c, i) { qseries.push({ label: c.name, stroke: colorOf(i), width: 2 }); });
    queueChart = new uPlot({
      width: chartWidth(qc), height: 220,
      scales: { x: P.clockScale(60), y: { range: function (u, min, max) { return [0, Math.max(4, max * 1.1)]; } } },
      axes: [P.clockAxis(qc), { label: "queued", size: 50 }],
      series: qseries
    }, queueData(), qc);
  }

  function linkData() {
    var end = Math.floor(now()), start = end - state.window_s;
    var xs = [], cols = [], points = 0, last = 0;
    for (var t = start; t <= end; t++) xs.push(t);
    state.links.forEach(function (l) {
      var m = linkSeries[l.key] || new Map(), ys = [], bs = [], cs = [];
      for (var k = 0; k < xs.length; k++) {
        var v = m.has(xs[k]) ? m.get(xs[k]) : null;
        if (v !== null) { points++; last = Math.max(last, xs[k]); }
        ys.push(v); bs.push(l.budget_gbps); cs.push(l.capacity_gbps);
      }
      cols.push(ys, bs, cs);
    });
    var lc = el("link-chart");
    lc.dataset.points = String(points);
    lc.dataset.lastTs = String(last);
    return [xs].concat(cols);
  }

  function inflightData() {
    // The ticks' readings: [ts, in-flight bytes, budget bytes, capacity Gbps] per link.
    var times = {}, cutoff = now() - state.window_s;
    state.links.forEach(function (l) { (l.inflight || []).forEach(function (p) { if (p[0] >= cutoff) times[p[0]] = true; }); });
    var xs = Object.keys(times).map(Number).sort(function (a, b) { return a - b; });
    var cols = [], points = 0;
    state.links.forEach(function (l) {
      var at = {};
      (l.inflight || []).forEach(function (p) { at[p[0]] = p; });
      cols.push(xs.map(function (t) { if (at[t]) { points++; return at[t][1] / 1e9; } return null; }));
      cols.push(xs.map(function (t) { return at[t] ? at[t][2] / 1e9 : null; }));
    });
    var ic = el("inflight-chart");
    ic.dataset.points = String(points);
    return [xs].concat(cols);
  }

  function queueData() {
    var xs = queueHistory.map(function (p) { return p[0]; });
    var cols = state.clusters.map(function (c) {
      return queueHistory.map(function (p) { return p[1][c.name] === undefined ? null : p[1][c.name]; });
    });
    el("queue-chart").dataset.points = String(xs.length);
    return [xs].concat(cols);
  }

  function redraw() {
    if (!dirty || !state) return;
    dirty = false;
    if (linkChart) linkChart.setData(linkData());
    if (queueChart) queueChart.setData(queueData());
    if (inflightChart) inflightChart.setData(inflightData());
    renderAll();
  }

  function renderService() {
    var levels = (state.service && state.service.clusters) || [];
    el("service-rows").innerHTML = levels.map(function (c) {
      var verdict = c.ttft_p90_s == null ? "no first token yet" : (c.ttft_p90_s <= c.slo_s ? "P90 within SLO" : "P90 over SLO");
      return '<tr data-cluster="' + esc(c.cluster) + '" data-start="' + c.start + '" data-end="' + c.end + '"><th scope="row">' + esc(c.cluster) + "</th>" +
        '<td class="num" data-metric="rate">' + P.fmt(c.rate_rps, 2) + "</td>" +
        '<td class="num" data-metric="p50">' + P.fmt(c.ttft_p50_s, 3) + "</td>" +
        '<td class="num" data-metric="p90">' + P.fmt(c.ttft_p90_s, 3) + "</td>" +
        '<td class="num" data-metric="p99">' + P.fmt(c.ttft_p99_s, 3) + "</td>" +
        '<td class="num">' + P.fmt(c.slo_s, 1) + "</td><td>" + esc(verdict) + "</td></tr>";
    }).join("") || '<tr><td colspan="7" class="empty">No engine has reported service counters yet.</td></tr>';
  }

  function renderAll() {
    renderService(); renderLinks(); renderMix(); renderTopology(); renderAlerts(); renderKpis();
    P.text(el("policy-version"), state.policy.version ? "v" + state.policy.version : "none yet");
  }

  function renderLinks() {
    var html = state.links.map(function (l) {
      var u = l.capacity_gbps > 0 ? l.gbps / l.capacity_gbps : 0;
      var budget = l.capacity_gbps > 0 ? l.budget_gbps / l.capacity_gbps : 0;
      return '<div class="link-row" data-link="' + esc(l.key) + '"><div><strong>' + esc(l.label) + '</strong><br><small class="muted">' +
        P.fmt(l.rtt_ms, 0) + " ms RTT</small></div>" +
        '<div class="meter' + (u >= budget ? " hot" : "") + '" role="meter" aria-valuemin="0" aria-valuemax="' + l.capacity_gbps +
        '" aria-valuenow="' + P.fmt(l.gbps, 2) + '" aria-label="' + esc(l.label) + ' egress"><span style="width:' + Math.min(100, 100 * u).toFixed(1) +
        '%"></span><i class="budget" style="left:' + (100 * budget).toFixed(1) + '%" title="budget"></i></div>' +
        '<div class="mono link-gbps">' + P.fmt(l.gbps, 2) + " / " + P.fmt(l.capacity_gbps, 0) + " Gbps</div>" +
        '<div class="mono link-inflight' + (l.kv_budget_bytes > 0 && l.reserved_bytes >= 0.9 * l.kv_budget_bytes ? " hot" : "") + '">in flight ' +
        P.fmt(l.reserved_bytes / 1e9, 2) + " / " + P.fmt(l.kv_budget_bytes / 1e9, 2) + " GB</div>" + guardLine(l) + "</div>";
    }).join("");
    el("link-rows").innerHTML = html || '<p class="empty">No links in the inventory.</p>';
  }

  // The share of the offloads offered to the link that its guard kept local, and why, over
  // the traffic store's last whole minutes, next to what the plan in force predicted.
  function guardLine(l) {
    var g = l.guard;
    if (!g) return '<p class="link-guard muted">No traffic counted for this link yet.</p>';
    var refused = g.refused_budget + g.refused_saturation, offered = g.offloads + refused;
    var share = offered ? P.pct(refused / offered) : "–";
    var predicted = g.predicted_refused_share == null ? "none yet" : P.pct(g.predicted_refused_share);
    return '<p class="link-guard" data-link-guard="' + esc(l.key) + '" data-refused="' + refused + '" data-offered="' + offered + '">' +
      "Kept local by the link guard, last " + P.fmt(g.window_s, 0) + " s: <strong>" + share + "</strong> of " + offered + " offloads offered" +
      " (budget " + g.refused_budget + ", saturation " + g.refused_saturation + ")" +
      ' · <span class="muted">plan predicted: ' + predicted + "</span></p>";
  }

  function renderMix() {
    var rows = state.decision_mix.map(function (m) {
      var total = 0, parts = "", legend = "";
      Object.keys(m.reasons).forEach(function (r) { total += m.reasons[r]; });
      Object.keys(m.reasons).sort().forEach(function (r) {
        var c = REASON_COLORS[r] || "#9aa7b8", share = total ? m.reasons[r] / total : 0;
        parts += '<span style="width:' + (100 * share).toFixed(1) + "%;background:" + c + '" title="' + esc(r) + '"></span>';
        legend += '<span class="reason-item"><span class="swatch" style="background:' + c + '"></span>' + esc(r) + " " + m.reasons[r] + "</span>";
      });
      var t = m.threshold == null ? "–" : P.fmt(m.threshold, 0);
      if (m.effective_threshold != null && m.threshold != null && m.effective_threshold !== m.threshold) {
        t += " → " + P.fmt(m.effective_threshold, 0);
      }
      return "<tr class=\"mix-main\"><th scope=\"row\">" + esc(m.cluster) + '</th><td class="num">' + m.arrivals + '</td><td class="num">' +
        P.pct(m.offload_rate) + '</td><td class="num">' + t + "</td></tr>" +
        '<tr class="reasons-row"><td colspan="4"><div class="reason-bar" aria-hidden="true">' + parts +
        '</div><div class="reason-legend">' + (legend || "no traffic") + "</div></td></tr>";
    }).join("");
    el("mix-rows").innerHTML = rows || '<tr><td colspan="4" class="empty">No PD clusters.</td></tr>';
    if (state.decision_mix.length) P.text(el("mix-window"), P.fmt(state.decision_mix[0].window_s, 0));
  }

  function renderTopology() {
    var sites = {};
    state.clusters.forEach(function (c) { (sites[c.site] = sites[c.site] || []).push(c); });
    el("topology").innerHTML = Object.keys(sites).sort().map(function (s) {
      return '<div class="site"><h3>' + esc(s) + "</h3>" + sites[s].map(function (c) {
        return '<div class="cluster-box"><span class="name">' + esc(c.name) + '</span> <span class="badge badge-' + esc(c.kind) + '">' +
          esc(c.kind) + "</span><br><small>" + esc(c.accelerator) + " · " + c.prefill + " P / " + c.decode + " D · " +
          c.active + " active · queue <strong>" + c.queued + "</strong></small></div>";
      }).join("") + "</div>";
    }).join("") || '<p class="empty">No clusters in the inventory.</p>';
  }

  function renderAlerts() {
    el("alerts").innerHTML = state.alerts.map(function (a) {
      return '<li class="alert alert-' + esc(a.code) + '"><span class="code">' + esc(a.code) + "</span>" + esc(a.message) + "</li>";
    }).join("") || '<li class="empty">No alerts.</li>';
  }

  function renderKpis() {
    var arrivals = 0, offloads = 0, egress = 0, pq = 0;
    state.decision_mix.forEach(function (m) { arrivals += m.arrivals; offloads += m.offloads; });
    state.links.forEach(function (l) { egress += l.gbps; });
    state.clusters.forEach(function (c) { if (c.kind === "prfaas") pq += c.queued; });
    P.text(el("kpi-offload"), arrivals ? P.pct(offloads / arrivals) : "–");
    P.text(el("kpi-egress"), P.fmt(egress, 1));
    P.text(el("kpi-prfaas-queue"), String(pq));
    P.text(el("kpi-alerts"), String(state.alerts.length));
  }

  var handlers = {
    snapshot: function (data) { applySnapshot(data); },
    link_samples: function (batch) {
      batch.samples.forEach(function (d) {
        if (!linkSeries[d.link]) return;
        linkSeries[d.link].set(Math.floor(d.ts), d.gbps);
        state.links.forEach(function (l) {
          if (l.key === d.link && (!l.ts || d.ts >= l.ts)) { l.gbps = d.gbps; l.ts = d.ts; l.utilisation = l.capacity_gbps ? d.gbps / l.capacity_gbps : 0; }
        });
      });
      dirty = true;
    },
    queue_depths: function (d) {
      d.instances.forEach(function (i) { instanceLoad[i.instance] = { queued: i.queued, running: i.running }; });
      pushQueuePoint(d.ts);
      dirty = true;
    },
    decision_mix: function (d) {
      var found = false;
      state.decision_mix = state.decision_mix.map(function (m) { if (m.cluster === d.cluster) { found = true; return d; } return m; });
      if (!found) state.decision_mix.push(d);
      dirty = true;
    },
    alerts: function (d) { state.alerts = d.alerts; dirty = true; },
    service_levels: function (d) { state.service = d; dirty = true; },
    link_budgets: function (d) {
      var cutoff = now() - state.window_s;
      d.links.forEach(function (b) {
        state.links.forEach(function (l) {
          if (l.key !== b.link) return;
          l.capacity_gbps = b.capacity_gbps; l.budget_gbps = b.egress_budget_gbps;
          l.kv_budget_bytes = b.budget_bytes; l.reserved_bytes = b.inflight_bytes;
          l.guard = {
            window_s: b.guard_window_s, offloads: b.offloads, refused_budget: b.refused_budget,
            refused_saturation: b.refused_saturation, predicted_refused_share: b.predicted_refused_share
          };
          l.inflight = (l.inflight || []).filter(function (p) { return p[0] >= cutoff; });
          l.inflight.push([d.ts, b.inflight_bytes, b.budget_bytes, b.capacity_gbps]);
        });
      });
      dirty = true;
    },
    policy_event: function (d) { state.policy.version = d.version; state.policy.thresholds = d.thresholds; dirty = true; }
  };

  document.addEventListener("DOMContentLoaded", function () {
    applySnapshot(JSON.parse(el("overview-snapshot").textContent));
    new P.LiveSocket("overview", handlers);
    // Slide the window once a second even when nothing arrives; draw at most 4 times a second.
    window.setInterval(function () { dirty = true; }, 1000);
    window.setInterval(redraw, 250);
    window.addEventListener("resize", function () {
      if (linkChart) linkChart.setSize({ width: chartWidth(el("link-chart")), height: 220 });
      if (queueChart) queueChart.setSize({ width: chartWidth(el("queue-chart")), height: 220 });
      if (inflightChart) inflightChart.setSize({ width: chartWidth(el("inflight-chart")), height: 200 });
    });
  });
})();

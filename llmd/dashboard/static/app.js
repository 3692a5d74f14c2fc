// llmd dashboard: polls /dashboard/api/overview every 2 s (only new chart points after the
// first poll) and draws with the vendored uPlot. No framework, no inline script (the page's CSP).
(() => {
  "use strict";
  const POLL_MS = 2000, KEEP = 300;
  const COLORS = ["#1570ef", "#f79009", "#12b76a", "#d92d20", "#7a5af8", "#0ba5ec", "#ee46bc", "#667085"];
  const $ = (s) => document.querySelector(s);
  const state = { since: null, points: [], charts: {}, keys: {}, timer: null, last: null };
  window.llmdDashboard = state; // read by the browser test: the charts and the data they hold

  const fmt = (v, d = 2) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : typeof v !== "number" ? String(v)
    : Number.isInteger(v) ? String(v) : Math.abs(v) >= 1000 ? v.toFixed(0) : Math.abs(v) < 0.01 ? v.toPrecision(3) : v.toFixed(d);
  const ms = (v) => (v === null || v === undefined) ? "–" : (v * 1000).toFixed(1) + " ms";
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

  function table(el, head, rows) {
    el.innerHTML = "<thead><tr>" + head.map((h) => `<th>${esc(h)}</th>`).join("") + "</tr></thead><tbody>" +
      (rows.length ? rows.map((r) => "<tr>" + r.map((c) => typeof c === "object" && c !== null && "html" in c ?
        `<td class="${c.cls || ""}">${c.html}</td>` : `<td class="${typeof c === "number" ? "num" : ""}">${esc(typeof c === "number" ? fmt(c, 3) : c)}</td>`).join("") + "</tr>").join("")
        : `<tr><td colspan="${head.length}" class="muted">none</td></tr>`) + "</tbody>";
  }

  // -- charts -------------------------------------------------------------------------------
  function models() {
    const set = new Set();
    for (const p of state.points) for (const m of Object.keys(p.models || {})) set.add(m);
    for (const m of Object.keys((state.last && state.last.models) || {})) set.add(m);
    return [...set].sort();
  }

  function specs() {
    const ms_ = models(), pts = state.points, x = pts.map((p) => p.t);
    const col = (f) => pts.map((p) => { const v = f(p); return v === undefined ? null : v; });
    const slo = (m, k) => { const s = state.last && state.last.models[m] && state.last.models[m].slo; return s ? s[k] : null; };
    const out = {};
    for (const [name, key, sloKey] of [["ttft", "ttft", "ttft_p95_s"], ["itl", "itl", "itl_p95_s"]]) {
      const series = [], data = [x];
      for (const m of ms_) {
        series.push({ label: `${m} p50` }); data.push(col((p) => p[key][m] ? p[key][m][0] : null));
        series.push({ label: `${m} p95` }); data.push(col((p) => p[key][m] ? p[key][m][1] : null));
        const target = slo(m, sloKey);
        if (target !== null && target !== undefined) { series.push({ label: `${m} SLO p95`, dash: [6, 4] }); data.push(x.map(() => target)); }
      }
      out[name] = { series, data };
    }
    out.throughput = { series: [{ label: "requests/s" }, { label: "output tok/s", scale: "tok" }, { label: "prompt tok/s", scale: "tok" }],
      data: [x, col((p) => p.rps), col((p) => p.output_tps), col((p) => p.prompt_tps)] };
    const q = { series: [], data: [x] }, run = { series: [], data: [x] }, kv = { series: [], data: [x] };
    for (const m of ms_) {
      const classes = new Set();
      for (const p of pts) if (p.models[m]) for (const c of Object.keys(p.models[m].queue)) classes.add(c);
      for (const c of [...classes].sort()) { q.series.push({ label: `${m} ${c}` }); q.data.push(col((p) => p.models[m] ? p.models[m].queue[c] : null)); }
      run.series.push({ label: `${m} running` }); run.data.push(col((p) => p.models[m] ? p.models[m].running : null));
      run.series.push({ label: `${m} seats`, dash: [6, 4] }); run.data.push(col((p) => p.models[m] ? p.models[m].seat_limit : null));
      kv.series.push({ label: `${m} KV` }); kv.data.push(col((p) => p.models[m] ? p.models[m].kv : null));
      kv.series.push({ label: `${m} prefix hit` }); kv.data.push(col((p) => p.models[m] ? p.models[m].prefix_hit : null));
    }
    out.queue = q; out.running = run; out.kv = kv;
    out.events = { series: [{ label: "preempted" }, { label: "shed" }, { label: "dropped" }, { label: "filtered" }],
      data: [x, col((p) => Object.values(p.models).reduce((a, g) => a + (g.preempted || 0), 0)), col((p) => p.shed), col((p) => p.dropped), col((p) => p.filtered)] };
    const cost = state.last && state.last.cost;
    if (cost && cost.models.length) {  // the last 24 h by hour: GPU-hours x [cost] prices over the tokens served
      const hours = [...new Set(cost.models.flatMap((m) => m.buckets.map((b) => b.start)))].sort((a, b) => a - b);
      const c = { series: [], data: [hours], points: true };
      for (const m of cost.models) {
        const at = new Map(m.buckets.map((b) => [b.start, b])), name = `${m.model}@${m.version.slice(0, 8)}`;
        c.series.push({ label: `${name} per M output` }); c.data.push(hours.map((h) => at.get(h)?.cost_per_m_output ?? null));
        c.series.push({ label: `${name} per M total`, dash: [6, 4] }); c.data.push(hours.map((h) => at.get(h)?.cost_per_m_total ?? null));
      }
      out.cost = c;
    }
    return out;
  }

  function width(el) { return Math.max(240, el.clientWidth || 300); }

  function draw() {
    const all = specs();
    for (const [name, spec] of Object.entries(all)) {
      const el = $(`#c-${name}`), key = spec.series.map((s) => s.label).join("|");
      let chart = state.charts[name];
      if (!chart || state.keys[name] !== key) {
        if (chart) chart.destroy();
        el.textContent = "";
        const scales = { x: { time: true } };
        if (spec.series.some((s) => s.scale === "tok")) scales.tok = {};
        const axes = [{}, { size: 50 }];
        if (scales.tok) axes.push({ scale: "tok", side: 1, grid: { show: false }, size: 50 });
        chart = new uPlot({
          width: width(el), height: 200, scales, axes, legend: { live: false },
          series: [{}].concat(spec.series.map((s, i) => ({ label: s.label, scale: s.scale || "y", dash: s.dash,
            stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
            points: spec.points ? { show: true, size: 6 } : undefined }))),
        }, spec.data, el);
        state.charts[name] = chart; state.keys[name] = key;
      } else {
        chart.setData(spec.data);
      }
    }
  }

  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(state.charts)) chart.setSize({ width: width($(`#c-${name}`)), height: 200 });
  });

  // -- tables and tiles ---------------------------------------------------------------------
  function render(d) {
    const p = state.points[state.points.length - 1];
    $("#t-rps").textContent = p ? fmt(p.rps) : "–";
    $("#t-tps").textContent = p ? fmt(p.output_tps, 1) : "–";
    $("#t-flight").textContent = d.in_flight;
    const st = d.statuses || {};
    $("#t-done").textContent = Object.values(st).reduce((a, b) => a + b, 0);
    $("#t-errors").textContent = Object.entries(st).filter(([k]) => k !== "ok").reduce((a, [, n]) => a + n, 0);
    $("#t-spend").textContent = fmt(Object.values(d.spend_today).reduce((a, b) => a + b, 0), 4);

    const over = (v, m, k) => { const s = d.models[m] && d.models[m].slo; return s && s[k] != null && v != null && v > s[k]; };
    table($("#tbl-latency"), ["model", "tenant", "samples", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "SLO (TTFT / ITL p95)"],
      d.latency.map((r) => { const s = d.models[r.model] && d.models[r.model].slo;
        return [r.model, r.tenant, r.requests, ms(r.ttft_p50), { html: esc(ms(r.ttft_p95)), cls: over(r.ttft_p95, r.model, "ttft_p95_s") ? "bad" : "" },
          ms(r.itl_p50), { html: esc(ms(r.itl_p95)), cls: over(r.itl_p95, r.model, "itl_p95_s") ? "bad" : "" },
          s ? `${ms(s.ttft_p95_s)} / ${ms(s.itl_p95_s)}` : "not set"]; }));
    const mrows = [];
    for (const [m, g] of Object.entries(d.models)) {
      const split = g.versions.map((v) => `${v.version.slice(0, 12)} ${(v.weight * 100).toFixed(0)}%${v.state ? " (" + v.state + ")" : ""}`).join(", ") || "–";
      mrows.push([m, g.engine || (g.ready ? "up" : "loading"), g.running ?? "–", g.seat_limit ?? "–",
        g.kv_usage != null ? (g.kv_usage * 100).toFixed(1) + "%" : "–", g.prefix_hit_rate != null ? (g.prefix_hit_rate * 100).toFixed(1) + "%" : "–",
        g.preemptions ?? 0, g.restarts, split]);
    }
    table($("#tbl-models"), ["model", "engine", "running", "seats", "KV", "prefix hit", "preempted", "restarts", "versions: share"], mrows);
    table($("#tbl-spend"), ["tenant", "spend"], Object.entries(d.spend_today).map(([t, c]) => [t, c]));
    table($("#tbl-prices"), ["model", "spend", "per M total tokens", "per M output tokens"],
      Object.entries(d.prices).map(([m, c]) => [m, c.cost, c.per_mtok_total, c.per_mtok_output]));
    $("#cost-panel").hidden = !d.cost;
    $("#cost-chart-card").hidden = !(d.cost && d.cost.models.length);
    if (d.cost) {  // the last 24 hours: GPU-hours x [cost] prices over the tokens served, per model and version
      const c = d.cost, money = (x) => (x == null ? "–" : `${fmt(x, 4)} ${c.currency}`);
      const row = (label, t) => [label, t.gpu_hours ?? "–", money(t.cost), t.output_tokens, t.total_tokens,
        money(t.cost_per_m_output), money(t.cost_per_m_total), t.busy_fraction != null ? (t.busy_fraction * 100).toFixed(1) + "%" : "–"];
      table($("#tbl-cost"), ["model@version (24 h)", "GPU-hours", "cost", "output tokens", "total tokens",
        "per M output", "per M total", "busy"],
        [...c.models.map((m) => row(`${m.model}@${m.version.slice(0, 12)}`, m.total)), row("all priced", c.total)]);
    }
    const reasons = [];
    for (const [kind, src] of [["shed", d.shed], ["deadline drop", d.dropped], ["filter stop", d.filtered]])
      for (const [why, n] of Object.entries(src)) reasons.push([kind, why, n]);
    table($("#tbl-reasons"), ["kind", "reason", "count"], reasons);
    table($("#tbl-batches"), ["batch", "tenant", "model", "status", "done", "failed", "total"],
      d.batches.map((b) => [b.id, b.tenant, b.model || "–", b.status, b.completed ?? 0, b.failed ?? 0, b.total ?? 0]));
    $("#cluster-card").hidden = !d.cluster;
    if (d.cluster) table($("#tbl-cluster"), ["member", "state", "queued", "running", "KV free", "heard (s ago)"],
      d.cluster.members.map((m) => [m.name, m.state, m.queued ?? "–", m.versions.reduce((a, v) => a + v.running, 0),
        m.versions.map((v) => `${v.model}: ${v.kv_free_tokens}/${v.kv_capacity_tokens}`).join(", ") || "–", m.age_s ?? "–"]));
    table($("#tbl-recent"), ["request", "model", "tenant", "status", "TTFT", "tokens"],
      d.recent.slice(0, 15).map((r) => [{ html: `<a class="rid" data-id="${esc(r.request_id)}">${esc(r.client_request_id || r.request_id)}</a>` },
        r.model, r.tenant, r.status, ms(r.ttft_s), r.output_tokens ?? 0]));
  }

  // -- polling and auth ---------------------------------------------------------------------
  function show(which) {
    $("#login").hidden = which !== "login";
    $("#board").hidden = which !== "board";
  }

  async function poll() {
    clearTimeout(state.timer);
    try {
      const r = await fetch("/dashboard/api/overview" + (state.since !== null ? `?since=${state.since}` : ""), { credentials: "same-origin" });
      if (r.status === 401 || r.status === 403) {
        const body = await r.json();
        show("login"); $("#login-error").textContent = state.since === null && r.status === 401 ? "" : body.error.message;
        $("#status").textContent = "signed out"; return;
      }
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const d = await r.json();
      state.last = d;
      for (const p of d.points) state.points.push(p);
      if (state.points.length > KEEP) state.points.splice(0, state.points.length - KEEP);
      if (d.points.length) state.since = d.points[d.points.length - 1].t; else if (state.since === null) state.since = 0;
      show("board"); $("#logout").hidden = false;
      render(d); draw();
      $("#status").textContent = "updated " + new Date(d.now * 1000).toLocaleTimeString();
    } catch (e) {
      $("#status").textContent = "unreachable: " + e.message;
      console.error("dashboard poll failed:", e); // a bug in this page shows in the console (and fails the test)
    }
    state.timer = setTimeout(poll, POLL_MS);
  }

  $("#login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const r = await fetch("/dashboard/login", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ key: $("#login-key").value }), credentials: "same-origin" });
    if (r.ok) { $("#login-key").value = ""; $("#login-error").textContent = ""; state.since = null; state.points = []; poll(); }
    else { const body = await r.json(); $("#login-error").textContent = body.error.message; }
  });
  $("#logout").addEventListener("click", async () => {
    await fetch("/dashboard/logout", { method: "POST", credentials: "same-origin" });
    clearTimeout(state.timer); location.reload();
  });

  // -- inspector ----------------------------------------------------------------------------
  async function inspect(id) {
    $("#inspect-error").textContent = ""; $("#inspect-result").textContent = "";
    const r = await fetch("/dashboard/api/requests/" + encodeURIComponent(id), { credentials: "same-origin" });
    const d = await r.json();
    if (!r.ok) { $("#inspect-error").textContent = d.error.message; return; }
    const end = Math.max(...d.stages.map((s) => s.at_s), 1e-6);
    const stages = d.stages.map((s) => `<div class="stage" data-stage="${esc(s.stage)}"><span>${esc(s.stage.replace("_", " "))}</span>` +
      `<div class="bar"><span style="left:${(s.at_s / end * 100).toFixed(1)}%"></span></div><span>${esc(ms(s.at_s))}</span></div>` +
      (s.detail ? `<div class="stage"><span></span><small>${esc(s.detail)}</small><span></span></div>` : "")).join("");
    const facts = [["request id", d.request_id], ["client id", d.client_request_id], ["status", d.status + (d.http_status ? ` (${d.http_status})` : "")],
      ["error", d.error_code], ["finish", d.finish_reason], ["model", d.model], ["version", d.version], ["tenant", d.tenant],
      ["class", d.priority_class], ["node / replica", d.replica], ["prompt tokens", d.prompt_tokens], ["cached tokens", d.cached_tokens],
      ["output tokens", d.output_tokens], ["ITL mean", ms(d.itl_mean_s)], ["ITL p95", ms(d.itl_p95_s)], ["preemptions", d.preemptions],
      ["resumed", d.resumed], ["filter", d.filter], ["redacted", d.redacted], ["degraded", d.degraded], ["decision", d.decision], ["cost", d.cost]];
    $("#inspect-result").innerHTML = `<div class="timeline">${stages}</div><div class="facts">` +
      facts.map(([k, v]) => `<div><span>${esc(k)}</span><span data-fact="${esc(k)}">${esc(v ?? "–")}</span></div>`).join("") + "</div>";
  }
  $("#inspect-form").addEventListener("submit", (ev) => { ev.preventDefault(); inspect($("#inspect-id").value.trim()); });
  $("#tbl-recent").addEventListener("click", (ev) => {
    const a = ev.target.closest("a.rid"); if (!a) return;
    $("#inspect-id").value = a.dataset.id; inspect(a.dataset.id);
  });

  // Ask first whether this browser is signed in: a page that polled blind would log a 401.
  fetch("/dashboard/session", { credentials: "same-origin" }).then((r) => r.json()).then((s) => {
    if (s.ok) poll(); else { show("login"); $("#status").textContent = "signed out"; }
  }).catch((e) => { $("#status").textContent = "unreachable: " + e.message; });
})();

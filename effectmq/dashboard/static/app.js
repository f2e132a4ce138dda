// EffectMQ dashboard: live updates and actions. The server renders every page; this
// script polls the page's JSON twin (body data-api) and updates the page in place, and
// posts actions with the header that proves they come from this page (see auth.py).
// Text enters the DOM only through textContent: names and ids are user data.
"use strict";

(function () {
  const body = document.body;
  const PAGE = body.dataset.page;
  const API = body.dataset.api;
  const POLL_MS = Number(body.dataset.pollMs || 2000);
  const ACTION_HEADER = body.dataset.actionHeader;
  const CAN_ACT = body.dataset.canAct === "1";
  const STATES = ["waiting", "delayed", "active", "completed", "failed", "canceled"];
  const charts = new Map(); // queue name -> uPlot

  // -- small helpers -------------------------------------------------------------------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("data-")) el.setAttribute(k, v);
      else el.setAttribute(k, v);
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  const enc = encodeURIComponent;
  const byData = (root, attr, value) => root.querySelector(`[${attr}="${CSS.escape(value)}"]`);
  const when = (v) => (v ? String(v).replace("T", " ").slice(0, 19) : "-");
  const pct = (v) => (v === null || v === undefined ? "-" : (v * 100).toFixed(1) + "%");
  const pretty = (v) => JSON.stringify(v, null, 2);
  function setText(root, field, text) {
    const el = root.querySelector(`[data-field="${field}"]`);
    if (el && el.textContent !== String(text)) el.textContent = text;
  }

  function banner(text) {
    const el = document.getElementById("banner");
    if (!el) return;
    el.hidden = !text;
    el.textContent = text || "";
    document.getElementById("live")?.classList.toggle("down", Boolean(text));
  }

  function renderNotes(notes) { // what Redis's INFO says about it taking new tasks
    const el = document.getElementById("redis-notes");
    if (!el) return;
    el.replaceChildren(...notes.map((note) => h("li", { text: note })));
    el.hidden = notes.length === 0;
  }

  let toastTimer = null;
  function toast(text, kind) {
    const el = document.getElementById("toast");
    el.textContent = text;
    el.className = "toast " + (kind || "ok");
    el.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { el.hidden = true; }, kind === "error" ? 9000 : 4000);
  }

  // -- charts (uPlot, vendored) -------------------------------------------------------

  // Stacked bars per minute: a red bar of everything settled, the completed part drawn
  // over it in green, so the red that shows is the failed part.
  function drawChart(el, series) {
    if (!window.uPlot || !el) return;
    const settled = series.completed.map((c, i) => c + series.failed[i]);
    const data = [series.t, settled, series.completed];
    const name = el.dataset.chart;
    const existing = charts.get(name);
    if (existing && existing.root.isConnected) { existing.setData(data); return; }
    const wide = el.classList.contains("wide");  // the queue page's larger chart
    const bars = window.uPlot.paths.bars({ size: [0.75, 14], align: 0 });
    const axis = { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e5e7eb" } };
    const opts = {
      width: Math.max(240, el.clientWidth || 320), height: wide ? 190 : 120,
      legend: { show: false },
      cursor: { drag: { x: false, y: false }, points: { show: false } },
      scales: {
        x: { time: true, range: (u, min, max) => [min - 45, max + 45] },
        y: { range: (u, min, max) => [0, Math.max(4, Math.ceil(max * 1.15))] },
      },
      axes: [{ ...axis, size: 30 }, { ...axis, size: 40, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] }],
      series: [
        {},
        { label: "failed / min", stroke: "#dc2626", fill: "rgba(220,38,38,0.75)", width: 0, paths: bars,
          points: { show: false }, value: (u, v, si, i) => (i === null || i === undefined ? "-" : u.data[1][i] - u.data[2][i]) },
        { label: "completed / min", stroke: "#16a34a", fill: "rgba(22,163,74,0.75)", width: 0, paths: bars,
          points: { show: false } },
      ],
    };
    el.textContent = "";
    charts.set(name, new window.uPlot(opts, data, el));
  }

  // -- queues: counts, facts, charts -------------------------------------------------

  function updateCounts(root, q) {
    for (const state of STATES) {
      const n = root.querySelector(`[data-count="${state}"] .n`);
      if (n && n.textContent !== String(q.counts[state])) n.textContent = q.counts[state];
    }
    const poison = root.querySelector('[data-count="poison"] .n');  // the queue page's poison tab
    if (poison && q.poison !== undefined && poison.textContent !== String(q.poison)) poison.textContent = q.poison;
    const parked = root.querySelector('[data-count="parked"] .n');  // the queue page's parked tab
    if (parked && q.parked !== undefined && parked.textContent !== String(q.parked)) parked.textContent = q.parked;
  }

  function updateFacts(root, q) {
    setText(root, "oldest_waiting", q.oldest_waiting);
    setText(root, "worker_count", q.worker_count);
    setText(root, "in_flight", `${q.in_flight} / ${q.concurrency}`);
    setText(root, "max_active", q.max_active === null ? "unlimited" : q.max_active);
    setText(root, "rate_limit", q.rate_limit);
    setText(root, "failure_rate", pct(q.failure_rate));
    setText(root, "settled", `${q.completed_last_hour} ok · ${q.failed_last_hour} failed`);
    for (const el of root.querySelectorAll('[data-field="paused"]')) el.hidden = !q.paused;
  }

  function queueCard(q) {
    const link = `/queues/${enc(q.name)}`;
    return h("section", { class: "card queue-card", "data-queue": q.name },
      h("div", { class: "card-head" },
        h("h2", {}, h("a", { href: link, text: q.name })),
        h("span", { class: "badges" },
          h("span", { class: "badge paused", "data-field": "paused", hidden: q.paused ? null : "" }, "paused"),
          q.sensitive ? h("span", { class: "badge sensitive" }, "sensitive") : null)),
      h("div", { class: "counts" }, STATES.map((s) =>
        h("a", { class: `count s-${s}`, "data-count": s, href: `${link}?state=${s}` },
          h("span", { class: "n", text: q.counts[s] }), h("span", { class: "label", text: s })))),
      h("div", { class: "chart", "data-chart": q.name }),
      h("p", { class: "chart-caption" }, "settled per minute, last hour: ", h("span", { class: "c", text: "■ completed" }),
        " ", h("span", { class: "f", text: "■ failed" })),
      h("dl", { class: "facts" }, [
        ["oldest waiting", "oldest_waiting"], ["workers", "worker_count"], ["in flight", "in_flight"],
        ["max active", "max_active"], ["rate limit", "rate_limit"], ["failure rate (1 h)", "failure_rate"],
        ["settled (1 h)", "settled"],
      ].map(([label, field]) => h("div", {}, h("dt", { text: label }), h("dd", { "data-field": field })))));
  }

  function renderOverview(data) {
    const grid = document.getElementById("queues");
    const names = data.queues.map((q) => q.name);
    const shown = [...grid.querySelectorAll("[data-queue]")].map((el) => el.dataset.queue);
    if (names.join("\n") !== shown.join("\n")) {
      grid.textContent = "";
      charts.clear();
      for (const q of data.queues) grid.append(queueCard(q));
      document.getElementById("no-queues")?.remove();
      const count = document.getElementById("queue-count");
      if (count) count.textContent = names.length;
    }
    for (const q of data.queues) {
      const card = byData(grid, "data-queue", q.name);
      updateCounts(card, q);
      updateFacts(card, q);
      drawChart(card.querySelector("[data-chart]"), q.throughput);
    }
  }

  // -- one queue: tabs, facts, the task list --------------------------------------------

  function actionButton(label, url, extra) {
    return h("button", { class: "act small " + (extra?.cls || ""), "data-action": url, "data-confirm": extra?.confirm }, label);
  }

  function taskRow(queue, t) {
    const base = `/api/queues/${enc(queue)}/tasks/${enc(t.task_id)}`;
    const cells = [
      h("td", { class: "id" }, h("a", { href: `/queues/${enc(queue)}/tasks/${enc(t.task_id)}`, text: t.task_id })),
      h("td", { text: t.name }),
      h("td", { class: "group", text: t.group === null ? "" : t.group }),
      h("td", {}, h("span", { class: `state s-${t.state}`, text: t.state })),
      h("td", { class: "num", text: t.attempt }),
      h("td", { class: "num", text: t.handler_failure_count }),
      h("td", { class: "num", text: t.stalled_attempt_count }),
      h("td", { class: "err" }, t.error ? [h("span", { class: "tag", text: t.error.tag }), " ",
        h("span", { class: "message", text: t.error.message })] : null),
      h("td", { class: "time", text: when(t.created_at) }),
      h("td", { class: "time", text: when(t.finished_at) }),
    ];
    if (CAN_ACT) {
      cells.push(h("td", { class: "row-actions" },
        ["failed", "canceled"].includes(t.state) ? actionButton("Retry", base + "/retry") : null,
        ["waiting", "delayed", "active"].includes(t.state)
          ? actionButton("Cancel", base + "/cancel", { cls: "danger-outline", confirm: "Cancel this task?" }) : null));
    }
    return h("tr", { "data-task": t.task_id }, cells);
  }

  function renderQueue(data) {
    const q = data.queue;
    document.querySelectorAll(`[data-queue="${CSS.escape(q.name)}"]`).forEach((root) => {
      updateCounts(root, q);
      updateFacts(root, q);
    });
    document.querySelectorAll("[data-show-when]").forEach((el) => {
      el.hidden = (el.dataset.showWhen === "paused") !== q.paused;
    });
    drawChart(document.querySelector("[data-chart]"), q.throughput);
    const tbody = document.querySelector("#tasks tbody");
    const rows = data.tasks.map((t) => taskRow(q.name, t));
    tbody.replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" },
      h("td", { colspan: 11, text: data.search ? "No task with this id." : `No ${data.state} tasks.` }))]));
    const p = data.page;
    const pager = document.getElementById("pager");
    const inGroup = data.state === "parked" && data.group !== null && data.group !== undefined ? `&group=${enc(data.group)}` : "";
    const link = (offset, label) => h("a", { href: `/queues/${enc(q.name)}?state=${data.state}${inGroup}&offset=${offset}&limit=${p.limit}`, text: label });
    pager.replaceChildren(
      h("span", { text: `${Math.min(p.total, p.offset + 1)}–${Math.min(p.total, p.offset + p.limit)} of ${p.total}` }),
      ...(p.previous !== null ? [link(p.previous, "← newer")] : []), ...(p.next !== null ? [link(p.next, "older →")] : []));
  }

  function renderGroups(queue, groups) {
    const tbody = document.querySelector("#group-table tbody");
    if (!tbody || !groups) return;
    const line = (g, cls) => h("tr", { class: cls, "data-group": g.group },
      h("td", { class: "id" }, h("a", { href: `/queues/${enc(queue)}?state=parked&group=${enc(g.group)}`,
        title: "its parked tasks", text: g.group })),
      ...groups.columns.map((c) => h("td", { class: "num", "data-field": c, text: g.shown[c] })));
    const rows = [...(groups.group ? [line(groups.group, "looked-up")] : []), ...groups.rows.map((g) => line(g, ""))];
    if (!groups.rows.length) {
      rows.push(h("tr", { class: "empty" }, h("td", { colspan: groups.columns.length + 1, text: "No group has waiting tasks." })));
    }
    tbody.replaceChildren(...rows);
  }

  // -- one task ---------------------------------------------------------------------------

  function errorLine(e) {
    return e ? [h("span", { class: "tag", text: e.tag }), " ", h("span", { class: "message", text: e.message })] : [];
  }

  function renderTask(data) {
    const t = data.task;
    document.getElementById("task-state").replaceChildren(h("span", { class: `state s-${t.state}`, text: t.state }));
    const facts = document.getElementById("task-facts");
    setText(facts, "state", t.state);
    setText(facts, "attempt", t.attempt);
    setText(facts, "ready_at", when(t.ready_at));
    setText(facts, "started_at", when(t.started_at));
    setText(facts, "finished_at", when(t.finished_at));
    const card = document.getElementById("error");
    card.hidden = !t.error;
    if (t.error) {
      card.replaceChildren(h("h2", { text: "Error" }),
        h("p", { class: "error-head" }, h("span", { class: "tag", id: "error-tag", text: t.error.tag }), " ",
          h("span", { class: "kind", text: t.error.kind })),
        h("p", { class: "error-message", id: "error-message", text: t.error.message }),
        ...(t.error.data !== undefined ? [h("pre", { class: "json", text: pretty(t.error.data) })] : []));
    }
    const attempts = t.attempt_rows.map((a) => h("tr", { class: a.current ? "current" : null },
      h("td", { class: "num", text: a.attempt }),
      h("td", {}, h("span", { class: `state s-${a.outcome}`, text: a.outcome })),
      h("td", { class: "err" }, errorLine(a.error),
        a.cause_text ? h("div", { class: "cause", text: `stalled: ${a.cause_text}` }) : null),
      h("td", { class: "time", text: when(a.finished_at) })));
    document.querySelector("#attempts tbody").replaceChildren(...attempts);
    if (!t.sensitive) {
      for (const name of ["payload", "result", "progress", "options"]) {
        const el = document.querySelector(`pre[data-field="${name}"]`);
        if (el && el.textContent !== pretty(t[name])) el.textContent = pretty(t[name]);
      }
    }
    const cancel = document.getElementById("cancel");
    if (cancel) cancel.hidden = !t.can_cancel;
    const retry = document.getElementById("retry");
    if (retry) retry.hidden = !t.show_retry;
    const events = data.events.map((e) => h("li", {}, h("span", { class: "time", text: when(e.at) }), " ",
      h("span", { class: `state s-${e.event}`, text: e.event }), " ",
      Object.entries(e).filter(([k]) => !["event", "id", "at"].includes(k))
        .map(([k, v]) => [h("span", { class: "field", text: `${k}=${v}` }), " "])));
    if (events.length) document.getElementById("events").replaceChildren(...events);
  }

  // -- schedules --------------------------------------------------------------------------

  function renderSchedules(data) {
    const tbody = document.querySelector("table.schedules tbody");
    if (!tbody) return;
    const rows = data.schedules.map((s) => {
      const state = s.last_error
        ? [h("span", { class: "state s-failed", text: "error" }), " ", h("span", { class: "message", text: s.last_error })]
        : h("span", { class: s.suspended ? "state s-delayed" : "state s-completed", text: s.suspended ? "suspended" : "running" });
      const cells = [h("td", { class: "id", text: s.id }), h("td", { class: "muted", text: s.namespace || "" }),
        h("td", {}, s.queue ? h("a", { href: `/queues/${enc(s.queue)}`, text: s.queue }) : "-"),
        h("td", { text: s.task || "-" }),
        h("td", {}, h("code", { text: s.cron || "?" }), " ", h("span", { class: "muted", text: s.timezone || "" })),
        h("td", { class: "time", text: when(s.next_tick) }), h("td", { class: "time", text: when(s.last_tick) }),
        h("td", { class: "num", text: s.materialized }), h("td", {}, state)];
      if (CAN_ACT) {
        const url = `/api/schedules/${enc(s.id)}/${s.suspended ? "resume" : "suspend"}` +
          (s.namespace ? `?namespace=${enc(s.namespace)}` : "");
        cells.push(h("td", { class: "row-actions" }, actionButton(s.suspended ? "Resume" : "Suspend", url)));
      }
      return h("tr", { "data-schedule": s.id }, cells);
    });
    tbody.replaceChildren(...(rows.length ? rows : [h("tr", { class: "empty" }, h("td", { colspan: 10, text: "No schedules." }))]));
  }

  const RENDER = {
    overview: renderOverview, queue: (d) => { renderQueue(d); renderGroups(d.queue.name, d.groups); if (d.schedules) renderSchedules(d); },
    task: renderTask, schedules: renderSchedules,
  };

  // -- polling ------------------------------------------------------------------------------

  let polling = null;
  async function poll() {
    if (!API || !RENDER[PAGE]) return;
    try {
      const response = await fetch(API, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      const data = await response.json().catch(() => ({}));
      if (response.status === 401) { // the session ended (expired, signed out elsewhere): sign in again
        location.assign("/login?next=" + enc(location.pathname + location.search));
        return;
      }
      if (!response.ok) {
        banner(response.status === 503 ? "Redis unreachable — retrying…" : `${data.error || response.status}: ${data.detail || ""}`);
        return;
      }
      banner(null);
      RENDER[PAGE](data);
      if (data.redis) renderNotes(data.redis.notes);
    } catch (err) {
      banner("Dashboard unreachable — retrying…");
    }
  }
  function schedulePoll() {
    clearTimeout(polling);
    polling = setTimeout(async () => { await poll(); schedulePoll(); }, POLL_MS);
  }

  async function waitForRedis() { // the error page: reload once Redis answers again
    try {
      const r = await fetch("/readyz", { cache: "no-store" });
      if (r.ok) { location.reload(); return; }
    } catch (err) { /* still down */ }
    setTimeout(waitForRedis, POLL_MS);
  }

  // -- actions ------------------------------------------------------------------------------

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("[data-action]");
    if (!button) return;
    event.preventDefault();
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    button.disabled = true;
    try {
      const response = await fetch(button.dataset.action, {
        method: "POST", credentials: "same-origin",
        headers: { [ACTION_HEADER]: "1", Accept: "application/json" },
      });
      const data = await response.json().catch(() => ({}));
      const message = data.message || data.detail || data.error || `HTTP ${response.status}`;
      toast(message, response.ok ? "ok" : "error");
    } catch (err) {
      toast("Dashboard unreachable", "error");
    } finally {
      button.disabled = false;
    }
    await poll();
    schedulePoll();
  });

  // -- start ------------------------------------------------------------------------------

  function start() {
    const initial = document.getElementById("initial");
    if (initial && RENDER[PAGE]) {
      try {
        const data = JSON.parse(initial.textContent);
        if (PAGE === "overview") data.queues.forEach((q) => drawChart(byData(document, "data-chart", q.name), q.throughput));
        if (PAGE === "queue") drawChart(document.querySelector("[data-chart]"), data.queue.throughput);
      } catch (err) { /* the next poll draws them */ }
    }
    if (PAGE === "error" && document.title.startsWith("Redis unreachable")) waitForRedis();
    else schedulePoll();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();

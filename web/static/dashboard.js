// Live dashboard of one experiment: polls the metrics, contributors and checkpoints API and draws SVG charts (no
// library, no network beyond this app). Data is only ever inserted with textContent / setAttribute, never as HTML.
"use strict";
(function () {
  const root = document.getElementById("dashboard");
  if (!root) return;
  const id = root.dataset.experiment;
  const maxSteps = Number(root.dataset.maxSteps) || 0;
  const admin = root.dataset.admin === "true";
  const POLL_MS = 2000;
  const PAGE = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const EVALS = ["eval_loss", "eval_perplexity", "eval_accuracy", "eval_exact_match", "eval_f1"];
  const records = new Map();
  let lastStep = -1;

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fmt(x) {
    if (x === null || x === undefined || !Number.isFinite(x)) return "–";
    const a = Math.abs(x);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return x.toExponential(2);
    return x.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 3);
  }

  function tick(x) {
    return Number.isInteger(x) ? String(x) : fmt(x);
  }

  function duration(seconds) {
    const s = Math.max(0, Math.round(seconds));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return h ? `${h} h ${m} min` : m ? `${m} min ${s % 60} s` : `${s} s`;
  }

  function utc(seconds) {
    return new Date(seconds * 1000).toISOString().slice(0, 19).replace("T", " ") + " UTC";
  }

  function extent(values) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (lo === hi) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
    return [lo, hi];
  }

  // series: [{name, cls, points: [[step, value], ...]}]; integer: whole-number values (peers), whole ticks
  function drawChart(svg, series, integer) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const W = svg.viewBox.baseVal.width, H = svg.viewBox.baseVal.height, L = 64, R = 14, T = 16, B = 32;
    const points = series.flatMap((s) => s.points);
    if (!points.length) {
      svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
        "waiting for the monitor's first report"));
      return;
    }
    const [x0, x1] = extent(points.map((p) => p[0]));
    let [y0, y1] = extent(points.map((p) => p[1]));
    if (integer) { y0 = Math.max(0, Math.floor(y0)); y1 = Math.max(y0 + 1, Math.ceil(y1)); }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    const yStep = integer ? Math.max(1, Math.ceil((y1 - y0) / 4)) : (y1 - y0) / 4;
    for (let y = y0; y <= y1 + 1e-9 * Math.abs(y1); y += yStep) {
      svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "grid" }));
      svg.appendChild(svgEl("text", { x: L - 6, y: sy(y) + 4, "text-anchor": "end", class: "tick" }, tick(y)));
    }
    const xTicks = [...new Set([0, 1, 2, 3, 4].map((i) => Math.round(x0 + (i * (x1 - x0)) / 4)))];
    for (const x of xTicks) {
      svg.appendChild(svgEl("text", { x: sx(x), y: H - B + 16, "text-anchor": "middle", class: "tick" }, String(x)));
    }
    svg.appendChild(svgEl("text", { x: W - R, y: H - 4, "text-anchor": "end", class: "axis" }, "global step"));
    series.forEach((s, i) => {
      if (!s.points.length) return;
      const path = s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      svg.appendChild(svgEl("polyline", { points: path, class: `line ${s.cls}` }));
      if (s.points.length < 40) {
        for (const p of s.points) svg.appendChild(svgEl("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, class: s.cls }));
      }
      if (series.length > 1) {
        svg.appendChild(svgEl("text", { x: W - R - (series.length - i) * 100, y: T + 2, class: `legend ${s.cls}` }, s.name));
      }
    });
  }

  function pointsOf(rows, key) {
    return rows.filter((r) => Number.isFinite(r[key])).map((r) => [r.step, r[key]]);
  }

  function eta(rows) {
    if (!maxSteps) return "no max_steps";
    const last = rows[rows.length - 1];
    if (last.step >= maxSteps) return "done";
    const first = rows[Math.max(0, rows.length - 10)];
    const rate = (last.step - first.step) / (last.time - first.time);
    return rate > 0 && Number.isFinite(rate) ? duration((maxSteps - last.step) / rate) : "–";
  }

  function setText(elementId, text) {
    document.getElementById(elementId).textContent = text;
  }

  function renderMetrics() {
    const rows = [...records.values()].sort((a, b) => a.step - b.step);
    drawChart(document.getElementById("chart-loss"), [
      { name: "train loss", cls: "s1", points: pointsOf(rows, "loss") },
      { name: "eval loss", cls: "s2", points: pointsOf(rows, "eval_loss") },
    ].filter((s, i) => i === 0 || s.points.length));
    drawChart(document.getElementById("chart-peers"),
      [{ name: "peers", cls: "s1", points: pointsOf(rows, "alive_peers") }], true);
    drawChart(document.getElementById("chart-sps"),
      [{ name: "samples/s", cls: "s1", points: pointsOf(rows, "samples_per_second") }]);
    if (!rows.length) return;
    const last = rows[rows.length - 1];
    setText("stat-step", String(last.step));
    setText("stat-loss", fmt(last.loss));
    setText("stat-peers", String(last.alive_peers));
    setText("stat-sps", fmt(last.samples_per_second));
    setText("stat-eta", eta(rows));
    const evals = document.getElementById("evals");
    evals.replaceChildren();
    for (const key of EVALS) {
      const latest = rows.filter((r) => Number.isFinite(r[key])).pop();
      if (!latest) continue;
      const box = document.createElement("div");
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = `${key.replace("eval_", "eval ").replace("_", " ")} (step ${latest.step})`;
      const value = document.createElement("span");
      value.className = "value";
      value.id = `stat-${key}`;
      value.textContent = fmt(latest[key]);
      box.append(label, value);
      evals.appendChild(box);
    }
    evals.hidden = !evals.childElementCount;
  }

  function size(bytes) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
    return `${i ? bytes.toFixed(1) : bytes} ${units[i]}`;
  }

  function renderCheckpoints(list) {
    const table = document.getElementById("checkpoints");
    const body = table.querySelector("tbody");
    body.replaceChildren();
    for (const c of list) {
      const row = body.insertRow();
      row.insertCell().textContent = String(c.step);
      row.insertCell().textContent = fmt(c.loss);
      row.insertCell().textContent = size(c.size);
      const sha = row.insertCell();
      sha.textContent = c.sha256.slice(0, 12) + "…";
      sha.title = c.sha256;
      const link = row.insertCell();
      if (admin) {
        const a = document.createElement("a");
        a.href = c.url;
        a.textContent = `checkpoint-${c.step}.tar.gz`;
        a.setAttribute("download", "");
        link.appendChild(a);
      } else {
        link.textContent = "token needed";
      }
    }
    table.hidden = !list.length;
    document.getElementById("no-checkpoints").hidden = Boolean(list.length);
  }

  // Formatted as web/pages.py's contributor_rows formats the table the page arrives with.
  function renderContributors(report) {
    const table = document.getElementById("contributors");
    const body = table.querySelector("tbody");
    body.replaceChildren();
    for (const c of report.contributors) {
      const row = body.insertRow();
      row.insertCell().textContent = c.name || c.peer;
      const key = document.createElement("code");
      key.textContent = c.peer;
      row.insertCell().appendChild(key);
      row.insertCell().textContent = String(c.samples);
      row.insertCell().textContent = String(c.rounds);
      row.insertCell().textContent = duration(c.seconds_online);
      row.insertCell().textContent = utc(c.last_seen);
    }
    table.hidden = !report.contributors.length;
    document.getElementById("no-contributors").hidden = Boolean(report.contributors.length);
  }

  async function poll() {
    try {
      // Paged: a full page means more may follow. The last step is asked again, as the monitor may re-post it.
      let after = Math.max(-1, lastStep - 1), page;
      do {
        const metrics = await fetch(`/api/experiments/${id}/metrics?after=${after}&limit=${PAGE}`, { cache: "no-store" });
        if (!metrics.ok) throw new Error(`metrics: HTTP ${metrics.status}`);
        page = await metrics.json();
        for (const r of page) {
          records.set(r.step, r);
          lastStep = Math.max(lastStep, r.step);
          after = r.step;
        }
      } while (page.length === PAGE);
      const checkpoints = await fetch(`/api/experiments/${id}/checkpoints`, { cache: "no-store" });
      if (!checkpoints.ok) throw new Error(`checkpoints: HTTP ${checkpoints.status}`);
      renderCheckpoints(await checkpoints.json());
      const contributors = await fetch(`/api/experiments/${id}/contributors`, { cache: "no-store" });
      if (!contributors.ok) throw new Error(`contributors: HTTP ${contributors.status}`);
      renderContributors(await contributors.json());
      renderMetrics();
      setText("status", `live · updated ${new Date().toLocaleTimeString()}`);
    } catch (error) {
      setText("status", `connection lost (${error.message}); retrying`);
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();

// orch dashboard: renders the server's JSON (or a saved page's embedded copy).
// Everything from the job (rank output, host names, metric names) is inserted with
// textContent or as a text node, never as markup: a rank that prints <script> shows it.
(function () {
  "use strict";
  var POLL_MS = 1000;
  var embedded = document.getElementById("orch-data");
  var saved = embedded ? JSON.parse(embedded.textContent) : null;
  var token = new URLSearchParams(location.search).get("token") || "";
  var state = null;
  var logs = {};            // rank -> {lines: [[seq, text]], after: seq}
  var charts = {};          // key -> {plot, shape}
  var MAX_LINES = 5000;

  function $(id) { return document.getElementById(id); }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function secs(s) {
    if (s === null || s === undefined) return "";
    s = Math.round(s);
    var h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), r = s % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
  }
  function fmt(v) { return typeof v === "number" ? (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(4)) : String(v); }

  function get(path) {
    return fetch(path, {credentials: "same-origin", headers: {"X-Orch-Token": token}})
      .then(function (r) { if (!r.ok) throw new Error(r.status + " " + r.statusText); return r.json(); });
  }

  // ---------------------------------------------------------------- ranks
  function latestOf(rank) {
    var m = state.latest[rank.host + "/" + rank.rank] || (rank.rank === 0 ? state.latest[rank.host + "/"] : null);
    if (!m) return "";
    var keys = Object.keys(m).filter(function (k) { return /loss|acc|lr|images/.test(k); }).slice(0, 3);
    if (!keys.length) keys = Object.keys(m).slice(0, 2);
    return keys.map(function (k) { return k + " " + fmt(m[k]); }).join(", ");
  }
  function renderRanks() {
    $("ranks").hidden = state.ranks.length === 0;    // a job array: its tasks instead
    var body = $("rank-rows");
    clear(body);
    state.ranks.forEach(function (r) {
      var tr = el("tr");
      tr.dataset.rank = r.rank;
      if (r.failed) tr.className = "failed";
      else if (r.hung) tr.className = "hung";
      else if (r.state === "lost") tr.className = "lost";
      [r.rank, r.host, r.local_rank, r.state + (r.hung ? " (hung)" : ""), secs(r.runtime),
       r.restarts, latestOf(r)].forEach(function (v) { tr.appendChild(el("td", v)); });
      tr.appendChild(el("td", r.last_line, "line"));
      tr.addEventListener("click", function () { chooseRank(r.rank); });
      body.appendChild(tr);
    });
    var sel = $("log-rank");
    if (sel.options.length !== state.ranks.length) {
      clear(sel);
      state.ranks.forEach(function (r) { sel.appendChild(el("option", "rank " + r.rank + " (" + r.host + ")")).value = r.rank; });
    }
  }

  function renderHead() {
    $("job").textContent = state.job;
    var running = !state.ended;
    var badge = $("outcome");
    badge.textContent = running ? "running" : (state.outcome || "ended");
    badge.className = "badge " + (running ? "running" : state.outcome);
    $("updated").textContent = saved ? "saved " + new Date(state.now * 1000).toLocaleString() : "";
    $("stop").disabled = !!saved || state.ended;
    var cause = state.root_cause;
    $("cause").hidden = !cause;
    if (cause) {
      $("cause-summary").textContent = cause.summary;
      $("cause-lines").textContent = cause.lines.join("\n");
    }
    $("notes").textContent = state.notes.join("; ");
    renderNetwork();
  }

  // the network plan: one row per group of identical hosts, as `orch up` prints it
  var drawnPlan = null;
  function lines(cell, list) {
    list.forEach(function (t, i) { if (i) cell.appendChild(el("br")); cell.appendChild(document.createTextNode(t)); });
    return cell;
  }
  function renderNetwork() {
    var plan = state.network, shown = JSON.stringify(plan);
    if (shown === drawnPlan) return;
    drawnPlan = shown;
    $("network").hidden = !plan;
    if (!plan) return;
    $("network-master").textContent = plan.master_addr;
    $("network-how").textContent = "(" + plan.how + ")";
    $("network-probe").textContent = plan.probe ? "probe: " + plan.probe : "";
    var body = $("network-rows");
    clear(body);
    $("network-table").hidden = plan.rows.length === 0;
    plan.rows.forEach(function (r) {
      var tr = el("tr");
      [r.hosts, r.interface, r.addresses, r.how].forEach(function (v) { tr.appendChild(el("td", v)); });
      tr.appendChild(lines(el("td", null, "found"), r.found));
      tr.appendChild(lines(el("td"), r.set.length ? r.set : ["nothing"]));
      body.appendChild(tr);
    });
  }

  // ---------------------------------------------------------------- logs
  function chooseRank(rank) { $("log-rank").value = String(rank); showLog(); }
  function currentRank() { return parseInt($("log-rank").value || "0", 10) || 0; }
  function showLog() {
    var rank = currentRank(), entry = logs[rank] || {lines: [], after: 0};
    var q = $("log-search").value, shown = entry.lines.map(function (l) { return l[1]; });
    if (q) shown = shown.filter(function (t) { return t.indexOf(q) >= 0; });
    var view = $("log-view");
    view.textContent = shown.join("\n");     // one text node: never markup
    $("log-count").textContent = shown.length + (q ? " matching" : "") + " lines";
    if ($("log-follow").checked) view.scrollTop = view.scrollHeight;
    var link = $("log-download");
    link.setAttribute("download", state ? state.job + "-rank-" + rank + ".log" : "rank.log");
    if (saved) {
      var text = entry.lines.map(function (l) { return l[1] + "\n"; }).join("");
      link.href = URL.createObjectURL(new Blob([text], {type: "text/plain"}));
    } else {
      link.href = "api/log.txt?rank=" + rank;
    }
  }
  function pollLog() {
    var rank = currentRank(), entry = logs[rank] || (logs[rank] = {lines: [], after: 0});
    var from = entry.after;
    return get("api/log?rank=" + rank + "&after=" + from).then(function (got) {
      // two polls of one rank in flight (a rank picked while the poll loop asked): the
      // later answer holds the same lines again; only the one from where we are counts
      if (entry.after !== from) return;
      if (got.lines.length) {
        entry.lines = entry.lines.concat(got.lines).slice(-MAX_LINES);
        entry.after = got.next;
        if (rank === currentRank()) showLog();
      }
    });
  }

  // ---------------------------------------------------------------- charts
  function chart(key, title, parent, labels, data, opts) {
    var shape = labels.join("\u0000");
    var have = charts[key];
    var points = data.slice(1).reduce(function (n, ys) { return n + ys.filter(function (y) { return y !== null && y !== undefined; }).length; }, 0);
    if (have && have.shape === shape) { have.plot.setData(data); have.box.dataset.points = points; return; }
    if (have) { have.plot.destroy(); have.box.remove(); }
    var box = el("div", null, "chart");
    box.dataset.chart = key;
    box.appendChild(el("h3", title));
    parent.appendChild(box);
    var colors = ["#27a", "#c33", "#2a7", "#e90", "#84c", "#0aa", "#a60", "#666"];
    var series = [{label: (opts && opts.xLabel) || "time"}].concat(labels.map(function (l, i) {
      return {label: l, stroke: colors[i % colors.length], width: 1.5, spanGaps: true};
    }));
    var conf = Object.assign({width: 460, height: 220, series: series}, opts || {});
    delete conf.xLabel;
    var plot = new uPlot(conf, data, box);
    box.dataset.points = points;     // what the chart holds (a test reads it)
    box.dataset.series = labels.length;
    charts[key] = {plot: plot, shape: shape, box: box};
  }
  // a job array: every task's curves, or one task's (its row in Tasks picks it too)
  var curveTask = "";
  function hasTask(s) { return s.task !== null && s.task !== undefined; }
  function taskArgs(t) {
    var rows = (state.tasks && state.tasks.tasks) || [];
    for (var i = 0; i < rows.length; i++) if (rows[i].task === t) return rows[i].args;
    return "";
  }
  function renderTaskChoice() {
    var seen = {};
    state.curves.forEach(function (s) { if (hasTask(s)) seen[s.task] = true; });
    var tasks = Object.keys(seen).map(Number).sort(function (a, b) { return a - b; });
    var sel = $("curve-task"), want = tasks.join(",");
    $("curve-task-row").hidden = tasks.length === 0;
    if (sel.dataset.options === want) return;
    sel.dataset.options = want;
    clear(sel);
    sel.appendChild(el("option", "every task")).value = "";
    tasks.forEach(function (t) {
      var args = taskArgs(t);
      sel.appendChild(el("option", "task " + t + (args ? " (" + args + ")" : ""))).value = String(t);
    });
    if (curveTask !== "" && !seen[curveTask]) curveTask = "";
    sel.value = curveTask;
  }
  function chooseTask(t) {
    curveTask = String(t);
    $("curve-task").value = curveTask;
    renderCurves();
    $("curves").scrollIntoView();
  }
  function renderCurves() {
    renderTaskChoice();
    var byName = {};
    state.curves.forEach(function (s) {
      if (curveTask !== "" && String(s.task) !== curveTask) return;
      (byName[s.name] = byName[s.name] || []).push(s);
    });
    var names = Object.keys(byName).sort();
    $("curves-none").hidden = names.length > 0;
    Object.keys(charts).forEach(function (key) {     // a metric no file (or task) has now
      if (key.indexOf("curve:") === 0 && !byName[key.slice(6)]) {
        charts[key].plot.destroy(); charts[key].box.remove(); delete charts[key];
      }
    });
    names.forEach(function (name) {
      var list = byName[name];
      var tables = list.map(function (s) {
        var xs = [], ys = [];
        s.points.forEach(function (p, i) { xs.push(p[0] !== null ? p[0] : (p[1] !== null ? p[1] : i)); ys.push(p[2]); });
        return [xs, ys];
      });
      var data = tables.length === 1 ? tables[0] : uPlot.join(tables);
      var labels = list.map(function (s) {
        return (hasTask(s) ? "task " + s.task + " " : "") + s.host + (s.rank === null ? "" : " r" + s.rank) + " " + s.source;
      });
      chart("curve:" + name, name, $("curve-charts"), labels, data, {scales: {x: {time: false}}, xLabel: "step or epoch"});
    });
  }
  function renderGpus() {
    $("gpu-none").hidden = state.gpus.length > 0;
    $("gpu-table").hidden = state.gpus.length === 0;
    var body = $("gpu-rows");
    clear(body);
    var hosts = {};
    state.gpus.forEach(function (g) {
      (hosts[g.host] = hosts[g.host] || []).push(g);
      var last = g.samples[g.samples.length - 1] || [];
      var mem = last[2] !== null && last[3] !== null && last.length ? (last[2] / 1024).toFixed(1) + "/" + (last[3] / 1024).toFixed(0) + " GiB" : "-";
      var tr = el("tr");
      [g.host, g.index, g.name, last[1] === null || last[1] === undefined ? "-" : last[1] + "%", mem, g.holder]
        .forEach(function (v) { tr.appendChild(el("td", v)); });
      body.appendChild(tr);
    });
    Object.keys(hosts).sort().forEach(function (host) {
      var gpus = hosts[host];
      var util = uPlot.join(gpus.map(function (g) { return [g.samples.map(function (s) { return s[0]; }), g.samples.map(function (s) { return s[1]; })]; }));
      var mem = uPlot.join(gpus.map(function (g) { return [g.samples.map(function (s) { return s[0]; }), g.samples.map(function (s) { return s[2] === null ? null : s[2] / 1024; })]; }));
      var labels = gpus.map(function (g) { return "gpu " + g.index; });
      chart("util:" + host, host + ": utilisation %", $("gpu-charts"), labels, util);
      chart("mem:" + host, host + ": memory used (GiB)", $("gpu-charts"), labels, mem);
    });
  }

  // ---------------------------------------------------------------- events, tasks
  var BAD = /RootCause|Hang|HostLost|StartFailed/, WARN = /Stopping|Stopped|Restarting|HangSuspected/;
  function renderEvents() {
    var list = $("event-list"), line = $("timeline");
    clear(list); clear(line);
    if (!state.events.length) return;
    var t0 = state.events[0].time, t1 = Math.max(state.events[state.events.length - 1].time, t0 + 1);
    state.events.forEach(function (e) {
      var li = el("li");
      li.appendChild(el("span", "+" + (e.time - t0).toFixed(1) + " s", "t"));
      li.appendChild(document.createTextNode(e.text));
      if (e.detail) {
        var d = el("details");
        d.appendChild(el("summary", "details"));
        d.appendChild(el("pre", e.detail));
        li.appendChild(d);
      }
      list.appendChild(li);
      var tick = el("div", null, "tick" + (BAD.test(e.kind) ? " bad" : WARN.test(e.kind) ? " warn" : ""));
      tick.title = e.text;
      tick.style.left = (100 * (e.time - t0) / (t1 - t0)) + "%";
      line.appendChild(tick);
    });
  }
  function valueText(x) {
    if (x && typeof x === "object") {
      return "mean" in x ? fmt(x.mean) + " ± " + fmt(x.std) + " (n=" + x.n + ")" : JSON.stringify(x);
    }
    return fmt(x);
  }
  function cellText(v) {
    if (Array.isArray(v)) return v.join(", ");
    if (v && typeof v === "object") return Object.keys(v).map(function (k) { return k + " " + valueText(v[k]); }).join(", ");
    return v === null || v === undefined ? "" : v;
  }
  function table(head, body, rows, cols) {
    clear(head); clear(body);
    var tr = el("tr");
    cols.forEach(function (c) { tr.appendChild(el("th", c)); });
    head.appendChild(tr);
    rows.forEach(function (row) {
      var r = el("tr");
      cols.forEach(function (c) { r.appendChild(el("td", cellText(row[c]))); });
      body.appendChild(r);
    });
  }
  function renderTasks() {
    var t = state.tasks || {};
    $("tasks").hidden = !t.tasks && !t.error;
    if (t.error) { $("notes").textContent = t.error; return; }
    if (!t.tasks) return;
    table($("task-head"), $("task-rows"), t.tasks, ["task", "args", "state", "metrics"]);
    Array.prototype.forEach.call($("task-rows").children, function (tr, i) {
      var task = t.tasks[i].task;
      tr.className = "pick";
      tr.title = "show task " + task + "'s curves";
      tr.addEventListener("click", function () { chooseTask(task); });
    });
    table($("group-head"), $("group-rows"), t.groups || [], ["params", "tasks", "ok", "metrics"]);
  }

  // ---------------------------------------------------------------- the loop
  var drawn = {};            // part -> the version on the page (the big parts drawn on change only)
  function fresh(part) {
    if (drawn[part] === state.versions[part]) return false;
    drawn[part] = state.versions[part];
    return true;
  }
  function render() {
    renderHead(); renderRanks();
    if (fresh("events")) renderEvents();
    if (fresh("tasks")) renderTasks();
    try {
      if (fresh("curves")) renderCurves();
      if (fresh("gpus")) renderGpus();
    } catch (err) { $("notes").textContent = "charts: " + err; }
  }
  function poll() {
    var have = state ? Object.keys(state.versions).map(function (k) { return k + ":" + state.versions[k]; }).join(",") : "";
    get("api/state?have=" + have).then(function (s) {
      if (state) ["events", "gpus", "curves", "tasks"].forEach(function (k) { if (!(k in s)) s[k] = state[k]; });
      state = s; render();
      return pollLog();
    }).catch(function (err) {
      $("outcome").textContent = "disconnected (" + err.message + ")";
      $("outcome").className = "badge";
    }).then(function () { setTimeout(poll, POLL_MS); });
  }
  function stop() {
    if (!window.confirm("Stop job " + (state ? state.job : "") + " on every host?")) return;
    $("stop").disabled = true;
    fetch("api/stop", {method: "POST", credentials: "same-origin", headers: {"X-Orch-Token": token}})
      .then(function (r) { return r.json(); })
      .then(function (r) { $("notes").textContent = r.message; })
      .catch(function (err) { $("notes").textContent = "stop failed: " + err.message; $("stop").disabled = false; });
  }

  $("stop").addEventListener("click", stop);
  $("log-rank").addEventListener("change", function () { showLog(); if (!saved) pollLog(); });
  $("log-search").addEventListener("input", showLog);
  $("curve-task").addEventListener("change", function () { curveTask = $("curve-task").value; renderCurves(); });
  if (saved) {
    state = saved.state;
    Object.keys(saved.logs).forEach(function (r) { logs[r] = {lines: saved.logs[r], after: 0}; });
    $("save").hidden = true;
    render(); showLog();
  } else {
    $("save").href = "save";
    poll();
  }
})();

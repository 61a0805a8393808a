// qkv inspect: the head-importance heat map and the attention-rollout view.
// Shape legend: m metrics, l layers, h heads, n tokens, k rollout layers kept.
// importance.values is (m, l, h) numbers, null for layers not run; rollout.weights is
// 16-bit fixed point (w * 65535, little endian), base64, in (k, n, n) order.
"use strict";

(function () {
  const data = JSON.parse(document.getElementById("qkv-attribution").textContent);
  const N = data.tokens.length;
  const label = (j) => `${data.tokens[j]}@${j}`;
  const option = (select, text, value) => select.add(new Option(text, String(value)));

  // ---- head importance ---------------------------------------------------------------------
  const imp = data.importance;
  const table = document.getElementById("importance");
  const metricSelect = document.getElementById("importance-metric");
  const fromSelect = document.getElementById("importance-from");
  const toSelect = document.getElementById("importance-to");
  const impStatus = document.getElementById("importance-status");
  const explain = document.getElementById("importance-explain");
  const L = imp.values[0].length, H = imp.values[0][0].length;
  imp.metrics.forEach((m, k) => option(metricSelect, m.label, k));
  for (let l = 0; l < L; l++) { option(fromSelect, String(l), l); option(toSelect, String(l), l); }
  const state = { metric: 0, from: Math.min(...imp.layers), to: Math.max(...imp.layers) };

  function colour(v, scale) {
    // white at 0, red for an increase, blue for a decrease; full colour at |v| = scale
    if (v === null) return "#eee";
    const t = scale > 0 ? Math.min(Math.abs(v) / scale, 1) : 0;
    const [r, g, b] = v >= 0 ? [192, 57, 43] : [44, 95, 184];
    const mix = (c) => Math.round(255 + t * (c - 255));
    return `rgb(${mix(r)}, ${mix(g)}, ${mix(b)})`;
  }

  function openHead(l, head) {
    const view = window.qkvInspect;
    const h = data.pageHeads.indexOf(head);
    if (!view || h < 0) return false;
    view.show(l, h);
    document.getElementById("head-view").scrollIntoView({ behavior: "auto" });
    return true;
  }

  function drawImportance() {
    const values = imp.values[state.metric];
    let scale = 0, best = null;
    for (let l = state.from; l <= state.to; l++) {
      for (let h = 0; h < H; h++) {
        const v = values[l][h];
        if (v === null) continue;
        scale = Math.max(scale, Math.abs(v));
        if (best === null || v > values[best[0]][best[1]]) best = [l, h];
      }
    }
    table.replaceChildren();
    const header = table.insertRow();
    header.appendChild(Object.assign(document.createElement("th"), { textContent: "" }));
    for (let h = 0; h < H; h++) header.appendChild(Object.assign(document.createElement("th"), { textContent: "head " + h }));
    for (let l = state.from; l <= state.to; l++) {
      const row = table.insertRow();
      row.appendChild(Object.assign(document.createElement("th"), { textContent: "layer " + l }));
      for (let h = 0; h < H; h++) {
        const v = values[l][h];
        const cell = row.insertCell();
        cell.dataset.layer = l;
        cell.dataset.head = h;
        cell.dataset.value = v === null ? "" : String(v);
        cell.style.background = colour(v, scale);
        cell.textContent = v === null ? "" : v.toPrecision(2);
        cell.title = v === null ? `layer ${l}, head ${h}: not run` : `layer ${l}, head ${h}: ${v}`;
        cell.addEventListener("click", () => openHead(l, h));
      }
    }
    const metric = imp.metrics[state.metric];
    explain.textContent = " " + metric.explain;
    impStatus.textContent = `${metric.label} \u00b7 layers ${state.from}\u2013${state.to}` +
      (best === null ? " \u00b7 not run" : ` \u00b7 largest: layer ${best[0]} head ${best[1]} (${values[best[0]][best[1]].toPrecision(3)})`);
  }

  function setImportance(metric, from, to) {
    state.metric = metric;
    state.from = Math.min(from, to);
    state.to = Math.max(from, to);
    metricSelect.value = String(state.metric);
    fromSelect.value = String(state.from);
    toSelect.value = String(state.to);
    drawImportance();
  }
  metricSelect.addEventListener("change", () => setImportance(Number(metricSelect.value), state.from, state.to));
  fromSelect.addEventListener("change", () => setImportance(state.metric, Number(fromSelect.value), state.to));
  toSelect.addEventListener("change", () => setImportance(state.metric, state.from, Number(toSelect.value)));
  setImportance(state.metric, state.from, state.to);

  // ---- attention rollout ---------------------------------------------------------------------
  if (data.rollout === null) return;
  const K = data.rollout.layers.length;
  const rolled = (function decode(text) {
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const view = new DataView(bytes.buffer);
    const out = new Float32Array(bytes.length / 2);
    for (let k = 0; k < out.length; k++) out[k] = view.getUint16(2 * k, true) / 65535;
    return out;
  })(data.rollout.weights);
  if (rolled.length !== K * N * N) throw new Error("qkv inspect: the embedded rollout does not match its shape");
  const at = (k, i, j) => rolled[(k * N + i) * N + j];

  const tokenSelect = document.getElementById("rollout-token");
  const layerSelect = document.getElementById("rollout-layer");
  const strip = document.getElementById("rollout-strip");
  const canvas = document.getElementById("rollout-matrix");
  const rollStatus = document.getElementById("rollout-status");
  for (let i = 0; i < N; i++) option(tokenSelect, label(i), i);
  data.rollout.layers.forEach((layer, k) => option(layerSelect, String(layer), k));
  const view = { token: N - 1, layer: K - 1 };
  const PIXEL = Math.max(1, Math.min(24, Math.floor(480 / N)));
  canvas.width = N;
  canvas.height = N;
  canvas.style.width = canvas.style.height = `${N * PIXEL}px`;

  function shade(x) {
    // 0 -> white, 1 -> dark blue
    const t = Math.min(Math.max(x, 0), 1);
    return [Math.round(255 - t * 211), Math.round(255 - t * 160), Math.round(255 - t * 71)];
  }

  function drawMatrix(k) {
    const context = canvas.getContext("2d");
    const image = context.createImageData(N, N);
    for (let i = 0; i < N; i++) {
      let top = 0;
      for (let j = 0; j < N; j++) top = Math.max(top, at(k, i, j));
      for (let j = 0; j < N; j++) {
        const [r, g, b] = i === view.token ? [255, Math.round(255 - 200 * at(k, i, j) / (top || 1)), 60] : shade(at(k, i, j) / (top || 1));
        image.data.set([r, g, b, 255], 4 * (i * N + j));
      }
    }
    context.putImageData(image, 0, 0);
  }

  function drawRollout() {
    const k = view.layer, i = view.token;
    let top = 0;
    for (let j = 0; j < N; j++) top = Math.max(top, at(k, i, j));
    strip.replaceChildren();
    for (let j = 0; j < N; j++) {
      const w = at(k, i, j);
      const span = document.createElement("span");
      span.className = "token" + (j === i ? " chosen" : "");
      span.dataset.index = j;
      span.dataset.value = w.toFixed(4);
      const [r, g, b] = shade(w / (top || 1));
      span.style.background = `rgb(${r}, ${g}, ${b})`;
      span.style.color = w / (top || 1) > 0.55 ? "#fff" : "#1d1d1f";
      span.textContent = data.tokens[j];
      span.title = `${label(j)}: ${(100 * w).toFixed(1)}%`;
      strip.appendChild(span);
      strip.appendChild(document.createTextNode(" "));
    }
    drawMatrix(k);
    const order = [...Array(N).keys()].sort((a, b) => at(k, i, b) - at(k, i, a)).slice(0, 3);
    rollStatus.textContent = `${label(i)} after layer ${data.rollout.layers[k]}: ` +
      order.map((j) => `${label(j)} ${(100 * at(k, i, j)).toFixed(1)}%`).join(", ");
  }

  function setRollout(token, layer) {
    view.token = token;
    view.layer = layer;
    tokenSelect.value = String(token);
    layerSelect.value = String(layer);
    drawRollout();
  }
  tokenSelect.addEventListener("change", () => setRollout(Number(tokenSelect.value), view.layer));
  layerSelect.addEventListener("change", () => setRollout(view.token, Number(layerSelect.value)));
  canvas.addEventListener("click", (event) => {
    const box = canvas.getBoundingClientRect();
    const row = Math.floor((event.clientY - box.top) / box.height * N);
    if (row >= 0 && row < N) setRollout(row, view.layer);
  });
  strip.addEventListener("click", (event) => {
    const span = event.target.closest("span.token");
    if (span) setRollout(Number(span.dataset.index), view.layer);
  });
  setRollout(view.token, view.layer);
})();

// qkv inspect: the head view and the model view, drawn from the weights embedded in the page.
// Shape legend: l layers, h chosen heads, i chosen query rows, j keys (every token).
// The weights are 16-bit fixed point (w * 65535, little endian), base64, in (l, h, i, j) order.
"use strict";

(function () {
  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const L = data.layers, H = data.heads.length, I = data.rows.length, J = data.tokens.length;
  const KEY_LIMIT = 64;      // more keys than this: the head view shows only the heaviest ones
  const LINE_FLOOR = 0.005;  // lighter lines are invisible anyway; not drawing them keeps it fast
  const ROW_GAP = 20, TOP = 12, WIDTH = 640, LEFT = 220, RIGHT = 440;
  const SVG = "http://www.w3.org/2000/svg";

  const weights = (function decode(text) {
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const view = new DataView(bytes.buffer);
    const out = new Float32Array(bytes.length / 2);
    for (let k = 0; k < out.length; k++) out[k] = view.getUint16(2 * k, true) / 65535;
    return out;
  })(data.weights);
  if (weights.length !== L * H * I * J) throw new Error("qkv inspect: the embedded weights do not match their shape");

  const weight = (l, h, r, j) => weights[((l * H + h) * I + r) * J + j];
  const special = new Set(data.special);
  const state = { layer: data.layer, head: data.heads.indexOf(data.head), locked: null };

  // ---- colours: viridis, sampled at 9 points and interpolated -------------------------------
  const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
                   [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function viridis(x) {
    const t = Math.min(Math.max(x, 0), 1) * (VIRIDIS.length - 1);
    const k = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - k;
    return VIRIDIS[k].map((c, n) => Math.round(c + f * (VIRIDIS[k + 1][n] - c)));
  }

  // ---- the head view --------------------------------------------------------------------------
  const svg = document.getElementById("lines");
  const focusLine = document.getElementById("focus");
  const status = document.getElementById("status");
  const keysNote = document.getElementById("keys-note");

  function shownKeys(l, h) {
    // Every key when there are few; else the heaviest keys of each shown row (never one it
    // gives no weight) and the special tokens, in text order. The note under the controls says how much weight they hold.
    if (J <= KEY_LIMIT) return [...Array(J).keys()];
    const perRow = Math.max(3, Math.ceil(KEY_LIMIT / I));
    const keep = new Set(data.special);
    for (let r = 0; r < I; r++) {
      const order = [...Array(J).keys()].sort((a, b) => weight(l, h, r, b) - weight(l, h, r, a));
      order.slice(0, perRow).forEach((j) => { if (weight(l, h, r, j) > 0) keep.add(j); });
    }
    return [...keep].sort((a, b) => a - b);
  }

  function text(x, y, label, cls, position) {
    // A token; in a long text also its position, since the same word comes back many times.
    const node = document.createElementNS(SVG, "text");
    node.setAttribute("x", x);
    node.setAttribute("y", y);
    node.setAttribute("class", cls);
    node.textContent = label;
    if (position !== undefined && J > KEY_LIMIT) {
      const where = document.createElementNS(SVG, "tspan");
      where.setAttribute("class", "pos");
      where.textContent = cls.startsWith("query") ? ` ${position}` : `${position} `;
      if (cls.startsWith("query")) node.appendChild(where); else node.insertBefore(where, node.firstChild);
    }
    return node;
  }

  function drawHead() {
    const l = state.layer, h = state.head;
    const keys = shownKeys(l, h);
    // Right column: the shown keys, with a "…" row wherever keys were left out.
    const keyY = new Map();
    const rightRows = [];
    keys.forEach((j, n) => {
      if (n > 0 && j > keys[n - 1] + 1) rightRows.push(null);
      else if (n === 0 && j > 0) rightRows.push(null);
      rightRows.push(j);
    });
    if (keys[keys.length - 1] < J - 1) rightRows.push(null);
    const height = TOP * 2 + ROW_GAP * Math.max(I, rightRows.length);
    svg.setAttribute("width", WIDTH);
    svg.setAttribute("height", height);
    svg.replaceChildren();
    const lines = document.createElementNS(SVG, "g");
    svg.appendChild(lines);
    rightRows.forEach((j, n) => {
      const y = TOP + ROW_GAP * (n + 0.5);
      if (j === null) { svg.appendChild(text(RIGHT, y, "\u2026", "gap")); return; }
      keyY.set(j, y);
      const node = text(RIGHT, y, data.tokens[j], "key" + (special.has(j) ? " special" : ""), j);
      node.dataset.key = j;
      svg.appendChild(node);
    });
    data.rows.forEach((row, r) => {
      const y = TOP + ROW_GAP * (r + 0.5);
      const node = text(LEFT, y, data.tokens[row], "query" + (special.has(row) ? " special" : ""), row);
      node.dataset.row = r;
      svg.appendChild(node);
      keyY.forEach((ky, j) => {
        const w = weight(l, h, r, j);
        if (w < LINE_FLOOR) return;
        const line = document.createElementNS(SVG, "line");
        line.setAttribute("x1", LEFT + 6);
        line.setAttribute("y1", y);
        line.setAttribute("x2", RIGHT - 6);
        line.setAttribute("y2", ky);
        line.setAttribute("stroke", "#2c5fb8");
        line.setAttribute("stroke-width", (1 + 3 * w).toFixed(2));
        line.setAttribute("stroke-opacity", w.toFixed(3));
        line.dataset.row = r;
        line.dataset.key = j;
        lines.appendChild(line);
      });
    });
    if (J > KEY_LIMIT) {
      let held = 0;
      for (let r = 0; r < I; r++) keys.forEach((j) => { held += weight(l, h, r, j); });
      keysNote.textContent = `${J} keys are too many to list: the right column shows the ${keys.length} ` +
        `with the largest weights for these rows (and the special tokens), which hold ` +
        `${(100 * held / I).toFixed(1)}% of their weight; "\u2026" marks keys left out.`;
    } else {
      keysNote.textContent = "";
    }
    keysNote.hidden = !keysNote.textContent;
    status.textContent = `layer ${l} \u00b7 head ${data.heads[h]}`;
    applyFocus(state.locked);
    markCurrentCell();
  }

  function describe(kind, index) {
    // One line naming the focused token and its heaviest links in this head.
    const l = state.layer, h = state.head;
    const pairs = [];
    if (kind === "row") {
      for (let j = 0; j < J; j++) pairs.push([weight(l, h, index, j), data.tokens[j] + "@" + j]);
    } else {
      for (let r = 0; r < I; r++) pairs.push([weight(l, h, r, index), data.tokens[data.rows[r]] + "@" + data.rows[r]]);
    }
    pairs.sort((a, b) => b[0] - a[0]);
    const top = pairs.slice(0, 5).map(([w, name]) => `${name} ${(100 * w).toFixed(1)}%`).join(", ");
    const token = kind === "row" ? data.tokens[data.rows[index]] + "@" + data.rows[index] : data.tokens[index] + "@" + index;
    return kind === "row" ? `${token} attends to: ${top}` : `attending to ${token}: ${top}`;
  }

  function applyFocus(focus) {
    // focus: null, or {kind: "row" | "key", index}
    svg.querySelectorAll("text.focused").forEach((node) => node.classList.remove("focused"));
    svg.querySelectorAll("line").forEach((line) => {
      const on = !focus || line.dataset[focus.kind] === String(focus.index);
      line.style.display = on ? "" : "none";
    });
    if (focus) {
      const node = svg.querySelector(`text[data-${focus.kind}="${focus.index}"]`);
      if (node) node.classList.add("focused");
      focusLine.textContent = describe(focus.kind, focus.index);
    } else {
      focusLine.textContent = "\u00a0";
    }
  }

  function target(event) {
    const node = event.target.closest("text");
    if (!node) return null;
    if (node.dataset.row !== undefined) return { kind: "row", index: Number(node.dataset.row) };
    if (node.dataset.key !== undefined) return { kind: "key", index: Number(node.dataset.key) };
    return null;
  }

  svg.addEventListener("mouseover", (event) => {
    const focus = target(event);
    if (focus && !state.locked) applyFocus(focus);
  });
  svg.addEventListener("mouseout", (event) => {
    if (target(event) && !state.locked) applyFocus(null);
  });
  svg.addEventListener("click", (event) => {
    const focus = target(event);
    const same = focus && state.locked && focus.kind === state.locked.kind && focus.index === state.locked.index;
    state.locked = focus && !same ? focus : null;
    applyFocus(state.locked || focus);
  });

  // ---- controls ---------------------------------------------------------------------------------
  const layerSelect = document.getElementById("layer");
  const headSelect = document.getElementById("head");
  for (let l = 0; l < L; l++) layerSelect.add(new Option(String(l), String(l)));
  data.heads.forEach((head, h) => headSelect.add(new Option(String(head), String(h))));
  function show(layer, head) {
    state.layer = layer;
    state.head = head;
    layerSelect.value = String(layer);
    headSelect.value = String(head);
    drawHead();
  }
  layerSelect.addEventListener("change", () => show(Number(layerSelect.value), state.head));
  headSelect.addEventListener("change", () => show(state.layer, Number(headSelect.value)));

  // ---- the model view -----------------------------------------------------------------------
  const grid = document.getElementById("grid");
  const BINS = Math.min(J, 96);  // pixel columns of a thumbnail
  const perBin = J / BINS;
  const binsNote = document.getElementById("bins-note");
  binsNote.hidden = BINS === J;
  if (BINS < J) {
    binsNote.textContent =
      `With ${J} keys, each pixel column of a small heatmap is the summed weight of about ` +
      `${Math.round(perBin)} neighbouring keys.`;
  }
  grid.style.gridTemplateColumns = `3.5em repeat(${H}, 60px)`;
  grid.appendChild(Object.assign(document.createElement("div"), { className: "label", textContent: "" }));
  data.heads.forEach((head) =>
    grid.appendChild(Object.assign(document.createElement("div"), { className: "label", textContent: "head " + head })));
  function thumbnail(l, h) {
    const canvas = document.createElement("canvas");
    canvas.width = BINS;
    canvas.height = I;
    const context = canvas.getContext("2d");
    const image = context.createImageData(BINS, I);
    for (let r = 0; r < I; r++) {
      for (let b = 0; b < BINS; b++) {
        let sum = 0;
        for (let j = Math.floor(b * perBin); j < Math.floor((b + 1) * perBin); j++) sum += weight(l, h, r, j);
        const [red, green, blue] = viridis(sum);
        const at = 4 * (r * BINS + b);
        image.data.set([red, green, blue, 255], at);
      }
    }
    context.putImageData(image, 0, 0);
    canvas.dataset.layer = l;
    canvas.dataset.head = h;
    canvas.title = `layer ${l}, head ${data.heads[h]}`;
    canvas.addEventListener("click", () => {
      show(l, h);
      document.getElementById("head-view").scrollIntoView({ behavior: "auto" });
    });
    return canvas;
  }
  for (let l = 0; l < L; l++) {
    grid.appendChild(Object.assign(document.createElement("div"), { className: "label", textContent: "layer " + l }));
    for (let h = 0; h < H; h++) grid.appendChild(thumbnail(l, h));
  }
  function markCurrentCell() {
    grid.querySelectorAll("canvas.current").forEach((c) => c.classList.remove("current"));
    const cell = grid.querySelector(`canvas[data-layer="${state.layer}"][data-head="${state.head}"]`);
    if (cell) cell.classList.add("current");
  }

  window.qkvInspect = { show };  // the attribution views open a head with it
  show(state.layer, state.head);
})();

// specdecode lab: five widgets on the live engine. Plain JavaScript, charts as inline SVG.
"use strict";

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const showTok = (s) => (s === "" ? "·" : s.replace(/\n/g, "⏎").replace(/ /g, "␣"));
const fmt = (x, d = 3) => (x === null || x === undefined ? "—" : Number(x).toFixed(d));
const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%");

async function api(path, body) {
  const res = await fetch("/lab/api/" + path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await res.json();
  if (!res.ok) throw new Error(data.error ? data.error.message : res.statusText);
  return data;
}

function busy(button, promise) {
  button.disabled = true;
  const label = button.textContent;
  button.textContent = label + " …";
  return promise.finally(() => { button.disabled = false; button.textContent = label; });
}

function fail(el, err) { el.innerHTML = `<p class="error">${esc(err.message || err)}</p>`; }

function fill(select, values, labels) {
  select.innerHTML = values.map((v, i) => `<option value="${esc(v)}">${esc(labels ? labels[i] : v)}</option>`).join("");
}

// -- SVG charts -----------------------------------------------------------------------------
function groupedBars(el, rows, series, { height = 220, max = null, band = null } = {}) {
  const W = 640, H = height, left = 40, bottom = 34, top = 10;
  const top1 = max || Math.max(1e-9, ...rows.flatMap((r) => series.map((s) => r[s.key] || 0)));
  const gw = (W - left - 10) / rows.length, bw = Math.min(26, (gw - 6) / series.length);
  const y = (v) => top + (H - top - bottom) * (1 - v / top1);
  let out = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  for (const t of [0, 0.5, 1]) {
    out += `<line x1="${left}" x2="${W - 10}" y1="${y(t * top1)}" y2="${y(t * top1)}" stroke="#e3e6ec"/>`;
    out += `<text x="${left - 4}" y="${y(t * top1) + 4}" text-anchor="end">${fmt(t * top1, 2)}</text>`;
  }
  rows.forEach((r, i) => {
    const x0 = left + i * gw + (gw - bw * series.length) / 2;
    series.forEach((s, j) => {
      const v = r[s.key] || 0;
      out += `<rect class="bar bar-${s.key}" x="${x0 + j * bw}" y="${y(v)}" width="${bw - 2}" height="${y(0) - y(v)}" fill="${s.color}"><title>${esc(s.label)} ${fmt(v, 4)}</title></rect>`;
    });
    const label = r.label !== undefined ? r.label : showTok(r.token);
    out += `<text x="${left + i * gw + gw / 2}" y="${H - bottom + 14}" text-anchor="middle">${esc(label.slice(0, 8))}</text>`;
  });
  if (band !== null) out += `<line x1="${left}" x2="${W - 10}" y1="${y(band)}" y2="${y(band)}" stroke="#888" stroke-dasharray="4 3"/>`;
  series.forEach((s, j) => {
    out += `<rect x="${left + j * 150}" y="${H - 14}" width="10" height="10" fill="${s.color}"/><text x="${left + 14 + j * 150}" y="${H - 5}">${esc(s.label)}</text>`;
  });
  el.innerHTML = out + "</svg>";
}

function lineChart(el, points, { xKey, yKey, mark, best, yLabel, ref = null }) {
  const W = 640, H = 220, left = 44, bottom = 30, top = 10;
  const xs = points.map((p) => p[xKey]), ys = points.map((p) => p[yKey]);
  const xmin = Math.min(...xs), xmax = Math.max(...xs), ymax = Math.max(1.05, ...ys) * 1.05;
  const x = (v) => left + (W - left - 10) * (v - xmin) / (xmax - xmin || 1);
  const y = (v) => top + (H - top - bottom) * (1 - v / ymax);
  let out = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    out += `<line x1="${left}" x2="${W - 10}" y1="${y(t * ymax)}" y2="${y(t * ymax)}" stroke="#e3e6ec"/><text x="${left - 4}" y="${y(t * ymax) + 4}" text-anchor="end">${fmt(t * ymax, 2)}</text>`;
  }
  if (ref !== null) out += `<line x1="${left}" x2="${W - 10}" y1="${y(ref)}" y2="${y(ref)}" stroke="#999" stroke-dasharray="4 3"/><text x="${W - 12}" y="${y(ref) - 4}" text-anchor="end">no speed-up</text>`;
  out += `<polyline fill="none" stroke="#2a6fdb" stroke-width="2" points="${points.map((p) => `${x(p[xKey])},${y(p[yKey])}`).join(" ")}"/>`;
  for (const p of points) {
    const r = p[xKey] === mark ? 6 : 3, c = p[xKey] === best ? "#1a7f37" : "#2a6fdb";
    out += `<circle class="${p[xKey] === mark ? "mark" : ""}" cx="${x(p[xKey])}" cy="${y(p[yKey])}" r="${r}" fill="${c}"><title>k=${p[xKey]}: ${fmt(p[yKey])}</title></circle>`;
    out += `<text x="${x(p[xKey])}" y="${H - bottom + 14}" text-anchor="middle">${p[xKey]}</text>`;
  }
  out += `<text x="${left}" y="${H - 2}">k (draft tokens per round); ${esc(yLabel)}; green: best k</text>`;
  el.innerHTML = out + "</svg>";
}

// -- 1. roofline ------------------------------------------------------------------------------
// slider moves send many requests; only the newest one's answer is drawn (answers can come back
// out of order)
const latest = {};
async function newest(key, path, body) {
  const n = (latest[key] = (latest[key] || 0) + 1);
  const d = await api(path, body);
  return n === latest[key] ? d : null;
}

async function roofline() {
  const k = +$("rf-k").value;
  $("rf-k-out").textContent = k;
  let d;
  try {
    d = await newest("roofline", "roofline", { model: $("rf-model").value, hardware: $("rf-hw").value, k, dtype: $("rf-dtype").value });
  } catch (e) { return fail($("rf-bars"), e); }
  if (d === null) return;
  const rows = [d.one, d.verify];
  const W = 640, H = 150, left = 150, max = Math.max(...rows.flatMap((r) => [r.compute_ms, r.weight_read_ms]));
  const w = (v) => (W - left - 180) * v / max;
  let out = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  rows.forEach((r, i) => {
    const y0 = 10 + i * 70;
    out += `<text x="0" y="${y0 + 24}">${r.positions} position${r.positions > 1 ? "s" : ""}</text>`;
    out += `<rect class="bar-weight" x="${left}" y="${y0}" width="${w(r.weight_read_ms)}" height="24" fill="#2a6fdb"/><text x="${left + w(r.weight_read_ms) + 4}" y="${y0 + 16}">weight read ${fmt(r.weight_read_ms, 3)} ms</text>`;
    out += `<rect class="bar-compute" x="${left}" y="${y0 + 28}" width="${Math.max(1, w(r.compute_ms))}" height="24" fill="#e07b39"/><text x="${left + Math.max(1, w(r.compute_ms)) + 4}" y="${y0 + 44}">compute ${fmt(r.compute_ms, 4)} ms</text>`;
  });
  $("rf-bars").innerHTML = out + "</svg>";
  $("rf-ratio").textContent = fmt(d.verify_cost_ratio, 3);
  $("rf-bound").textContent = d.one.bound;
  const hw = d.hardware;
  $("rf-hwinfo").textContent = `${hw.name}: ${fmt(hw.peak_tflops, 1)} TFLOP/s, ${fmt(hw.bandwidth_tbs, 2)} TB/s; ${fmt(d.weight_gb, 3)} GB of weights`;
  diagram(d);
}

function diagram(d) {
  const k = d.k, n = k + 1, W = 640, H = 230, bw = Math.min(70, (W - 40) / n - 8);
  const x = (i) => 20 + i * ((W - 40) / n) + ((W - 40) / n - bw) / 2, dm = d.dims;
  let out = `<svg viewBox="0 0 ${W} ${H}" role="img">`;
  for (let i = 0; i < n; i++) {
    const label = i === 0 ? "last token" : `draft ${i}`;
    out += `<rect x="${x(i)}" y="190" width="${bw}" height="26" rx="4" fill="${i === 0 ? "#eceef2" : "#cdebd3"}" stroke="#999"/><text x="${x(i) + bw / 2}" y="207" text-anchor="middle">${label}</text>`;
    out += `<line x1="${x(i) + bw / 2}" x2="${x(i) + bw / 2}" y1="190" y2="150" stroke="#999" marker-end="url(#ar)"/>`;
    out += `<line x1="${x(i) + bw / 2}" x2="${x(i) + bw / 2}" y1="80" y2="44" stroke="#999" marker-end="url(#ar)"/>`;
    out += `<rect x="${x(i)}" y="14" width="${bw}" height="26" rx="4" fill="#c9dcff" stroke="#999"/><text x="${x(i) + bw / 2}" y="31" text-anchor="middle">p${i + 1}(·)</text>`;
  }
  out += `<defs><marker id="ar" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#999"/></marker></defs>`;
  out += `<rect class="stack" x="20" y="84" width="${W - 40}" height="62" rx="6" fill="#f3f5f9" stroke="#2a6fdb"/>`;
  out += `<text x="${W / 2}" y="106" text-anchor="middle">one forward, ${n} positions: ${dm.layers} layers × hidden ${dm.hidden}, ${dm.heads} heads (${dm.kv_heads} KV) of ${dm.head_dim}, MLP ${dm.intermediate}</text>`;
  out += `<text x="${W / 2}" y="126" text-anchor="middle">every weight (${fmt(d.params / 1e9, 3)}B parameters, ${fmt(d.weight_gb, 2)} GB) is read once, whatever the positions</text>`;
  out += `<text x="${W / 2}" y="142" text-anchor="middle">causal mask: position i sees the prefix and drafts before it</text>`;
  out += `<text x="${W - 20}" y="10" text-anchor="end">${n} next-token distributions over ${dm.vocab.toLocaleString("en")} tokens: p1 checks draft 1, …, p${n} gives the bonus</text>`;
  $("rf-diagram").innerHTML = out + "</svg>";
}

// -- 2. acceptance rules ----------------------------------------------------------------------
const RULES = [
  ["accept-if-equal", "accept only if an independent target sample equals the draft"],
  ["resample-from-p", "min(1, p/q), then redraw a rejection from p"],
  ["residual", "min(1, p/q), then redraw from norm(max(0, p − q)) (the engine's rule)"],
  ["invariant", "invariant: same text for any drafter. One Exp(1) vector E per draw, fixed by the seed and the position: the target's token is argmax p/E, the draft guesses argmax q/E and is kept when they agree"],
];
let ruleSeed = 0;
const pairBody = () => ({ pair: $("ru-pair").value, prompt: $("ru-prompt").value });

async function rulesDist() {
  try {
    const d = await newest("dist", "rules/dist", { ...pairBody(), top: 8 });
    if (d === null) return;
    groupedBars($("ru-dist"), d.tokens, [{ key: "p", label: "p (target)", color: "#2a6fdb" }, { key: "q", label: "q (draft)", color: "#e07b39" }]);
    $("ru-alpha").textContent = fmt(d.alpha, 4);
  } catch (e) { fail($("ru-dist"), e); }
}

async function rulesRound() {
  try {
    const r = await api("rules/round", { ...pairBody(), seed: ruleSeed++ });
    let html = `<p class="verdict">draft x = <b>${esc(showTok(r.draft_token))}</b> with q(x) = ${fmt(r.q, 4)}, p(x) = ${fmt(r.p, 4)};
      min(1, p/q) = <b>${fmt(r.accept_prob, 4)}</b>; u = <b id="ru-u">${fmt(r.uniform, 4)}</b> →
      <b id="ru-verdict" class="${r.accepted ? "right" : "wrong"}">${r.accepted ? "accepted" : "rejected"}</b>; emitted <b id="ru-emitted">${esc(showTok(r.emitted_token))}</b>${r.accepted ? "" : " (redrawn from the residual)"}</p>`;
    $("ru-round-out").innerHTML = html + (r.accepted ? "" : `<div id="ru-residual" class="chart"></div>`);
    if (!r.accepted) groupedBars($("ru-residual"), r.residual, [{ key: "residual", label: "norm(max(0, p − q))", color: "#f0a23b" }]);
  } catch (e) { fail($("ru-round-out"), e); }
}

function rulesCheck() {
  const g = document.querySelector("input[name=ru-guess]:checked");
  const fb = $("ru-feedback");
  if (!g) { fb.textContent = "Pick one first."; fb.className = "feedback"; return; }
  const right = g.value === "residual";
  fb.className = "feedback " + (right ? "right" : "wrong");
  fb.textContent = right
    ? "Right: the accepted mass is min(p, q); the rejections must supply exactly what is missing, p − min(p, q) = max(0, p − q)."
    : `Not quite: redrawing from ${g.value} counts the mass min(p, q) that acceptance already gave twice (or never fixes it). Draw the samples and see.`;
  $("ru-sample").disabled = false;
}

async function rulesSample() {
  const draws = +$("ru-draws").value, out = $("ru-samples");
  out.innerHTML = "";
  for (const [rule, about] of RULES) {
    const box = document.createElement("div");
    box.className = "sample";
    box.id = "ru-sample-" + rule;
    box.innerHTML = `<h3>${esc(rule)}</h3><p class="explain">${esc(about)}</p><p>drawing ${draws.toLocaleString("en")}…</p>`;
    out.appendChild(box);
    try {
      const s = await api("rules/sample", { ...pairBody(), rule, draws, seed: 1 });
      box.className = "sample " + (s.within_noise ? "ok" : "bad");
      box.innerHTML = `<h3>${esc(rule)}</h3><p class="explain">${esc(about)}</p><div class="chart"></div>
        <p>TV to p = <b class="tv">${fmt(s.tv, 4)}</b>; noise (99%) ≤ <b class="noise">${fmt(s.noise_tv_p99, 4)}</b>
        <span class="badge ${s.within_noise ? "ok" : "bad"}">${s.within_noise ? "within noise" : "outside noise"}</span><br>
        χ² p-value ${s.chi2_p < 1e-4 ? s.chi2_p.toExponential(1) : fmt(s.chi2_p, 3)}; acceptance ${pct(s.acceptance)}${s.closed_form === undefined ? "" :
          ` (closed form ${pct(s.closed_form)}, at least (1 − TV)/(1 + TV) = ${pct(s.bound)}; the residual rule's 1 − TV = ${pct(s.one_minus_tv)}): the price of a text no drafter can change`}</p>`;
      box.dataset.tv = s.tv; box.dataset.noise = s.noise_tv_p99; box.dataset.within = s.within_noise;
      groupedBars(box.querySelector(".chart"), s.tokens, [{ key: "p", label: "p", color: "#2a6fdb" }, { key: "observed", label: "observed", color: "#7a8699" }], { height: 180 });
    } catch (e) { fail(box, e); }
  }
}

// -- 3. replay --------------------------------------------------------------------------------
let trace = null, at = 0;
async function replayTrace() {
  try {
    trace = await api("replay", { pair: $("rp-pair").value, k: +$("rp-k").value, max_tokens: +$("rp-tokens").value, seed: +$("rp-seed").value });
    at = 0;
    replayShow();
  } catch (e) { fail($("rp-round"), e); }
}

function replayShow() {
  const r = trace.rounds[at], n = trace.rounds.length;
  $("rp-pos").textContent = `round ${at + 1} of ${n}`;
  $("rp-prev").disabled = at === 0;
  $("rp-next").disabled = at === n - 1;
  let rows = r.draft_tokens.map((t, i) => {
    const u = r.uniform[i];
    const verdict = u === null && !r.accepted[i] ? "—" : r.accepted[i] ? "accept" : "reject";
    return `<tr><td>${esc(showTok(t))}</td><td>${fmt(r.draft_prob[i], 4)}</td><td>${fmt(r.target_prob[i], 4)}</td><td>${fmt(r.accept_prob[i], 4)}</td><td>${u === null ? "—" : fmt(u, 4)}</td><td class="verdict">${verdict}</td></tr>`;
  }).join("");
  const emitted = r.emitted_tokens.map((t, i) => `<span class="tok how-${r.how[i]}">${esc(showTok(t))}</span>`).join(" ");
  $("rp-round").innerHTML = `<div class="table-wrap"><table><tr><th>draft token</th><th>q(x)</th><th>p(x)</th><th>min(1, p/q)</th><th>u</th><th>verdict</th></tr>${rows}</table></div>
    <p>emitted this round (${r.emitted_tokens.length}): ${emitted} <span class="explain">(${r.how.join(", ")})</span></p>`;
  $("rp-cache").textContent = r.cache_length;
  const done = trace.rounds.slice(0, at + 1);
  $("rp-emitted").textContent = done.reduce((a, x) => a + x.emitted_tokens.length, 0);
  $("rp-text").innerHTML = esc(trace.prompt) + done.map((x) => x.emitted_tokens.map((t, i) => `<span class="tok how-${x.how[i]}">${esc(t)}</span>`).join("")).join("");
}

// -- 4. formula vs measured -------------------------------------------------------------------
let measuredAlpha = null;
async function formula() {
  const alpha = +$("fo-alpha").value, c = +$("fo-c").value, k = +$("fo-k").value;
  $("fo-alpha-out").textContent = alpha.toFixed(2);
  $("fo-c-out").textContent = c.toFixed(2);
  $("fo-k-out").textContent = k;
  try {
    const f = await newest("formula", "formula", { alpha, c, k });
    if (f === null) return;
    $("fo-tokens").textContent = fmt(f.tokens_per_round, 3);
    $("fo-speedup").textContent = fmt(f.speedup, 3);
    $("fo-best").textContent = f.optimal_k;
    $("fo-best-speedup").textContent = fmt(f.optimal_speedup, 3);
    lineChart($("fo-curve"), f.curve, { xKey: "k", yKey: "speedup", mark: k, best: f.optimal_k, yLabel: "speed-up E / (kc + 1)", ref: 1 });
  } catch (e) { fail($("fo-curve"), e); }
}

async function measure() {
  try {
    const m = await api("measured", { pair: $("fo-pair").value, k: +$("fo-k").value > 8 ? 8 : +$("fo-k").value });
    const rows = m.per_position_acceptance.map((a, i) => ({ label: `pos ${i + 1}`, measured: a, formula: m.formula_per_position[i] }));
    groupedBars($("fo-measured"), rows, [{ key: "measured", label: "measured", color: "#2a6fdb" }, { key: "formula", label: "formula α^i", color: "#c3cad6" }], { max: 1 });
    measuredAlpha = m.alpha;
    $("fo-use").disabled = false;
    $("fo-measured-text").innerHTML = `${esc(m.pair)}, k = ${m.k}, ${m.runs} runs, ${m.tokens} tokens: α = <b id="fo-m-alpha">${fmt(m.alpha, 3)}</b>;
      tokens per forward measured <b id="fo-m-tpf">${fmt(m.tokens_per_forward, 3)}</b> vs formula <b id="fo-m-formula">${fmt(m.formula_tokens_per_forward, 3)}</b>.
      Acceptance at each position given the one before passed: <b id="fo-m-cond">${m.conditional_acceptance.map((a) => fmt(a, 2)).join(", ")}</b>`;
  } catch (e) { fail($("fo-measured"), e); }
}

// -- 5. live generation -----------------------------------------------------------------------
let presets = null;
function methods() {
  const list = presets.generate[$("ge-target").value];
  fill($("ge-method"), [...list, "none"], [...list, "none (target only)"]);
}

async function generate() {
  const spec = $("ge-spec"), base = $("ge-base");
  spec.innerHTML = ""; base.innerHTML = ""; $("ge-error").textContent = "";
  for (const id of ["ge-tau", "ge-acc", "ge-tps", "ge-base-tps", "ge-speedup"]) $(id).textContent = "…";
  const body = { target: $("ge-target").value, method: $("ge-method").value, k: +$("ge-k").value,
    temperature: +$("ge-temp").value, max_tokens: +$("ge-max").value, prompt: $("ge-prompt").value };
  const res = await fetch("/lab/api/generate", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  if (!res.ok) { const e = await res.json(); $("ge-error").textContent = e.error.message; return; }
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const line = buf.slice(0, cut); buf = buf.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const ev = JSON.parse(line.slice(6));
      if (ev.phase === "error") { $("ge-error").textContent = ev.message; continue; }
      if (ev.phase === "done") {
        $("ge-speedup").textContent = ev.speedup ? fmt(ev.speedup, 2) + "x" : "—";
        spec.dataset.done = "1";
        continue;
      }
      const pane = ev.phase === "speculative" ? spec : base;
      for (const t of ev.tokens) {
        const s = document.createElement("span");
        s.className = "tok how-" + t.how; s.textContent = t.text;
        pane.appendChild(s);
      }
      if (ev.phase === "speculative") {
        $("ge-tau").textContent = fmt(ev.tokens_per_forward, 2);
        $("ge-acc").textContent = pct(ev.acceptance);
        $("ge-tps").textContent = fmt(ev.tokens_per_s, 1);
      } else {
        $("ge-base-tps").textContent = fmt(ev.tokens_per_s, 1);
      }
    }
  }
}

// -- start ------------------------------------------------------------------------------------
async function start() {
  presets = await api("presets");
  fill($("rf-model"), presets.roofline_models);
  $("rf-model").value = "llama-3.1-8b";
  const hw = Object.keys(presets.hardware);
  fill($("rf-hw"), hw, hw.map((h) => presets.hardware[h].name));
  fill($("rf-dtype"), presets.dtypes);
  $("rf-dtype").value = "bf16";
  for (const id of ["rf-model", "rf-hw", "rf-dtype"]) $(id).addEventListener("change", roofline);
  $("rf-k").addEventListener("input", roofline);
  for (const id of ["ru-pair", "rp-pair"]) fill($(id), presets.pairs);
  fill($("fo-pair"), presets.measured_pairs);
  $("ru-load").addEventListener("click", (e) => busy(e.target, rulesDist()));
  $("ru-pair").addEventListener("change", rulesDist);
  $("ru-round").addEventListener("click", (e) => busy(e.target, rulesRound()));
  $("ru-check").addEventListener("click", rulesCheck);
  $("ru-sample").addEventListener("click", (e) => busy(e.target, rulesSample()));
  $("ru-sample").disabled = true;
  $("rp-trace").addEventListener("click", (e) => busy(e.target, replayTrace()));
  $("rp-prev").addEventListener("click", () => { at = Math.max(0, at - 1); replayShow(); });
  $("rp-next").addEventListener("click", () => { at = Math.min(trace.rounds.length - 1, at + 1); replayShow(); });
  for (const id of ["fo-alpha", "fo-c", "fo-k"]) $(id).addEventListener("input", formula);
  $("fo-measure").addEventListener("click", (e) => busy(e.target, measure()));
  $("fo-use").addEventListener("click", () => { $("fo-alpha").value = Math.min(0.99, measuredAlpha).toFixed(2); formula(); });
  fill($("ge-target"), Object.keys(presets.generate));
  $("ge-target").addEventListener("change", methods);
  methods();
  $("ge-run").addEventListener("click", (e) => busy(e.target, generate()));
  await Promise.all([roofline(), formula(), rulesDist()]);
  document.body.dataset.ready = "1";
}
start();

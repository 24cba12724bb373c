// PDD dashboard: polls the gateway (same origin only) and draws the fleet, the recent requests
// and the selected request's waterfall. Plain browser JavaScript: no build step, no libraries.
'use strict';

const POLL_MS = 800; // new requests and fleet figures show within about a second
const SVG = 'http://www.w3.org/2000/svg'; // an XML namespace name, never fetched
const ROW_LABELS = {
  queue: 'queue', prefill: 'prefill', kv_local: 'KV in-DC (A)', kv_wan: 'KV over the WAN',
  relay: 'relay tokens', handoff: 'handoff chunks', extend: 'extend', main: 'main-decode tokens', end: 'end',
};
const view = { selected: null, waterfall: null, polls: 0, asked: 0 };

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith('svg:') ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const ms = (v) => (v === null || v === undefined ? '–' : v.toFixed(v < 10 ? 1 : 0));
function bytes(n) {
  if (!n) return '0';
  const units = ['B', 'kB', 'MB', 'GB'];
  const i = Math.min(units.length - 1, Math.floor(Math.log10(n) / 3));
  return `${(n / 1000 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

async function getJSON(path) {
  const r = await fetch(path, { credentials: 'same-origin', cache: 'no-store' });
  if (r.status === 401) throw new Error('this gateway needs an API key: open /dashboard?key=YOUR_KEY');
  if (!r.ok) throw Object.assign(new Error(`${path}: HTTP ${r.status}`), { status: r.status });
  return r.json();
}

// -- fleet ------------------------------------------------------------------------------------
function instanceCard(row) {
  const card = el('div', { class: 'inst', 'data-instance': row.id, 'data-state': row.state },
    el('span', { class: 'name' }, row.id), el('span', { class: `role role-${row.role}` }, row.role), ' ',
    el('span', { class: 'muted' }, row.state));
  if (row.state !== 'up') return card;
  card.append(el('div', {}, `running ${row.running} · waiting ${row.waiting} · pending ${row.pending} · `
    + `held ${row.held}/${row.capacity || '∞'}`));
  const kv = row.kv_blocks;
  const total = Math.max(1, kv.used + kv.cached + kv.free);
  const bar = el('div', { class: 'kvbar', title: 'KV blocks: used / cached / free' });
  for (const part of ['used', 'cached', 'free']) {
    const span = el('span', { class: part });
    span.style.width = `${(100 * kv[part]) / total}%`; // CSSOM, allowed by the page's CSP
    bar.append(span);
  }
  card.append(bar, el('div', { class: 'muted kv' }, `KV blocks used ${kv.used} · cached ${kv.cached} · free ${kv.free}`));
  return card;
}

function wanBox(wan) {
  const box = el('div', { class: 'wan', 'data-wan': '' }, el('h3', {}, 'WAN link'),
    el('div', {}, `configured ${wan.configured.bandwidth_mbps} Mbps, ${wan.configured.delay_ms} ms one way`),
    el('div', { 'data-estimate': wan.estimate_mbps }, `scheduler's estimate ${wan.estimate_mbps} Mbps`));
  if (!wan.lines) {
    box.append(el('div', { class: 'muted' }, wan.emulated ? 'line state unavailable' : 'a real line: no emulator counters'));
  }
  for (const [dir, ls] of Object.entries(wan.lines || {})) {
    const state = ls.down ? 'DOWN' : ls.stalled ? 'stalled' : 'up';
    const rate = ls.bytes_per_s === null ? 'measuring…' : `${((ls.bytes_per_s * 8) / 1e6).toFixed(2)} Mbit/s now`;
    box.append(el('div', { class: `dir${ls.down ? ' down' : ''}`, 'data-direction': dir, 'data-bytes-per-s': ls.bytes_per_s },
      `${dir.toUpperCase().replace('-', ' → ')} ${state}: ${ls.bandwidth_mbps} Mbps, ${ls.delay_ms} ± ${ls.jitter_ms} ms; `
      + `${rate}; ${bytes(ls.bytes)} carried`));
  }
  return box;
}

function renderFleet(fleet) {
  const root = document.getElementById('fleet');
  if (!fleet.datacenters) {
    root.replaceChildren(el('p', { class: 'outcome-error' }, fleet.error || 'no fleet data'));
    return;
  }
  const columns = Object.entries(fleet.datacenters).map(([dc, rows]) =>
    el('div', { class: 'dc', 'data-dc': dc }, el('h3', {}, `datacenter ${dc}`), ...rows.map(instanceCard)));
  columns.splice(1, 0, wanBox(fleet.wan)); // the line sits between the first site and the others
  root.replaceChildren(...columns);
  const plans = Object.entries(fleet.plans || {}).map(([p, n]) => `${p} ${n}`).join(', ');
  document.getElementById('plans').textContent = `plans since the scheduler started: ${plans || 'none'}`
    + (fleet.error ? ` — ${fleet.error}` : '');
}

// -- requests ---------------------------------------------------------------------------------
function renderRequests(rows) {
  const body = document.querySelector('#requests tbody');
  body.replaceChildren(...rows.map((r) => {
    const tr = el('tr', { 'data-request-id': r.id, 'data-outcome': r.outcome, class: r.id === view.selected ? 'selected' : '' },
      el('td', {}, new Date(r.created * 1000).toLocaleTimeString()), el('td', { title: r.id }, r.id),
      el('td', {}, r.pipeline || '–'), el('td', {}, r.handoff), el('td', { class: 'num' }, ms(r.ttft_ms)),
      el('td', { class: 'num' }, `${r.tokens_by_role.prefill} / ${r.tokens_by_role.rld} / ${r.tokens_by_role.md}`),
      el('td', { class: 'num' }, bytes(r.wan_kv_bytes)), el('td', { class: 'num' }, ms(r.e2e_ms)),
      el('td', { class: `outcome-${r.outcome}` }, r.outcome));
    tr.addEventListener('click', () => select(r.id));
    return tr;
  }));
  if (view.selected === null && rows.length) select(rows[0].id); // the newest, until the operator picks one
}

async function select(id) {
  view.selected = id;
  view.waterfall = null;
  for (const tr of document.querySelectorAll('#requests tbody tr')) {
    tr.classList.toggle('selected', tr.dataset.requestId === id);
  }
  await refreshWaterfall();
}

async function refreshWaterfall() {
  const id = view.selected;
  const asked = ++view.asked; // answers may come back out of order: only the newest is drawn
  try {
    const w = await getJSON(`/dashboard/api/requests/${encodeURIComponent(id)}`);
    if (id === view.selected && asked === view.asked) {
      view.waterfall = w;
      drawWaterfall(w);
    }
  } catch (e) { // shown, not thrown: a click handler's rejection would go nowhere
    const gone = e.status === 404 ? 'no longer kept by the gateway' : e.message;
    document.getElementById('wf-title').textContent = `(${id}: ${gone})`;
  }
}

// -- waterfall --------------------------------------------------------------------------------
function niceStep(span) {
  const raw = span / 8;
  const p = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
}

function drawWaterfall(w) {
  const W = 1100, left = 140, right = 24, top = 22, rowH = 24;
  const rows = w.rows, y = (row) => top + rows.indexOf(row) * rowH;
  const H = top + rows.length * rowH + 8;
  const ends = [w.end_ms, w.ttft_ms, ...w.bars.map((b) => b.start_ms + b.dur_ms), ...Object.values(w.ticks).flat()];
  const span = Math.max(1, ...ends) * 1.02;
  const x = (t) => left + ((W - left - right) * t) / span;
  const svg = el('svg:svg', { viewBox: `0 0 ${W} ${H}`, 'data-request-id': w.request.id, 'data-outcome': w.request.outcome, 'data-span-ms': span });
  const hatch = el('svg:pattern', { id: 'hatch', width: 6, height: 6, patternUnits: 'userSpaceOnUse',
    patternTransform: 'rotate(45)' }, el('svg:line', { x1: 0, y1: 0, x2: 0, y2: 6, stroke: '#d1d5db', 'stroke-width': 2 }));
  svg.append(el('svg:defs', {}, hatch));
  rows.forEach((row, i) => {
    if (i % 2 === 0) svg.append(el('svg:rect', { class: 'stripe', x: 0, y: y(row), width: W, height: rowH }));
    svg.append(el('svg:text', { x: 6, y: y(row) + rowH / 2 + 4 }, ROW_LABELS[row] || row));
  });
  const axis = el('svg:g', { class: 'axis' });
  for (let t = 0, step = niceStep(span); t <= span; t += step) {
    axis.append(el('svg:line', { x1: x(t), x2: x(t), y1: top - 4, y2: H - 8 }));
    if (x(t) + 60 < W) axis.append(el('svg:text', { x: x(t) + 2, y: top - 8 }, `${Math.round(t)} ms`)); // room for it
  }
  svg.append(axis);
  if (w.gap) { // drawn first: a band behind the marks it spans, not over them
    const g0 = x(w.gap.start_ms), g1 = x(w.gap.start_ms + w.gap.dur_ms);
    const right = g1 + 140 < W; // the label beside the band, on whichever side has room
    svg.append(el('svg:rect', { class: 'gap', 'data-start-ms': w.gap.start_ms, 'data-dur-ms': w.gap.dur_ms,
      x: g0, y: y('relay'), width: Math.max(2, g1 - g0), height: y('main') + rowH - y('relay') }),
    el('svg:text', { class: 'gap-label', x: right ? g1 + 4 : g0 - 4, y: y('handoff') + 15, 'text-anchor': right ? 'start' : 'end' },
      `handoff gap ${ms(w.gap.dur_ms)} ms`));
  }
  for (const b of w.bars) {
    svg.append(el('svg:rect', { class: `bar bar-${b.row}`, 'data-stage': b.row, 'data-start-ms': b.start_ms,
      'data-dur-ms': b.dur_ms, x: x(b.start_ms), y: y(b.row) + 4, width: Math.max(1, x(b.start_ms + b.dur_ms) - x(b.start_ms)),
      height: rowH - 8 }, el('svg:title', {}, `${ROW_LABELS[b.row]}: ${ms(b.dur_ms)} ms from ${ms(b.start_ms)} ms`)));
  }
  for (const [row, times] of Object.entries(w.ticks)) {
    for (const t of times) {
      svg.append(el('svg:line', { class: `tick tick-${row}`, 'data-ms': t, x1: x(t), x2: x(t), y1: y(row) + 3, y2: y(row) + rowH - 3 }));
    }
  }
  svg.append(el('svg:line', { class: 'ttft', 'data-ms': w.ttft_ms, x1: x(w.ttft_ms), x2: x(w.ttft_ms), y1: top, y2: H - 8 }),
    el('svg:text', { class: 'ttft-label', x: x(w.ttft_ms) + 3, y: y('queue') + 15 }, `TTFT ${ms(w.ttft_ms)} ms`),
    el('svg:line', { class: 'end-mark', 'data-ms': w.end_ms, x1: x(w.end_ms), x2: x(w.end_ms), y1: y('end') + 3, y2: y('end') + rowH - 3 }),
    el('svg:text', { x: x(w.end_ms) - 5, y: y('end') + 16, 'text-anchor': 'end' }, `end ${ms(w.end_ms)} ms`));
  document.getElementById('waterfall').replaceChildren(svg);
  const r = w.request, t = w.timings_ms;
  document.getElementById('wf-title').textContent = `${r.id} — ${r.pipeline || 'no plan'}, handoff ${r.handoff}, ${r.outcome}`;
  const inst = Object.entries(w.instances).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(', ');
  document.getElementById('wf-figures').textContent = [
    `queue ${ms(t.queue)}`, `prefill ${ms(t.prefill)}`, `KV in-DC ${ms(t.kv_local)}`, `KV WAN ${ms(t.kv_wan)}`,
    `extend ${ms(t.extend)}`, `TTFT ${ms(t.ttft)}`, `e2e ${ms(t.e2e)} ms`,
    `prefill ${r.tokens_by_role.prefill} / relay ${r.tokens_by_role.rld} / main ${r.tokens_by_role.md} tokens`, `handoff ${r.handoff_chunks} chunks`,
    `gap ${ms(r.handoff_gap_ms)} ms`, `WAN ${bytes(r.wan_kv_bytes)}`, `in-DC ${bytes(r.local_kv_bytes)}`, inst,
  ].filter(Boolean).join(' · ');
}

// -- the loop ---------------------------------------------------------------------------------
async function poll() {
  try {
    const s = await getJSON('/dashboard/api/state');
    document.getElementById('model').textContent = s.model;
    renderFleet(s.fleet);
    renderRequests(s.requests);
    if (view.selected !== null && view.waterfall && view.waterfall.request.outcome === 'running') {
      await refreshWaterfall(); // still streaming: its waterfall grows
    }
    view.polls += 1;
    document.body.dataset.polls = view.polls;
    document.getElementById('status').textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    document.getElementById('status').textContent = e.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

window.addEventListener('error', (e) => { // shown on the page, so a broken view is not silent
  const box = document.getElementById('errors');
  box.hidden = false;
  box.textContent += `${e.message}\n`;
});
if (new URLSearchParams(location.search).has('key')) {
  history.replaceState(null, '', location.pathname); // the key now lives in an HttpOnly cookie, not the address bar
}
poll();

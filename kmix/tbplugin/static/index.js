// The "Mixed Precision" tab of TensorBoard (plugin `kmix`).
//
// TensorBoard imports this module in the plugin's frame and calls render(). It
// loads index.html and style.css, asks the plugin's routes for JSON and draws
// hand-written SVG. Text from the logs only ever goes into textContent or SVG
// text nodes, never into HTML.

import {fillFloat8} from './float8.js';

const SVG_NS = 'http://www.w3.org/2000/svg';

/** Event kinds: marker shape and colour, and the words of the legend. */
const KINDS = {
  backoff: {color: '#c62828', shape: 'down', label: 'skipped: backoff'},
  skip_absorbed: {color: '#ef6c00', shape: 'cross', label: 'skipped: absorbed by hysteresis'},
  overflow_at_floor: {color: '#212121', shape: 'square', label: 'skipped: overflow at min_scale'},
  forward_overflow: {color: '#6a1b9a', shape: 'diamond', label: 'skipped: forward overflow'},
  growth: {color: '#2e7d32', shape: 'up', label: 'growth'},
};
const OTHER_KIND = {color: '#757575', shape: 'circle', label: 'other'};
const MAX_ROWS = 1000;
let WIDTH = 720; // set from the panel's width before a run is drawn

// ------------------------------------------------------------------ elements
function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function svg(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'text') node.textContent = String(value);
    else node.setAttribute(key, String(value));
  }
}

function append(node, children) {
  for (const child of [].concat(children)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === 'string' ? document.createTextNode(child) : child);
  }
}

// ----------------------------------------------------------------- formatting
function fmtScale(value) {
  if (value === null || value === undefined) return 'n/a';
  if (value > 0) {
    const power = Math.log2(value);
    if (Number.isInteger(power)) return `${value} (2^${power})`;
  }
  return Number(value.toPrecision(6)).toString();
}

function fmtPercent(value, digits = 2) {
  if (value === null || value === undefined) return 'n/a';
  return `${(100 * value).toFixed(digits)}%`;
}

function fmtNumber(value) {
  if (value === null || value === undefined) return 'n/a';
  return Math.abs(value) >= 1e5 || (value !== 0 && Math.abs(value) < 1e-3)
    ? value.toExponential(3)
    : Number(value.toPrecision(4)).toString();
}

/**
 * An event's line as plain text. The server words every event (`run.event_lines`,
 * the kmix/events lines of kmix.tags.format_event, set as `e.line` by fillRun);
 * this page only drops their markup.
 */
function plainLine(e) {
  return plainText(e.line || '');
}

/** A server-worded markdown line as plain text (for SVG titles). */
function plainText(line) {
  return inline(line).map((n) => (typeof n === 'string' ? n : n.textContent)).join('');
}

function originText(origin) {
  if (!origin) return '';
  if (typeof origin === 'string') return origin;
  const cls = origin.layer_class ? ` (${origin.layer_class})` : '';
  return `${origin.layer}${cls}`;
}

function lossFiniteText(value) {
  if (value === true) return 'yes';
  if (value === false) return 'no';
  return 'unknown';
}

// ---------------------------------------------------------------------- scales
function linear(domain, range) {
  const [d0, d1] = domain[0] === domain[1] ? [domain[0] - 1, domain[1] + 1] : domain;
  const f = (v) => range[0] + ((v - d0) / (d1 - d0)) * (range[1] - range[0]);
  f.domain = [d0, d1];
  return f;
}

function niceTicks(lo, hi, count) {
  if (hi <= lo) return [lo];
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

// ---------------------------------------------------------------------- markers
function markerShape(kind, x, y, r = 5) {
  const style = KINDS[kind] || OTHER_KIND;
  const fill = style.color;
  switch (style.shape) {
    case 'down':
      return svg('path', {d: `M${x - r},${y - r * 0.8}L${x + r},${y - r * 0.8}L${x},${y + r}Z`, fill});
    case 'up':
      return svg('path', {d: `M${x - r},${y + r * 0.8}L${x + r},${y + r * 0.8}L${x},${y - r}Z`, fill});
    case 'cross':
      return svg('path', {
        d: `M${x - r},${y - r}L${x + r},${y + r}M${x - r},${y + r}L${x + r},${y - r}`,
        stroke: fill, 'stroke-width': 2.5, fill: 'none',
      });
    case 'square':
      return svg('rect', {x: x - r * 0.8, y: y - r * 0.8, width: r * 1.6, height: r * 1.6, fill});
    case 'diamond':
      return svg('path', {d: `M${x},${y - r}L${x + r},${y}L${x},${y + r}L${x - r},${y}Z`, fill});
    default:
      return svg('circle', {cx: x, cy: y, r: r * 0.8, fill});
  }
}

function swatch(kind) {
  return svg('svg', {viewBox: '-7 -7 14 14', 'aria-hidden': 'true'}, markerShape(kind, 0, 0, 5));
}

// ---------------------------------------------------------------------- charts
/** An SVG chart frame: axes, grid and scales, for steps on x. */
function frame({xDomain, yDomain, height, yTicks, yLabel, xLabel = 'step'}) {
  const m = {left: 58, right: 14, top: 10, bottom: 34};
  const root = svg('svg', {viewBox: `0 0 ${WIDTH} ${height}`, role: 'img'});
  const x = linear(xDomain, [m.left, WIDTH - m.right]);
  const y = linear(yDomain, [height - m.bottom, m.top]);
  const grid = svg('g', {class: 'grid'});
  const axis = svg('g', {class: 'axis'});
  for (const t of niceTicks(x.domain[0], x.domain[1], 6)) {
    grid.append(svg('line', {x1: x(t), x2: x(t), y1: m.top, y2: height - m.bottom}));
    axis.append(svg('text', {x: x(t), y: height - m.bottom + 14, 'text-anchor': 'middle', text: t.toLocaleString('en-US')}));
  }
  for (const {value, label} of yTicks(y.domain)) {
    grid.append(svg('line', {x1: m.left, x2: WIDTH - m.right, y1: y(value), y2: y(value)}));
    axis.append(svg('text', {x: m.left - 6, y: y(value) + 4, 'text-anchor': 'end', text: label}));
  }
  axis.append(svg('path', {d: `M${m.left},${m.top}V${height - m.bottom}H${WIDTH - m.right}`}));
  axis.append(svg('text', {x: (m.left + WIDTH - m.right) / 2, y: height - 4, 'text-anchor': 'middle', class: 'muted', text: xLabel}));
  axis.append(svg('text', {
    x: 12, y: (m.top + height - m.bottom) / 2, 'text-anchor': 'middle', class: 'muted',
    transform: `rotate(-90 12 ${(m.top + height - m.bottom) / 2})`, text: yLabel,
  }));
  root.append(grid, axis);
  const highlight = svg('line', {class: 'highlight', y1: m.top, y2: height - m.bottom, visibility: 'hidden'});
  return {root, x, y, m, height, highlight};
}

function stepRange(run) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const s of Object.values(run.series)) {
    if (!s || !s.steps.length) continue;
    lo = Math.min(lo, s.steps[0]);
    hi = Math.max(hi, s.steps[s.steps.length - 1]);
  }
  for (const e of run.summary.events) {
    lo = Math.min(lo, e.step);
    hi = Math.max(hi, e.step);
  }
  if (run.loss_scale_begin) lo = Math.min(lo, run.loss_scale_begin.step);
  for (const [after, upto] of run.events_lost_between || []) {
    lo = Math.min(lo, after);
    hi = Math.max(hi, upto);
  }
  return Number.isFinite(lo) ? [Math.min(lo, hi), hi] : [0, 1];
}

/** Loss scale on a log2 axis, a step line, with a marker per event. */
function lossScaleChart(run, view) {
  const begin = run.loss_scale_begin;
  const events = run.summary.events;
  let series = run.series.loss_scale;
  if (begin && begin.value > 0) { // the scale written at train begin starts the line
    if (!series || !series.steps.length || series.steps[0] > begin.step) {
      series = {
        steps: [begin.step].concat(series ? series.steps : []),
        values: [begin.value].concat(series ? series.values : []),
      };
    }
  }
  const logs = [];
  if (series) series.values.forEach((v) => v > 0 && logs.push(Math.log2(v)));
  events.forEach((e) => [e.old_scale, e.new_scale].forEach((v) => v > 0 && logs.push(Math.log2(v))));
  if (!logs.length) return el('p', {class: 'hint', text: 'No loss scale was logged for this run.'});
  const lo = Math.floor(Math.min(...logs)) - 0.5;
  const hi = Math.ceil(Math.max(...logs)) + 0.5;
  const f = frame({
    xDomain: stepRange(run), yDomain: [lo, hi], height: 260, yLabel: 'loss scale (log2)',
    yTicks: ([a, b]) => {
      const every = Math.max(1, Math.ceil((b - a) / 8));
      const ticks = [];
      for (let k = Math.ceil(a); k <= b; k += every) ticks.push({value: k, label: `2^${k}`});
      return ticks;
    },
  });
  if (series && series.steps.length === 1 && series.values[0] > 0) {
    f.root.append(svg('circle', {
      class: 'point', cx: f.x(series.steps[0]), cy: f.y(Math.log2(series.values[0])), r: 3, fill: '#1565c0',
    }, svg('title', {text: `step ${series.steps[0]}: loss scale ${fmtScale(series.values[0])}`})));
  }
  if (series && series.steps.length) {
    let d = '';
    series.steps.forEach((step, i) => {
      const v = series.values[i];
      if (!(v > 0)) return;
      const px = f.x(step).toFixed(1);
      const py = f.y(Math.log2(v)).toFixed(1);
      d += d ? `H${px}V${py}` : `M${px},${py}`;
    });
    const last = series.steps[series.steps.length - 1];
    if (d && last < f.x.domain[1]) d += `H${f.x(f.x.domain[1]).toFixed(1)}`;
    f.root.append(svg('path', {d, class: 'series loss-scale-line', stroke: '#1565c0'}));
  }
  // Over the line: where events were lost, the line between two known scales is a guess.
  for (const [after, upto] of run.events_lost_between || []) {
    f.root.append(svg('rect', {
      class: 'lost-events', x: f.x(after), y: f.m.top, width: Math.max(f.x(upto) - f.x(after), 1),
      height: f.height - f.m.bottom - f.m.top, fill: '#e0e0e0', 'fill-opacity': 0.85,
    }, svg('title', {text: `scale events lost between steps ${after} and ${upto}: the scale here is not known`})));
  }
  f.root.append(f.highlight);
  const markers = svg('g', {class: 'markers'});
  for (const e of events) {
    if (!(e.old_scale > 0)) continue;
    const mark = markerShape(e.kind, f.x(e.step), f.y(Math.log2(e.old_scale)));
    mark.classList.add('marker');
    mark.dataset.step = e.step;
    mark.dataset.kind = e.kind;
    mark.append(svg('title', {text: plainLine(e)}));
    mark.addEventListener('mouseenter', (ev) => showTooltip(e.line || '', ev));
    mark.addEventListener('mousemove', (ev) => moveTooltip(ev));
    mark.addEventListener('mouseleave', hideTooltip);
    mark.addEventListener('click', () => view.select(e));
    markers.append(mark);
  }
  f.root.append(markers);
  f.root.append(precisionMarkers(run, f));
  view.onSelect((e) => {
    placeHighlight(f, e && e.step);
    for (const mark of markers.children) {
      mark.classList.toggle('selected', !!e && Number(mark.dataset.step) === e.step && mark.dataset.kind === e.kind);
    }
  });
  return f.root;
}

/** A dashed line at each step where PrecisionAutopilot moved a layer, its line on hover. */
function precisionMarkers(run, f) {
  const group = svg('g', {class: 'precision-moves'});
  (run.summary.precision_moves || []).forEach((m, i) => {
    const x = f.x(m.step);
    const line = (run.precision_lines || [])[i] || '';
    const mark = svg('g', {class: 'precision-move', 'data-step': m.step}, [
      svg('line', {x1: x, x2: x, y1: f.m.top, y2: f.height - f.m.bottom, stroke: '#2e7d32', 'stroke-dasharray': '5 3'}),
      svg('path', {d: `M${x},${f.m.top - 1}l5,5l-5,5l-5,-5z`, fill: '#2e7d32'}),
      svg('title', {text: plainText(line)}),
    ]);
    mark.addEventListener('mouseenter', (ev) => showTooltip(line, ev));
    mark.addEventListener('mousemove', (ev) => moveTooltip(ev));
    mark.addEventListener('mouseleave', hideTooltip);
    group.append(mark);
  });
  return group;
}

/** The "Precision changes" table: one row per move, the float16 share and the plan's code. */
function precisionTable(run) {
  const moves = run.summary.precision_moves || [];
  const wrap = el('div');
  const table = el('table', {class: 'precision-moves-table'}, [
    el('thead', {}, el('tr', {}, ['step', 'layer', 'class', 'policy', 'why'].map((h) => el('th', {text: h})))),
    el('tbody', {}, moves.map((m) => el('tr', {}, [
      el('td', {text: String(m.step)}), el('td', {}, el('code', {text: m.layer})),
      el('td', {text: m.layer_class}), el('td', {text: `${m.from_policy} → ${m.to_policy}`}),
      el('td', {text: m.reason}),
    ]))),
  ]);
  wrap.append(table);
  const share = run.summary.float16_share;
  if (share && share.first !== null && share.last !== null) {
    wrap.append(el('p', {class: 'float16-share', text: `Still computed in float16: ${fmtPercent(share.first, 1)} at train begin, ${fmtPercent(share.last, 1)} at the end, of the estimated multiply-adds (parameters where those are unknown: kmix/notes says which; kmix/float16_share).`}));
  }
  if (run.precision_code) wrap.append(el('pre', {class: 'plan-code', text: run.precision_code}));
  return wrap;
}

function placeHighlight(f, step) {
  if (step === null || step === undefined) {
    f.highlight.setAttribute('visibility', 'hidden');
    return;
  }
  const px = f.x(step);
  f.highlight.setAttribute('x1', px);
  f.highlight.setAttribute('x2', px);
  f.highlight.setAttribute('visibility', 'visible');
}

/** Lines over steps with horizontal reference lines; null values are gaps. */
function lineChart(run, view, {lines, refs, yLabel}) {
  const values = lines.flatMap((l) => l.series.values.filter((v) => v !== null));
  refs.forEach((r) => values.push(r.value));
  const lo = Math.min(...values);
  const hi = Math.max(...values);
  const pad = (hi - lo) * 0.08 || 1;
  const f = frame({
    xDomain: stepRange(run), yDomain: [lo - pad, hi + pad], height: 200, yLabel,
    yTicks: ([a, b]) => niceTicks(a, b, 5).map((t) => ({value: t, label: fmtNumber(t)})),
  });
  // Reference lines are named in the legend below, never on the chart: a label there
  // would be crossed by the lines it explains.
  refs.forEach((r) => {
    f.root.append(svg('line', {
      x1: f.m.left, x2: WIDTH - f.m.right, y1: f.y(r.value), y2: f.y(r.value),
      stroke: r.color, 'stroke-dasharray': r.dash || null, 'stroke-width': 1.2, class: 'ref-line',
    }, svg('title', {text: r.label})));
  });
  for (const line of lines) {
    let d = '';
    const values = line.series.values;
    line.series.steps.forEach((step, i) => {
      const v = values[i];
      if (v === null) {
        f.root.append(svg('line', {
          x1: f.x(step), x2: f.x(step), y1: f.height - f.m.bottom, y2: f.height - f.m.bottom - 8,
          stroke: '#c62828', 'stroke-width': 2, class: 'nonfinite-tick',
        }, svg('title', {text: `step ${step}: ${line.label} not finite (overflow)`})));
        return;
      }
      const joined = i > 0 && values[i - 1] !== null;
      d += `${joined ? 'L' : 'M'}${f.x(step).toFixed(1)},${f.y(v).toFixed(1)}`;
      const alone = !joined && (i === values.length - 1 || values[i + 1] === null);
      if (alone) { // a reading without a neighbour draws no line: show it as a point
        f.root.append(svg('circle', {cx: f.x(step), cy: f.y(v), r: 3, fill: line.color, class: 'point'},
          svg('title', {text: `step ${step}: ${line.label} ${fmtNumber(v)}`})));
      }
    });
    f.root.append(svg('path', {d, class: 'series', stroke: line.color}, svg('title', {text: line.label})));
  }
  f.root.append(f.highlight);
  view.onSelect((e) => placeHighlight(f, e && e.step));
  const readings = (l) => {
    const n = l.series.points === undefined ? l.series.steps.length : l.series.points;
    return n === 1 ? ' (1 reading)' : '';
  };
  const legend = el('div', {class: 'legend'}, lines.map((l) => el('span', {}, [
    svg('svg', {viewBox: '0 0 12 12'}, svg('line', {x1: 0, x2: 12, y1: 6, y2: 6, stroke: l.color, 'stroke-width': 3})),
    l.label + readings(l),
  ])).concat(refs.map((r) => el('span', {class: 'ref'}, [
    svg('svg', {viewBox: '0 0 12 12'}, svg('line', {x1: 0, x2: 12, y1: 6, y2: 6, stroke: r.color, 'stroke-width': 1.5, 'stroke-dasharray': r.dash ? '3 2' : null})),
    r.label,
  ]))));
  return el('div', {}, [f.root, legend]);
}

// --------------------------------------------------------------------- heatmaps
function viridis(t) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2);
  const u = x - i;
  const c = stops[i].map((a, k) => Math.round(a + u * (stops[i + 1][k] - a)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

/** A share of elements as a colour: viridis over log10(share) from 1e-6 to 1. */
function shareColor(share) {
  return viridis((Math.log10(share) + 6) / 6);
}

/** The colour scale of the exponent heatmap: a viridis bar with share ticks. */
function colourScale(x0, y, width) {
  const g = svg('g', {class: 'colour-scale'});
  const steps = 48;
  for (let i = 0; i < steps; i++) {
    g.append(svg('rect', {x: x0 + (i * width) / steps, y, width: width / steps + 0.5, height: 10, fill: viridis(i / (steps - 1))}));
  }
  g.append(svg('text', {x: x0 - 6, y: y + 9, 'text-anchor': 'end', class: 'band-label muted', text: 'share of elements'}));
  for (const [t, label] of [[0, '≤0.0001%'], [1 / 3, '0.01%'], [2 / 3, '1%'], [1, '100%']]) {
    g.append(svg('line', {x1: x0 + t * width, x2: x0 + t * width, y1: y + 10, y2: y + 13, stroke: '#616161'}));
    g.append(svg('text', {x: x0 + t * width, y: y + 23, 'text-anchor': 'middle', class: 'band-label muted', text: label}));
  }
  return g;
}

/**
 * Variables x exponent bins at one step. Float16 variables come first, with float16's
 * range drawn as bands over their rows; variables whose layers compute in another dtype
 * (`other`: name -> dtype) come below a rule, without float16's limits.
 */
function exponentHeatmap(map, f16, selectedVariable, other = {}) {
  const first = f16.exponent_min - 2;
  const last = first + f16.bins;
  const rowH = 14;
  const labelW = 190;
  const top = 30;
  const rows = map.variables.map((name, row) => row);
  const half = rows.filter((row) => !(map.variables[row] in other));
  const rest = rows.filter((row) => map.variables[row] in other);
  const ordered = half.concat(rest);
  const gap = rest.length ? 18 : 0;
  const yOf = (k) => top + k * rowH + (k >= half.length ? gap : 0);
  const halfBottom = top + half.length * rowH;
  const bottom = top + ordered.length * rowH + gap;
  const height = bottom + 80;
  const root = svg('svg', {viewBox: `0 0 ${WIDTH} ${height}`, role: 'img', class: 'exponent-heatmap'});
  const x = linear([first, last], [labelW, WIDTH - 10]);
  const cellW = x(first + 1) - x(first);
  const bands = [
    {from: first + 1, to: f16.min_subnormal_exponent, color: '#ffcdd2', label: 'flushed to 0 (< 2^-24)', priority: 1},
    {from: f16.min_subnormal_exponent, to: f16.min_normal_exponent, color: '#ffe0b2', label: 'subnormal', priority: 2},
    {from: f16.max_exponent + 1, to: last - 1, color: '#ffcdd2', label: '> 65504', priority: 0},
  ];
  if (half.length) {
    for (const b of bands) {
      root.append(svg('rect', {x: x(b.from), y: top, width: x(b.to) - x(b.from), height: halfBottom - top, fill: b.color, class: 'band'}));
      root.append(svg('text', {x: (x(b.from) + x(b.to)) / 2, y: top - 6, 'text-anchor': 'middle', class: 'band-label muted declutter', 'data-priority': b.priority, text: b.label}));
    }
  }
  if (rest.length) {
    const dtypes = [...new Set(rest.map((row) => other[map.variables[row]]))].sort().join(' and ');
    root.append(svg('line', {x1: 2, x2: WIDTH - 10, y1: halfBottom + 2, y2: halfBottom + 2, stroke: '#9e9e9e', class: 'dtype-rule'}));
    root.append(svg('text', {x: labelW, y: halfBottom + 14, class: 'band-label muted dtype-note', text: `below: ${dtypes} layers, float16's limits do not apply to them`}));
  }
  ordered.forEach((row, k) => {
    const name = map.variables[row];
    const y = yOf(k);
    const dtype = other[name];
    const suffix = dtype ? ` (${dtype})` : '';
    const room = 30 - suffix.length;
    const label = (name.length > room ? `…${name.slice(-(room - 1))}` : name) + suffix;
    const shown = name + suffix;
    root.append(svg('text', {x: labelW - 6, y: y + rowH - 3, 'text-anchor': 'end', 'data-variable': name, 'data-dtype': dtype || null, text: label}, svg('title', {text: shown})));
    map.shares[row].forEach((share, i) => {
      if (!(share > 0)) return;
      root.append(svg('rect', {
        class: 'cell', x: x(first + i) + 0.5, y: y + 0.5, width: cellW - 1, height: rowH - 1, fill: shareColor(share),
      }, svg('title', {text: `${name}: ${binLabel(i, first, f16)}: ${fmtPercent(share, 3)} of ${map.elements[row]} elements`})));
    });
  });
  if (half.length) {
    for (const [e, label] of [
      [f16.min_subnormal_exponent, 'float16 min subnormal 2^-24'],
      [f16.min_normal_exponent, 'min normal 2^-14'],
      [f16.max_exponent + 1, 'max 65504'],
    ]) {
      root.append(svg('line', {x1: x(e), x2: x(e), y1: top - 2, y2: halfBottom + 2, stroke: '#c62828', 'stroke-width': 1.2, 'stroke-dasharray': '3 2', class: 'limit'},
        svg('title', {text: label})));
    }
  }
  // Every fourth power of two is labelled where there is room: declutter() keeps the
  // ends (zero, inf/NaN), then 0, then multiples of 8, once the SVG is on the page.
  const ticks = [[first, 'zero', 0], [last - 1, 'inf/NaN', 0]];
  for (let e = 4 * Math.ceil((first + 2) / 4); e <= last - 3; e += 4) ticks.push([e, String(e), e === 0 ? 1 : e % 8 ? 3 : 2]);
  for (const [e, label, priority] of ticks) {
    root.append(svg('text', {x: x(e + 0.5), y: bottom + 14, 'text-anchor': 'middle', class: 'band-label muted tick declutter', 'data-priority': priority, text: label}));
  }
  root.append(svg('text', {x: (labelW + WIDTH) / 2, y: bottom + 30, 'text-anchor': 'middle', class: 'muted', text: 'log2 |scaled gradient| (bin of each power of two)'}));
  root.append(colourScale(labelW, bottom + 44, Math.min(260, WIDTH - labelW - 20)));
  const k = ordered.findIndex((row) => map.variables[row] === selectedVariable);
  if (k >= 0) {
    root.append(svg('rect', {class: 'row-outline', x: 2, y: yOf(k), width: WIDTH - 8, height: rowH}));
  }
  return root;
}

/**
 * Moves each label (`text.declutter`) of an SVG on the page inside its view box, then
 * drops those that would overlap a label kept before them, in order of `data-priority`
 * (0 first): no axis label is clipped or drawn over another, whatever the width or font.
 */
function declutter(root) {
  const width = root.viewBox.baseVal.width;
  const labels = [...root.querySelectorAll('text.declutter')]
    .sort((a, b) => Number(a.dataset.priority) - Number(b.dataset.priority));
  const kept = [];
  for (const label of labels) {
    let box = label.getBBox();
    if (!box.width) continue; // not rendered: nothing to measure
    const shift = Math.max(2 - box.x, 0) + Math.min(width - 2 - (box.x + box.width), 0);
    if (shift) {
      label.setAttribute('x', Number(label.getAttribute('x')) + shift);
      box = label.getBBox();
    }
    const gap = 4;
    const hit = kept.some((k) => box.x < k.x + k.width + gap && k.x < box.x + box.width + gap
      && box.y < k.y + k.height && k.y < box.y + box.height);
    if (hit) label.remove();
    else kept.push(box);
  }
}

function binLabel(i, first, f16) {
  if (i === 0) return 'exactly zero';
  if (i === f16.bins - 1) return 'inf or NaN';
  if (i === 1) return `below 2^${f16.exponent_min}`;
  if (i === f16.bins - 2) return `2^${f16.exponent_max + 1} or more`;
  return `[2^${first + i}, 2^${first + i + 1})`;
}

/** Columns to label under a grid of `n` step columns: about `count`, evenly spread. */
function columnTicks(n, count) {
  if (n <= count) return [...Array(n).keys()];
  const picked = new Set();
  for (let k = 0; k < count; k++) picked.add(Math.round((k * (n - 1)) / (count - 1)));
  return [...picked].sort((a, b) => a - b);
}

/**
 * Headroom in bits as a colour, calmer as headroom grows: dark red for inf/NaN, red
 * below 0 bits (overflow), orange below 1, amber below 4, then one ramp of greens that
 * gets lighter up to 24 bits and stays there (clamped). All-zero (`'zero'`) and
 * unmeasured (null) cells have none: they are drawn blank.
 */
const HEADROOM_CLASSES = [ // [upper bound (exclusive), colour, legend words, a value in it]
  [0, '#c62828', '< 0 bits (overflow)', -1],
  [1, '#f4511e', '< 1', 0.5],
  [4, '#ffb300', '< 4', 2],
];
const HEADROOM_NONFINITE = '#7f0000';
const HEADROOM_RAMP = [[4, [35, 139, 69]], [8, [65, 171, 93]], [12, [116, 196, 118]], [16, [161, 217, 155]], [24, [199, 233, 192]]];

function headroomColor(bits) {
  if (bits === 'nonfinite') return HEADROOM_NONFINITE;
  if (typeof bits !== 'number') return null;
  for (const [below, color] of HEADROOM_CLASSES) if (bits < below) return color;
  const b = Math.min(bits, HEADROOM_RAMP[HEADROOM_RAMP.length - 1][0]);
  const i = HEADROOM_RAMP.findIndex((_, k) => k === HEADROOM_RAMP.length - 2 || b < HEADROOM_RAMP[k + 1][0]);
  const [[b0, c0], [b1, c1]] = [HEADROOM_RAMP[i], HEADROOM_RAMP[i + 1]];
  const u = (b - b0) / (b1 - b0);
  const c = c0.map((v, k) => Math.round(v + u * (c1[k] - v)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

/** The legend of the headroom grids, drawn with headroomColor itself. */
function headroomLegend() {
  const swatch = (bits, fill, extra = {}) => svg('svg', {viewBox: '0 0 12 12', 'aria-hidden': 'true'},
    svg('rect', {x: 0.5, y: 0.5, width: 11, height: 11, fill, 'data-bits': bits, ...extra}));
  const items = [el('span', {}, [swatch('nonfinite', headroomColor('nonfinite')), 'inf/NaN'])];
  for (const [, , words, bits] of HEADROOM_CLASSES) items.push(el('span', {}, [swatch(bits, headroomColor(bits)), words]));
  const top = HEADROOM_RAMP[HEADROOM_RAMP.length - 1][0];
  const ramp = svg('svg', {viewBox: `0 0 ${4 * (top - 3)} 12`, class: 'ramp', 'aria-hidden': 'true'});
  for (let bits = 4; bits <= top; bits++) {
    ramp.append(svg('rect', {x: 4 * (bits - 4), y: 0.5, width: 4.5, height: 11, fill: headroomColor(bits), 'data-bits': bits}));
  }
  items.push(el('span', {}, [`${HEADROOM_RAMP[0][0]} `, ramp, ` ${top}+ bits (more room, lighter)`]));
  items.push(el('span', {}, [swatch('zero', 'none', {stroke: '#bdbdbd'}), 'blank: all zero, or not measured at that step']));
  return el('div', {class: 'legend headroom-legend'}, items);
}

/**
 * Names x steps, coloured by headroom bits (`colorOf(bits, row, column)`, float16's
 * headroomColor unless given: float8's scale differs). Steps are labelled under
 * their columns; `grid.left_out` (name -> dtype) names the variables whose layers do
 * not compute in float16, which have no float16 headroom.
 */
function headroomGrid(grid, title, colorOf = headroomColor) {
  const rowH = 14;
  const labelW = 190;
  const top = 22;
  const leftOut = Object.entries(grid.left_out || {});
  const bottom = top + grid.names.length * rowH;
  const height = bottom + 32 + (leftOut.length ? 14 : 0);
  const root = svg('svg', {viewBox: `0 0 ${WIDTH} ${height}`, role: 'img', class: 'headroom-grid'});
  root.append(svg('text', {x: labelW, y: 14, class: 'muted', text: title}));
  const n = grid.steps.length;
  const cellW = (WIDTH - 10 - labelW) / Math.max(n, 1);
  grid.names.forEach((name, row) => {
    const y = top + row * rowH;
    const label = name.length > 30 ? `…${name.slice(-29)}` : name;
    root.append(svg('text', {x: labelW - 6, y: y + rowH - 3, 'text-anchor': 'end', text: label}, svg('title', {text: name})));
    grid.bits[row].forEach((bits, i) => {
      const color = colorOf(bits, row, i);
      const words = bits === 'nonfinite' ? 'inf/NaN' : bits === 'zero' ? 'all zero: no headroom to speak of'
        : bits === null ? 'not measured at this step' : `${bits} bits`;
      root.append(svg('rect', {
        class: 'cell', x: labelW + i * cellW, y: y + 0.5, width: Math.max(cellW - 0.5, 0.5), height: rowH - 1,
        fill: color || 'none', 'pointer-events': 'all', 'data-row': name, 'data-bits': bits === null ? 'none' : bits,
      }, svg('title', {text: `${name} at step ${grid.steps[i]}: ${words}`})));
    });
  });
  if (n && grid.names.length) {
    const ticks = svg('g', {class: 'step-ticks'});
    const width = WIDTH - 10 - labelW;
    for (const i of columnTicks(n, Math.max(2, Math.min(8, Math.floor(width / 70))))) {
      const cx = labelW + (i + 0.5) * cellW;
      ticks.append(svg('line', {x1: cx, x2: cx, y1: bottom, y2: bottom + 3, stroke: '#9e9e9e'}));
      ticks.append(svg('text', {x: cx, y: bottom + 13, 'text-anchor': 'middle', class: 'band-label muted declutter', 'data-priority': i === 0 || i === n - 1 ? 0 : 1, text: grid.steps[i].toLocaleString('en-US')}));
    }
    root.append(ticks);
    root.append(svg('text', {x: labelW - 6, y: bottom + 13, 'text-anchor': 'end', class: 'band-label muted', text: 'step'}));
  }
  if (leftOut.length) {
    const dtypes = [...new Set(leftOut.map(([, dtype]) => dtype))].sort().join(' and ');
    const names = leftOut.map(([name]) => name);
    const listed = names.slice(0, 4).join(', ') + (names.length > 4 ? ` and ${names.length - 4} more` : '');
    root.append(svg('text', {x: labelW, y: bottom + 28, class: 'band-label muted left-out',
      text: `not shown: ${listed} (${dtypes} layers: float16's max does not apply)`}));
  }
  return root;
}

// ---------------------------------------------------------------------- tables
function eventsTable(run, view) {
  const events = run.summary.events;
  const wrap = el('div');
  if (!events.length) {
    wrap.append(el('p', {class: 'hint', text: 'No scale events: no skipped step and no change of scale.'}));
    return {wrap, filters: null};
  }
  const counts = {};
  events.forEach((e) => (counts[e.kind] = (counts[e.kind] || 0) + 1));
  const shown = new Set(Object.keys(counts));
  const filters = el('div', {class: 'filters'});
  for (const kind of Object.keys(counts)) {
    const box = el('input', {type: 'checkbox', checked: 'checked', 'data-kind': kind});
    box.addEventListener('change', () => {
      if (box.checked) shown.add(kind);
      else shown.delete(kind);
      fill();
    });
    filters.append(el('label', {class: 'kind'}, [box, swatch(kind), `${kind} (${counts[kind]})`]));
  }
  const hasOrigin = events.some((e) => e.origin);
  const head = ['step', 'kind', 'old → new scale', 'first non-finite variable', 'forward origin layer', 'loss finite'];
  const table = el('table', {class: 'events'}, [
    el('thead', {}, el('tr', {}, head.map((h, i) => el('th', {class: i === 0 ? 'num' : null, text: h})))),
  ]);
  const body = el('tbody');
  table.append(body);
  const note = el('p', {class: 'hint'});
  function fill() {
    const rows = events.filter((e) => shown.has(e.kind));
    body.replaceChildren();
    for (const e of rows.slice(0, MAX_ROWS)) {
      const tr = el('tr', {'data-step': e.step, 'data-kind': e.kind, title: plainLine(e)}, [
        el('td', {class: 'num step', text: e.step}),
        el('td', {}, el('span', {class: 'kind'}, [swatch(e.kind), e.kind])),
        el('td', {class: 'scale', text: `${fmtScale(e.old_scale)} → ${fmtScale(e.new_scale)}`}),
        el('td', {class: 'variable', text: e.variable || ''}),
        el('td', {class: 'origin', text: originText(e.origin) || (hasOrigin ? '' : '—')}),
        el('td', {class: e.loss_finite === false ? 'bad loss' : 'loss', text: lossFiniteText(e.loss_finite)}),
      ]);
      tr.addEventListener('click', () => view.select(view.selected === e ? null : e));
      tr.event = e;
      body.append(tr);
    }
    note.textContent = rows.length > MAX_ROWS ? `Showing the first ${MAX_ROWS} of ${rows.length} events; filter by kind to see others.` : `${rows.length} of ${events.length} events shown.`;
    markRows();
  }
  function markRows() {
    for (const tr of body.children) tr.classList.toggle('selected', tr.event === view.selected);
  }
  view.onSelect(markRows);
  fill();
  wrap.append(el('div', {class: 'table-wrap'}, table), note);
  return {wrap, filters};
}

function whatIfTables(summary, float16Note) {
  if (!('precision_whatif' in summary)) {
    return el('p', {class: 'hint', text: 'This version of kmix report has no precision what-if.'});
  }
  const whatif = summary.precision_whatif;
  const groups = whatif ? Object.entries(whatif).filter(([, g]) => g) : [];
  if (!groups.length && float16Note) return el('p', {class: 'hint float16-note', text: `No exponent histograms in this run. ${float16Note}.`});
  if (!groups.length) {
    return el('p', {class: 'hint', text: 'No exponent histograms in this run: set histogram_freq on MixedPrecisionMonitor to record them.'});
  }
  const out = el('div');
  for (const [group, data] of groups) {
    const formats = Object.keys(data.overall);
    const parts = ['underflow', 'subnormal', 'overflow'];
    const head1 = el('tr', {}, [el('th', {text: `${group} (step ${data.step})`, rowspan: 2})].concat(
      formats.map((f) => el('th', {text: f, colspan: parts.length, class: 'num'}))));
    const head2 = el('tr', {}, formats.flatMap(() => parts.map((p) => el('th', {class: 'num', text: p}))));
    const rows = [['all', data.overall]].concat(Object.entries(data.by_variable || {}));
    const real = data.float8_headroom_bits || {};
    const body = el('tbody', {}, rows.map(([name, byFormat]) => el('tr', {'data-variable': name}, [
      el('td', {text: name === 'all' ? 'all values' : name in real ? `${name} *` : name}),
    ].concat(formats.flatMap((f) => parts.map((p) => {
      const v = byFormat[f] ? byFormat[f][p] : null;
      const cls = v === null ? 'num' : p !== 'subnormal' && v > 0.01 ? 'num bad' : v > 0.01 ? 'num warn' : 'num';
      return el('td', {class: cls, text: fmtPercent(v)});
    }))))));
    out.append(el('div', {class: 'table-wrap'}, el('table', {class: 'whatif-table'}, [el('thead', {}, [head1, head2]), body])));
    const layers = {};
    for (const [variable, bits] of Object.entries(real)) layers[variable.slice(0, variable.lastIndexOf('/'))] = bits;
    if (Object.keys(layers).length) {
      const words = Object.entries(layers).map(([layer, bits]) => `${layer} ${bits.toFixed(2)} bits`).join(', ');
      out.append(el('p', {class: 'hint float8-whatif', text: `* fp8_e5m2 as if held at the float8 layer's real output-gradient headroom, not scaled to its max (a proxy: Keras holds the layer's output gradients in E5M2, not these): ${words}. Other FP8 columns: scaled per tensor to its max.`}));
    }
  }
  return out;
}

function summaryPanel(run) {
  const s = run.summary;
  const scale = s.loss_scale || {};
  const counts = Object.entries(s.event_counts || {}).map(([k, n]) => `${k} ${n}`).join(', ') || 'none';
  const facts = [
    ['steps seen', String(s.steps_seen)],
    ['skipped steps', `${s.skipped_steps} (${fmtPercent(s.skip_rate)})`],
    ['latest skip rate', fmtPercent(s.recent_skip_rate)],
    ['loss scale', `initial ${fmtScale(scale.initial)}, final ${fmtScale(scale.final)}, min ${fmtScale(scale.min)}, max ${fmtScale(scale.max)}${run.scale_caveat || ''}`],
    ['compute dtype', s.compute_dtype || 'unknown'],
    ['events', counts],
  ];
  if (run.processes) facts.push(['processes', run.processes]);
  if (s.run && (s.runs || []).length > 1) facts.unshift(['run', `${s.run.index} of ${s.runs.length} kmix runs in this directory${s.run.index === s.runs.length ? ' (the latest)' : ''}`]);
  const dl = el('dl', {class: 'facts'}, facts.flatMap(([k, v]) => [el('dt', {text: k}), el('dd', {text: v})]));
  const findings = el('ul', {class: 'findings'}, (s.findings || []).map((f) =>
    el('li', {class: f.severity, 'data-rule': f.rule}, inline(f.message))));
  return el('div', {}, [dl, findings]);
}

// ------------------------------------------------------------ markdown, safely
/** `code`, **bold** and *italic* spans of one line as nodes; everything else is text. */
function inline(text) {
  const nodes = [];
  const re = /`([^`]+)`|\*\*([^*]+)\*\*|\*([^*]+)\*/g;
  let at = 0;
  for (let m = re.exec(text); m; m = re.exec(text)) {
    if (m.index > at) nodes.push(text.slice(at, m.index));
    if (m[1] !== undefined) nodes.push(el('code', {text: m[1]}));
    else if (m[2] !== undefined) nodes.push(el('strong', {text: m[2]}));
    else nodes.push(el('em', {text: m[3]}));
    at = m.index + m[0].length;
  }
  if (at < text.length) nodes.push(text.slice(at));
  return nodes;
}

function cells(line) {
  return line.trim().replace(/^\|/, '').replace(/\|$/, '').split('|').map((c) => c.trim());
}

/** Paragraphs and pipe tables of the kmix/policy markdown, built as elements. */
function markdown(text) {
  const out = el('div');
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (!line.trim()) continue;
    if (!line.trim().startsWith('|')) {
      const item = /^\s*[-*] /.test(line);
      out.append(el('p', {class: item ? 'item' : null}, inline(item ? `• ${line.trim().slice(2)}` : line)));
      continue;
    }
    const block = [];
    while (i < lines.length && lines[i].trim().startsWith('|')) block.push(lines[i++]);
    i--;
    const rows = block.filter((l) => !/^\s*\|?[\s:|-]+\|?\s*$/.test(l)).map(cells);
    const [head, ...rest] = rows;
    out.append(el('div', {class: 'table-wrap'}, el('table', {class: 'md'}, [
      el('thead', {}, el('tr', {}, head.map((c) => el('th', {}, inline(c))))),
      el('tbody', {}, rest.map((r) => el('tr', {}, r.map((c) => el('td', {}, inline(c)))))),
    ])));
  }
  return out;
}

// --------------------------------------------------------------------- tooltip
/** Shows a line (its `code` and **bold** spans as elements, the rest as text). */
function showTooltip(text, ev) {
  const tip = document.getElementById('tooltip');
  tip.replaceChildren(...inline(text));
  tip.hidden = false;
  moveTooltip(ev);
}

function moveTooltip(ev) {
  const tip = document.getElementById('tooltip');
  const x = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 8);
  tip.style.left = `${Math.max(x, 4)}px`;
  tip.style.top = `${ev.clientY + 14}px`;
}

function hideTooltip() {
  document.getElementById('tooltip').hidden = true;
}

// ------------------------------------------------------------------------ data
async function getJSON(url) {
  const response = await fetch(url);
  let body = null;
  try {
    body = await response.json();
  } catch (error) {
    throw new Error(`${url}: HTTP ${response.status}, not JSON`);
  }
  if (!response.ok) throw new Error(body && body.error ? body.error : `${url}: HTTP ${response.status}`);
  return body;
}

/** Selection shared by a run's panels: the chosen event. */
function selection() {
  const listeners = [];
  const view = {
    selected: null,
    onSelect(fn) {
      listeners.push(fn);
    },
    select(e) {
      view.selected = e;
      listeners.forEach((fn) => fn(e));
    },
  };
  return view;
}

// ---------------------------------------------------------------------- a run
function nearest(steps, step) {
  let best = steps[steps.length - 1];
  for (const s of steps) if (Math.abs(s - step) < Math.abs(best - step)) best = s;
  return best;
}

function exponentPanel(run, view, select, slot) {
  const data = run.exponents;
  let current = data.heatmap;
  let variable = null;
  const other = run.summary.variables_not_float16 || {};
  const draw = () => {
    const map = exponentHeatmap(current, run.float16, variable, other);
    slot.replaceChildren(map);
    declutter(map);
  };
  select.replaceChildren(...data.steps.map((s) => el('option', {value: s, text: s})));
  select.value = String(current.step);
  const load = async (step) => {
    if (step === current.step) return draw();
    try {
      current = await getJSON(`./exponents?${new URLSearchParams({run: run.run, step: String(step)})}`);
      select.value = String(step);
      draw();
    } catch (error) {
      slot.replaceChildren(el('p', {class: 'error', text: error.message}));
    }
  };
  select.addEventListener('change', () => load(Number(select.value)));
  view.onSelect((e) => {
    variable = e ? e.variable : null;
    if (e) load(nearest(data.steps, e.step));
    else draw();
  });
  draw();
}

function fillRun(section, run) {
  const q = (sel) => section.querySelector(sel);
  WIDTH = Math.max(480, Math.round(q('.panel').clientWidth - 26));
  if (run.empty) {
    q('.run-body').hidden = true;
    const box = q('.run-empty');
    box.hidden = false;
    box.append(el('p', {class: 'empty-message', text: run.message}));
    return;
  }
  const eventLines = run.event_lines || [];
  run.summary.events.forEach((e, i) => (e.line = eventLines[i] || ''));
  const view = selection();
  const check = run.events_check;
  if (check && check.message) {
    const banner = q('.banner');
    banner.hidden = false;
    banner.append(...inline(check.message));
  }
  if (run.runs_note) {  // the directory holds several kmix runs: this is one of them
    const banner = q('.banner');
    banner.hidden = false;
    if (banner.childNodes.length) banner.append(el('br'));
    banner.append(el('span', {class: 'runs-note'}, inline(run.runs_note)));
  }
  // A run that computes nothing in float16 and whose scale never moved: no flat line.
  if (run.loss_scale_note) q('.loss-scale').append(el('p', {class: 'hint loss-scale-note', text: run.loss_scale_note}));
  else q('.loss-scale').append(lossScaleChart(run, view));
  const kinds = new Set(run.summary.events.map((e) => e.kind));
  q('.legend').append(...Object.keys(KINDS).filter((k) => kinds.has(k)).map((k) => el('span', {}, [swatch(k), KINDS[k].label])));
  if ((run.events_lost_between || []).length) {
    q('.legend').append(el('span', {class: 'lost'}, [
      svg('svg', {viewBox: '0 0 12 12', 'aria-hidden': 'true'}, svg('rect', {x: 0, y: 0, width: 12, height: 12, fill: '#e0e0e0'})),
      'scale events lost: the scale is not known there',
    ]));
  }
  const table = eventsTable(run, view);
  if (table.filters) q('.filters').replaceWith(table.filters);
  q('.events').append(table.wrap);
  if ((run.summary.precision_moves || []).length) {
    q('.precision-panel').hidden = false;
    q('.precision').append(precisionTable(run));
    q('.legend').append(el('span', {}, [
      svg('svg', {viewBox: '0 0 12 12', 'aria-hidden': 'true'}, svg('line', {x1: 6, x2: 6, y1: 0, y2: 12, stroke: '#2e7d32', 'stroke-dasharray': '3 2', 'stroke-width': 2})),
      'a layer moved out of float16 (PrecisionAutopilot)',
    ]));
  }
  if (run.exponents) {
    exponentPanel(run, view, q('.hist-step'), q('.exponents'));
  } else {
    q('.step-pick').hidden = true;
    q('.exponents').append(el('p', {class: 'hint float16-note', text: run.float16_note || 'No gradient exponent histograms: set histogram_freq on MixedPrecisionMonitor to record them.'}));
  }
  const lines = [];
  if (run.series.overflow_headroom_bits) lines.push({series: run.series.overflow_headroom_bits, label: 'gradient headroom (bits)', color: '#1565c0'});
  if (run.series.min_activation_headroom_bits) lines.push({series: run.series.min_activation_headroom_bits, label: 'activation headroom, min over layers (bits)', color: '#6a1b9a'});
  if (lines.length) {
    q('.headroom').append(lineChart(run, view, {
      lines, yLabel: 'headroom (bits)',
      refs: [{value: 0, label: 'float16 max (65504)', color: '#c62828'}, {value: 1, label: '1 bit', color: '#ef6c00', dash: '4 3'}],
    }));
  } else {
    q('.headroom').append(el('p', {class: 'hint float16-note', text: run.float16_note || 'No headroom was logged for this run.'}));
  }
  const grids = [];
  if (run.headroom_by_variable) grids.push([q('.headroom-grid'), headroomGrid(run.headroom_by_variable, 'gradient headroom per variable (whole bits) over histogram steps')]);
  if (run.activation_headroom) grids.push([q('.activation-grid'), headroomGrid(run.activation_headroom, 'activation headroom per layer (bits) over steps')]);
  for (const [slot, grid] of grids) {
    slot.append(grid);
    declutter(grid);
  }
  if (grids.length) grids[grids.length - 1][0].append(headroomLegend());
  if (run.float8) {
    q('.float8-panel').hidden = false;
    fillFloat8(q('.float8'), run.float8, {el, svg, headroomGrid, declutter});
  }
  q('.whatif').append(whatIfTables(run.summary, run.float16_note));
  q('.summary').append(summaryPanel(run));
  const policy = run.summary.policy;
  q('.policy').append(policy ? markdown(policy) : el('p', {class: 'hint', text: 'No policy was recorded.'}));
}

// --------------------------------------------------------------------- the page
async function loadPage() {
  document.head.append(el('link', {rel: 'stylesheet', href: './static/style.css'}));
  const html = await fetch('./static/index.html').then((r) => r.text());
  const page = new DOMParser().parseFromString(html, 'text/html');
  document.body.replaceChildren(...page.body.childNodes);
}

function showEmpty(listing) {
  const box = document.getElementById('empty');
  box.hidden = false;
  const others = listing.other_runs.length ? ` (runs without it: ${listing.other_runs.join(', ')})` : '';
  box.replaceChildren(
    el('p', {}, el('strong', {text: `No run has kmix data${others}.`})),
    el('p', {}, inline('Record it with `kmix.callbacks.MixedPrecisionMonitor(log_dir)` in `model.fit`, or try `kmix demo`, then start `tensorboard --logdir` on that directory and press Reload.')),
  );
}

async function showRuns(names) {
  const grid = document.getElementById('runs');
  const template = document.getElementById('run-template');
  const status = document.getElementById('status');
  status.textContent = 'Loading…';
  showComparison(names);
  const started = performance.now();
  const sections = names.map((name) => {
    const section = template.content.firstElementChild.cloneNode(true);
    section.dataset.run = name;
    section.querySelector('.run-name').textContent = name;
    return section;
  });
  grid.replaceChildren(...sections);
  await Promise.all(sections.map(async (section, i) => {
    try {
      fillRun(section, await getJSON(`./run?${new URLSearchParams({run: names[i]})}`));
      section.dataset.state = 'ready';
    } catch (error) {
      section.querySelector('.run-body').replaceChildren(el('p', {class: 'error', text: error.message}));
      section.dataset.state = 'error';
    }
  }));
  status.textContent = names.length ? `Drawn in ${Math.round(performance.now() - started)} ms` : 'Pick a run.';
  document.body.dataset.state = 'ready';
}

/** The kmix compare tables recorded in the log dir: [{run, markdown, runs}]. */
let COMPARISONS = [];

async function readComparisons() {
  try {
    COMPARISONS = (await getJSON('./comparison')).comparisons;
  } catch (error) {
    COMPARISONS = [];
  }
}

/**
 * Above the runs, the comparisons one of whose runs is ticked (`names`); one whose
 * runs the plugin could not tell is always shown. Hidden when none is.
 */
function showComparison(names) {
  const box = document.getElementById('comparison');
  const shown = COMPARISONS.filter((c) => !(c.runs || []).length || c.runs.some((r) => names.includes(r)));
  box.hidden = !shown.length;
  box.querySelector('.comparison-body').replaceChildren(...shown.map((c) => el('div', {}, [
    el('p', {class: 'hint', text: `recorded in run ${c.run}`}),
    markdown(c.markdown.replace(/^## /, '')),
  ])));
}

async function start() {
  document.body.dataset.state = 'loading';
  await readComparisons();
  let listing;
  try {
    listing = await getJSON('./runs');
  } catch (error) {
    document.getElementById('empty').hidden = false;
    document.getElementById('empty').replaceChildren(el('p', {class: 'error', text: error.message}));
    document.body.dataset.state = 'ready';
    return;
  }
  const picker = document.getElementById('run-picker');
  picker.replaceChildren();
  document.getElementById('empty').hidden = true;
  if (!listing.runs.length) {
    document.getElementById('run-count').textContent = '';
    showComparison([]);
    showEmpty(listing);
    document.getElementById('runs').replaceChildren();
    document.body.dataset.state = 'ready';
    return;
  }
  const all = listing.runs.concat(listing.other_runs);
  // The plugin picks the run to open on: the first that computes in float16.
  const first = listing.default_run || listing.runs[0];
  const boxes = all.map((name, i) => {
    const box = el('input', {type: 'checkbox', value: name, checked: name === first ? 'checked' : null});
    const ended = (listing.ended || {})[name];  // e.g. stopped by kmix compare: too slow
    const label = el('label', {class: i < listing.runs.length ? null : 'no-data'}, [box, ` ${name}`].concat(ended ? [el('span', {class: 'ended', text: ' (did not complete)'})] : []));
    if (i >= listing.runs.length) label.title = 'no kmix data';
    if (ended) label.title = ended;
    picker.append(label);
    return box;
  });
  const chosen = () => boxes.filter((b) => b.checked).map((b) => b.value);
  // The picker scrolls sideways when the runs do not fit: say how many there are.
  const count = () => (document.getElementById('run-count').textContent = `${chosen().length} of ${all.length} runs:`);
  boxes.forEach((b) => b.addEventListener('change', () => {
    count();
    showRuns(chosen());
  }));
  count();
  await showRuns(chosen());
}

export async function render() {
  await loadPage();
  document.getElementById('reload').addEventListener('click', start);
  await start();
}

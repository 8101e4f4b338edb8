// The Float8 section of a run in the "Mixed Precision" tab (kmix/tbplugin/float8.py's JSON).
//
// index.js imports fillFloat8 and hands it its drawing helpers (el, svg, headroomGrid,
// declutter), so the section draws as the other panels do. Text from the logs only goes
// into textContent or SVG text nodes.

const MAX_ROWS = 200;

/**
 * Float8 headroom as a colour: not float16's scale. Delayed scaling sets each scale from
 * the amax history's max, so a healthy tensor sits at about 0 bits; a clip is read from
 * the saturation episodes (red: clipped since the previous column), below 0 the next step
 * clips at this amax, and headroom above 2 bits means a scale coarser than the amax (a
 * spike still in the history: small values flush to zero).
 */
const FLOAT8_CLASSES = [ // [upper bound (exclusive), colour, legend words, a value in it]
  [0, '#f4511e', '< 0 bits: the next step clips at this amax', -0.5],
  [2, '#41ab5d', '0 to 2 bits: in range (delayed scaling keeps about 0)', 0.5],
  [6, '#9ecae1', '2 to 6: scale coarser than the amax (a spike in the history)', 4],
  [Infinity, '#3182bd', '6+: far coarser: small values flush to zero', 8],
];
const FLOAT8_SATURATED = '#c62828';
const FLOAT8_NONFINITE = '#7f0000';

function float8Color(headroom) {
  return (bits, row, column) => {
    if (headroom.saturated && headroom.saturated[row][column]) return FLOAT8_SATURATED;
    if (bits === 'nonfinite') return FLOAT8_NONFINITE;
    if (typeof bits !== 'number') return null;
    return FLOAT8_CLASSES.find(([below]) => bits < below)[1];
  };
}

function float8Legend({el, svg}) {
  const swatch = (fill, extra = {}) => svg('svg', {viewBox: '0 0 12 12', 'aria-hidden': 'true'},
    svg('rect', {x: 0.5, y: 0.5, width: 11, height: 11, fill, ...extra}));
  const items = [el('span', {}, [swatch(FLOAT8_SATURATED), 'clipped since the previous column (a saturation episode)'])];
  for (const [, color, words] of FLOAT8_CLASSES) items.push(el('span', {}, [swatch(color), words]));
  items.push(el('span', {}, [swatch('none', {stroke: '#bdbdbd'}), 'blank: not read at that step']));
  return el('div', {class: 'legend float8-legend'}, items);
}

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return 'n/a';
  return Number(value).toPrecision(digits).replace(/\.?0+(e|$)/, '$1');
}

function bits(value) {
  if (value === null || value === undefined) return 'n/a';
  const text = Number(value).toFixed(2);
  return text === '-0.00' ? '0.00' : text;
}

function episodesTable(float8, {el}) {
  const wrap = el('div', {class: 'table-wrap float8-episodes'});
  if (!float8.episodes.length) {
    wrap.append(el('p', {class: 'hint', text: 'No saturation episode was recorded (kmix.LossScaleOptimizer records them; with another optimizer only the grid is known).'}));
    return wrap;
  }
  const head = ['first step', 'steps', 'layer', 'tensor', 'amax', 'limit', 'bits over'];
  const body = el('tbody');
  for (const e of float8.episodes.slice(0, MAX_ROWS)) {
    body.append(el('tr', {'data-step': e.step, title: e.line}, [
      el('td', {class: 'num', text: String(e.step)}),
      el('td', {class: 'num', text: String(e.steps)}),
      el('td', {text: e.layer}),
      el('td', {text: e.tensor}),
      el('td', {class: 'num', text: fmt(e.amax)}),
      el('td', {class: 'num', text: fmt(e.limit)}),
      el('td', {class: 'num', text: e.rounding ? 'rounding' : bits(e.bits_over)}),
    ]));
  }
  wrap.append(el('table', {class: 'float8-table'}, [
    el('thead', {}, el('tr', {}, head.map((h, i) => el('th', {class: [0, 1, 4, 5, 6].includes(i) ? 'num' : null, text: h})))),
    body,
  ]));
  if (float8.episode_count > MAX_ROWS) {
    wrap.append(el('p', {class: 'hint', text: `Showing the first ${MAX_ROWS} of ${float8.episode_count} episodes; kmix report --json lists every one.`}));
  }
  return wrap;
}

function tensorsTable(float8, {el}) {
  const head = ['layer', 'tensor', 'read at', 'scale', 'headroom', 'min headroom', 'staleness', 'saturated steps', 'flushed to zero'];
  const body = el('tbody');
  for (const t of float8.tensors) {
    const cells = [t.layer, t.tensor, String(t.step), fmt(t.scale), bits(t.headroom_bits), bits(t.min_headroom_bits), bits(t.staleness_bits),
      t.saturated_steps === null ? 'n/a' : String(t.saturated_steps),
      t.underflow_fraction === null ? '' : `${(100 * t.underflow_fraction).toFixed(1)}%`];
    body.append(el('tr', {}, cells.map((c, i) => el('td', {class: i >= 2 ? 'num' : null, text: c}))));
  }
  return el('div', {class: 'table-wrap float8-tensors'}, el('table', {class: 'float8-table'}, [
    el('thead', {}, el('tr', {}, head.map((h, i) => el('th', {class: i >= 2 ? 'num' : null, text: h})))),
    body,
  ]));
}

/** Fills the Float8 panel's slot: counts, the headroom grid, the episodes, each tensor. */
export function fillFloat8(slot, float8, helpers) {
  const {el, headroomGrid, declutter} = helpers;
  const tensors = float8.tensors.length;
  slot.append(el('p', {class: 'float8-counts', text:
    `${float8.layers.length} float8 layers, ${tensors} tensors; ${float8.episode_count} saturation episodes, `
    + `${float8.saturated_tensor_steps} saturated tensor-steps.`}));
  if (float8.lost_episodes) {
    slot.append(el('p', {class: 'hint float8-lost', text:
      `${float8.lost_episodes} more episodes lost: overwritten in the optimizer's ring before a read (a lower update_freq reads them all).`}));
  }
  if (float8.headroom.steps.length) {
    const grid = headroomGrid(float8.headroom, 'float8 headroom per layer and tensor (bits: log2 of scale x format max / amax) over reads',
      float8Color(float8.headroom));
    slot.append(grid);
    declutter(grid);
    slot.append(float8Legend(helpers));
  }
  slot.append(el('h4', {text: 'Saturation episodes (a tensor clipped at consecutive steps)'}));
  slot.append(episodesTable(float8, helpers));
  slot.append(el('h4', {text: 'Each tensor as last read (bits; staleness: the amax history\'s max over the latest amax)'}));
  slot.append(tensorsTable(float8, helpers));
}

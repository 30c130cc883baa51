// A time-series line chart drawn on a <canvas> by hand: up to the last `span` seconds,
// one line per series, y from 0 to a round number above the largest value shown.

const MARGIN = {left: 52, right: 10, top: 10, bottom: 8};
const LEGEND_ROW = 16;  // pixels per row of the legend above the plot
const MIN_SPAN = 30;  // seconds: the narrowest time axis, while the first points come in

// The smallest 1, 2 or 5 times a power of ten that is >= v.
function roundUp(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// A value in at most 3 significant digits, without trailing zeros.
export const number = (v) => String(Number(v.toPrecision(3)));

export class LineChart {
  // series: [{label, color}]; max: a fixed top (e.g. 100 for a percentage);
  // format: a y value as text.
  constructor(canvas, series, {max = null, format = number, span = 120} = {}) {
    Object.assign(this, {canvas, series, max, format, span});
    this.points = [];  // [t seconds, [value per series, null when unknown]]
  }

  push(t, values) {
    this.points.push([t, values]);
    while (this.points.length && this.points[0][0] < t - this.span) this.points.shift();
    this.canvas.dataset.points = String(this.points.length);  // for tests and curious users
    this.draw();
  }

  clear() {
    this.points = [];
    this.canvas.dataset.points = "0";
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return;  // hidden
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const style = getComputedStyle(canvas);
    const ink = style.color, grid = style.getPropertyValue("--grid").trim() || "#8884";
    ctx.font = `11px ${style.fontFamily}`;

    const top = MARGIN.top + this.legend(ctx, ink, w) * LEGEND_ROW;
    const values = this.points.flatMap(([, vs]) => vs.filter((v) => v != null));
    const yMax = this.max ?? roundUp(Math.max(0, ...values));
    const x0 = MARGIN.left, x1 = w - MARGIN.right, y0 = h - MARGIN.bottom, y1 = top;
    // the time axis grows with the data up to `span` seconds
    const n = this.points.length;
    const tEnd = n ? this.points[n - 1][0] : 0;
    const shown = Math.min(this.span, Math.max(MIN_SPAN, n ? tEnd - this.points[0][0] : 0));
    const x = (t) => x1 - (tEnd - t) / shown * (x1 - x0);
    const y = (v) => y0 - Math.min(v, yMax) / yMax * (y0 - y1);

    // grid lines and their values: 0, half, top
    ctx.strokeStyle = grid;
    ctx.fillStyle = ink;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const v of [0, yMax / 2, yMax]) {
      ctx.beginPath();
      ctx.moveTo(x0, Math.round(y(v)) + 0.5);
      ctx.lineTo(x1, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.fillText(this.format(v), x0 - 6, y(v));
    }

    // one line per series; a gap where a value is unknown
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    this.series.forEach((s, i) => {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let drawing = false;
      for (const [t, vs] of this.points) {
        const v = vs[i];
        if (v == null) { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
        drawing = true;
      }
      ctx.stroke();
    });
  }

  // The series and their latest values, in as many rows as the width needs; the rows.
  legend(ctx, ink, w) {
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    const last = this.points.length ? this.points[this.points.length - 1][1] : [];
    let x = MARGIN.left, row = 0;
    this.series.forEach((s, i) => {
      const text = `${s.label} ${last[i] == null ? "-" : this.format(last[i])}`;
      const width = 14 + ctx.measureText(text).width;
      if (x > MARGIN.left && x + width > w - MARGIN.right) {
        x = MARGIN.left;
        row += 1;
      }
      const y = 4 + row * LEGEND_ROW;
      ctx.fillStyle = s.color;
      ctx.fillRect(x, y + 1, 10, 10);
      ctx.fillStyle = ink;
      ctx.fillText(text, x + 14, y);
      x += width + 14;
    });
    return row + 1;
  }
}

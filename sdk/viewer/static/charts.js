// Line charts as SVG, no library: series of (x, y) points, an optional band (x, low, high) per series.
// Used by viewer.js for a run's curves; redrawn in place as new steps arrive.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
  if (text !== undefined) el.textContent = text;
  return el;
}

// Round tick steps (1, 2 or 5 times a power of ten) and labels with just the decimals the step needs.
function niceStep(span, count) {
  const raw = span / count, power = Math.pow(10, Math.floor(Math.log10(raw)));
  const fraction = raw / power;
  return (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10) * power;
}

function tickLabel(value, step) {
  if (Math.abs(value) < step / 2) return "0";
  const abs = Math.abs(value);
  if (abs < 1e-3 || abs >= 1e5) return value.toExponential(Math.max(0, Math.round(Math.log10(abs) - Math.log10(step))));
  return value.toFixed(Math.max(0, -Math.floor(Math.log10(step))));
}

function niceNumber(value) {
  if (!isFinite(value)) return "";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(1);
  return String(Math.round(value * 1000) / 1000);
}

// chart: {title, series: [{name, points: [[x, y]], band: [[x, lo, hi]]}], yLabel}
function drawChart(container, chart) {
  const width = 420, height = 230, left = 56, right = 12, top = 38, bottom = 34;
  const svg = svgEl("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart", "data-chart": chart.title,
                            role: "img", "aria-label": chart.title});
  svg.appendChild(svgEl("text", {x: left, y: 16, class: "chart-title"}, chart.title));
  const xs = [], ys = [];
  for (const s of chart.series) {
    for (const [x, y] of s.points) { xs.push(x); ys.push(y); }
    for (const [x, lo, hi] of s.band || []) { xs.push(x); ys.push(lo, hi); }
  }
  if (!xs.length) {
    svg.appendChild(svgEl("text", {x: width / 2, y: height / 2, class: "chart-empty", "text-anchor": "middle"},
                          "no data yet"));
    container.replaceChildren(svg);
    return svg;
  }
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const px = x => left + (x - x0) / (x1 - x0) * (width - left - right);
  const py = y => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  const axes = svgEl("g", {class: "axes"});
  axes.appendChild(svgEl("line", {x1: left, y1: height - bottom, x2: width - right, y2: height - bottom}));
  axes.appendChild(svgEl("line", {x1: left, y1: top, x2: left, y2: height - bottom}));
  const yStep = niceStep(y1 - y0, 4);
  for (let y = Math.ceil(y0 / yStep - 1e-9) * yStep; y <= y1 + yStep * 1e-9; y += yStep) {
    axes.appendChild(svgEl("line", {x1: left, y1: py(y), x2: width - right, y2: py(y), class: "grid"}));
    axes.appendChild(svgEl("text", {x: left - 4, y: py(y) + 3, "text-anchor": "end", class: "tick-y"},
                           tickLabel(y, yStep)));
  }
  const xStep = Math.max(1, niceStep(x1 - x0, 5));  // steps are whole numbers
  for (let x = Math.ceil(x0 / xStep) * xStep; x <= x1; x += xStep) {
    axes.appendChild(svgEl("text", {x: px(x), y: height - bottom + 14, "text-anchor": "middle", class: "tick-x"},
                           String(Math.round(x))));
  }
  axes.appendChild(svgEl("text", {x: width - right, y: height - 4, "text-anchor": "end"}, "step"));
  svg.appendChild(axes);
  chart.series.forEach((s, index) => {
    const color = s.color || PALETTE[index % PALETTE.length];
    if (s.band && s.band.length) {
      const upper = s.band.map(([x, , hi]) => `${px(x)},${py(hi)}`);
      const lower = s.band.slice().reverse().map(([x, lo]) => `${px(x)},${py(lo)}`);
      svg.appendChild(svgEl("polygon", {points: upper.concat(lower).join(" "), fill: color, class: "band"}));
    }
    if (!s.points.length) return;
    svg.appendChild(svgEl("polyline", {points: s.points.map(([x, y]) => `${px(x)},${py(y)}`).join(" "),
                                       stroke: color, class: "line", "data-series": s.name}));
    if (s.points.length <= 60) {
      for (const [x, y] of s.points) {
        const dot = svgEl("circle", {cx: px(x), cy: py(y), r: 2.5, fill: color});
        dot.appendChild(svgEl("title", {}, `${s.name} at step ${x}: ${niceNumber(y)}`));
        svg.appendChild(dot);
      }
    }
  });
  const legend = svgEl("g", {class: "legend"});
  let lx = left + 8;
  chart.series.forEach((s, index) => {
    const color = s.color || PALETTE[index % PALETTE.length];
    legend.appendChild(svgEl("rect", {x: lx, y: 22, width: 8, height: 8, fill: color}));
    const label = svgEl("text", {x: lx + 11, y: 30}, s.name);
    legend.appendChild(label);
    lx += 16 + 6.2 * s.name.length;
  });
  svg.appendChild(legend);
  container.replaceChildren(svg);
  return svg;
}

window.drawChart = drawChart;

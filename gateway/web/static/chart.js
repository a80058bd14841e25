// A small time-series line chart in inline SVG: one path per series, gaps where a value is null,
// and a dashed threshold line (the SLO) that is always inside the drawn range.

const NS = "http://www.w3.org/2000/svg";
const W = 340, H = 150, LEFT = 52, RIGHT = 8, TOP = 12, BOTTOM = 20;

function node(tag, attrs, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// series: [{name, cls, points: [[t, value|null], ...]}]; now and span in seconds;
// threshold: {value, label} or null; format: value -> text; floor: the least top of the y axis.
export function lineChart(svg, { series, now, span, threshold, format, floor = 1e-9 }) {
  const x0 = now - span;
  const shown = series.map((s) => ({ ...s, points: s.points.filter(([t]) => t >= x0) }));
  const values = shown.flatMap((s) => s.points.map(([, v]) => v)).filter((v) => v !== null);
  const top = Math.max(...values, threshold ? threshold.value : 0, floor) * 1.12;
  const x = (t) => LEFT + ((t - x0) / span) * (W - LEFT - RIGHT);
  const y = (v) => TOP + (1 - v / top) * (H - TOP - BOTTOM);

  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.append(
    node("line", { class: "axis", x1: LEFT, x2: W - RIGHT, y1: y(0), y2: y(0) }),
    node("text", { class: "tick", x: LEFT - 4, y: y(0), "text-anchor": "end", "dominant-baseline": "middle" }, format(0)),
    node("text", { class: "tick", x: LEFT - 4, y: TOP, "text-anchor": "end", "dominant-baseline": "middle" }, format(top)),
    node("text", { class: "tick", x: LEFT, y: H - 4 }, `−${Math.round(span / 60)} min`),
    node("text", { class: "tick", x: W - RIGHT, y: H - 4, "text-anchor": "end" }, "now"),
  );
  if (threshold) {
    svg.append(
      node("line", { class: "slo", "data-value": threshold.value, x1: LEFT, x2: W - RIGHT,
                     y1: y(threshold.value), y2: y(threshold.value) }),
      node("text", { class: "slo-label", x: W - RIGHT - 2, y: y(threshold.value) - 3, "text-anchor": "end" },
           threshold.label),
    );
  }
  const summary = [];
  shown.forEach((s, i) => {
    let d = "";
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    }
    // A lone point between gaps draws nothing as a path: mark the points too.
    const path = node("path", { class: `line ${s.cls}`, d });
    svg.append(path);
    for (const [t, v] of s.points.slice(-1)) {
      if (v !== null) svg.append(node("circle", { class: `dot ${s.cls}`, cx: x(t), cy: y(v), r: 2.5 }));
    }
    svg.append(node("text", { class: `legend ${s.cls}`, x: LEFT + 4 + i * 90, y: TOP + 2 }, s.name));
    const last = s.points.filter(([, v]) => v !== null).at(-1);
    summary.push(`${s.name} ${last ? format(last[1]) : "no data"}`);
  });
  // For scripts and tests: how many values the first series draws, and how many of them are above 0.
  const drawn = shown[0].points.map(([, v]) => v).filter((v) => v !== null);
  svg.dataset.points = String(drawn.length);
  svg.dataset.nonzero = String(drawn.filter((v) => v > 0).length);
  svg.setAttribute("aria-label", summary.join(", ") + (threshold ? `; ${threshold.label}` : ""));
}

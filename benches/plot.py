"""Draws the figures of docs/benchmarks.md from target/bench-report.json.

Plain SVG, standard library only:

    python3 benches/plot.py [target/bench-report.json] [docs/img]
"""

import json
import math
import sys
from pathlib import Path

WIDTH = 720
BAR = 26
GAP = 10
LEFT = 250
RIGHT = 110
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
COLOURS = {
    "ours": "#2b6cb0",
    "floor": "#718096",
    "port": "#dd6b20",
    "python": "#c53030",
    "raw": "#2f855a",
    "plain": "#38a169",
}


def esc(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def bars(title, unit, rows, log=False, note=None):
    """Horizontal bars: rows are (label, value, colour key, annotation)."""
    top = 46
    height = top + len(rows) * (BAR + GAP) + (44 if note else 24)
    span = WIDTH - LEFT - RIGHT
    values = [v for _, v, _, _ in rows if v and v > 0]
    high = max(values)
    low = min(values)
    if log:
        floor = 10 ** math.floor(math.log10(low))
        ceil = 10 ** math.ceil(math.log10(high))

        def length(v):
            return span * (math.log10(v) - math.log10(floor)) / (
                math.log10(ceil) - math.log10(floor)
            )

    else:

        def length(v):
            return span * v / high

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}'>",
        f"<rect width='100%' height='100%' fill='white'/>",
        f"<text x='12' y='24' {FONT} font-size='16' font-weight='bold'>{esc(title)}</text>",
    ]
    for index, (label, value, colour, annotation) in enumerate(rows):
        y = top + index * (BAR + GAP)
        out.append(
            f"<text x='{LEFT - 8}' y='{y + BAR * 0.68}' {FONT} font-size='13' "
            f"text-anchor='end'>{esc(label)}</text>"
        )
        if value and value > 0:
            w = max(2.0, length(value))
            out.append(
                f"<rect x='{LEFT}' y='{y}' width='{w:.1f}' height='{BAR}' "
                f"fill='{COLOURS[colour]}'/>"
            )
            text = f"{value:,.0f} {unit}" if value >= 100 else f"{value:.2f} {unit}"
            if annotation:
                text += f"  {annotation}"
            out.append(
                f"<text x='{LEFT + w + 6}' y='{y + BAR * 0.68}' {FONT} "
                f"font-size='12'>{esc(text)}</text>"
            )
        else:
            out.append(
                f"<text x='{LEFT + 6}' y='{y + BAR * 0.68}' {FONT} font-size='12'>n/a</text>"
            )
    if note:
        out.append(
            f"<text x='12' y='{height - 14}' {FONT} font-size='11' fill='#4a5568'>"
            f"{esc(note)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def nice(value):
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= value."""
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def lines(title, unit, xs, series, note=None):
    """A line chart over categorical x values: series are (label, colour, ys)."""
    width, height = WIDTH, 340
    left, right, top, bottom = 70, 170, 46, 60
    plot_w = width - left - right
    plot_h = height - top - bottom
    every = [y for _, _, ys in series for y in ys if y is not None]
    high = nice(max(every) * 1.1)
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}'>",
        "<rect width='100%' height='100%' fill='white'/>",
        f"<text x='12' y='24' {FONT} font-size='16' font-weight='bold'>{esc(title)}</text>",
        f"<line x1='{left}' y1='{top + plot_h}' x2='{left + plot_w}' y2='{top + plot_h}' "
        "stroke='#2d3748'/>",
        f"<line x1='{left}' y1='{top}' x2='{left}' y2='{top + plot_h}' stroke='#2d3748'/>",
    ]
    for tick in range(5):
        value = high * tick / 4
        y = top + plot_h - plot_h * tick / 4
        out.append(
            f"<line x1='{left}' y1='{y:.1f}' x2='{left + plot_w}' y2='{y:.1f}' "
            "stroke='#e2e8f0'/>"
        )
        out.append(
            f"<text x='{left - 6}' y='{y + 4:.1f}' {FONT} font-size='11' "
            f"text-anchor='end'>{value:,.0f}</text>"
        )
    out.append(
        f"<text x='14' y='{top + plot_h / 2}' {FONT} font-size='12' "
        f"transform='rotate(-90 14 {top + plot_h / 2})' text-anchor='middle'>{esc(unit)}</text>"
    )
    step = plot_w / (len(xs) - 1)
    for index, x in enumerate(xs):
        out.append(
            f"<text x='{left + index * step:.1f}' y='{top + plot_h + 18}' {FONT} "
            f"font-size='12' text-anchor='middle'>{esc(str(x))}</text>"
        )
    out.append(
        f"<text x='{left + plot_w / 2}' y='{top + plot_h + 40}' {FONT} font-size='12' "
        "text-anchor='middle'>subscriptions</text>"
    )
    for rank, (label, colour, ys) in enumerate(series):
        dash = " stroke-dasharray='6 4'" if rank else ""
        points = [
            (left + i * step, top + plot_h - plot_h * y / high)
            for i, y in enumerate(ys)
            if y is not None
        ]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        out.append(
            f"<polyline points='{path}' fill='none' stroke='{COLOURS[colour]}' "
            f"stroke-width='2.5'{dash}/>"
        )
        for x, y in points:
            out.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3.5' fill='{COLOURS[colour]}'/>")
        ly = top + 14 + rank * 20
        out.append(
            f"<line x1='{left + plot_w + 14}' y1='{ly}' x2='{left + plot_w + 38}' y2='{ly}' "
            f"stroke='{COLOURS[colour]}' stroke-width='2.5'{dash}/>"
        )
        out.append(
            f"<text x='{left + plot_w + 44}' y='{ly + 4}' {FONT} font-size='12'>{esc(label)}</text>"
        )
    if note:
        out.append(
            f"<text x='12' y='{height - 8}' {FONT} font-size='11' fill='#4a5568'>{esc(note)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    report_path = Path(sys.argv[1] if len(sys.argv) > 1 else "target/bench-report.json")
    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img")
    out_dir.mkdir(parents=True, exist_ok=True)
    r = json.loads(report_path.read_text())
    ours = r["dispatch_ns_per_msg"]

    def times(key):
        value = r.get(key)
        return f"({value / ours:.1f}x ours)" if value else ""

    ours_cpu = r.get("dispatch_cpu_ns_per_msg") or ours

    def cpu_times(key):
        value = r.get(key)
        return f"({value / ours_cpu:.1f}x ours)" if value else ""

    (out_dir / "in-memory.svg").write_text(
        bars(
            "In memory: CPU time per message (K=1, C=20, no-op handler)",
            "ns",
            [
                ("spawn_local floor", r.get("spawn_floor_cpu_ns_per_msg"), "floor", ""),
                ("plain loop (receive, handle, ack)", r.get("plain_loop_cpu_ns_per_msg"), "plain", ""),
                ("ours (current_thread)", ours_cpu, "ours", ""),
                ("multi-threaded port (2 cores)", r.get("mt_port_cpu_ns_per_msg"), "port",
                 cpu_times("mt_port_cpu_ns_per_msg")),
                ("Python original, fake client", r.get("python_ref_cpu_ns_per_msg"), "python",
                 cpu_times("python_ref_cpu_ns_per_msg")),
            ],
            log=True,
            note="log scale; shorter is better; the port's is every thread's CPU time",
        )
    )
    latency = r.get("latency_ns", {})
    if latency:
        rows = []
        for load in (10, 50, 80, 95):
            for name, key, colour in (
                ("ours", "ours", "ours"),
                ("plain loop", "plain_loop", "plain"),
                ("port", "mt_port", "port"),
            ):
                p = latency.get(f"{key}_{load}pct")
                if p:
                    rows.append(
                        (f"{load}% load, {name}", p["p99_ns"], colour, f"p50 {p['p50_ns']:,} ns")
                    )
        (out_dir / "latency.svg").write_text(
            bars(
                "In memory: arrival to handler start, p99, open-loop load",
                "ns",
                rows,
                log=True,
                note="log scale; load in % of ours' saturation rate; measured from each "
                "message's due time",
            )
        )
    scaling = r["scaling_ns_per_msg"]
    subs = [1, 10, 100, 1000]
    (out_dir / "scaling.svg").write_text(
        lines(
            "Cost per message as subscriptions grow (C=20)",
            "ns per message",
            subs,
            [
                ("1 priority level", "ours", [scaling.get(f"levels1_subs{k}") for k in subs]),
                ("16 priority levels", "port", [scaling.get(f"levels16_subs{k}") for k in subs]),
                (
                    "plain loop",
                    "plain",
                    [scaling.get(f"plain_loop_subs{k}") for k in subs],
                ),
            ],
        )
    )
    e2e = r.get("e2e_msgs_per_s_detail", {})
    if e2e:
        (out_dir / "e2e.svg").write_text(
            bars(
                "On the broker: messages per second (receiver queue 1000)",
                "msg/s",
                [
                    ("plain pulsar consumer loop", e2e.get("raw_q1000"), "raw", ""),
                    ("ours", e2e.get("ours_q1000"), "ours", ""),
                    ("ours, 1 dispatcher (per_core)", e2e.get("per_core_1"), "ours", ""),
                    ("ours, 2 dispatchers (per_core)", e2e.get("per_core_2"), "ours", ""),
                    ("Python original", e2e.get("python_q1000"), "python", ""),
                ],
                note="longer is better; broker, clients and benchmark share the same 2 cores",
            )
        )
    if e2e.get("ours_cpu_us_q1000"):
        (out_dir / "e2e-cpu.svg").write_text(
            bars(
                "On the broker: client CPU time per message (receiver queue 1000)",
                "us",
                [
                    ("plain pulsar consumer loop", e2e.get("raw_cpu_us_q1000"), "raw", ""),
                    ("library transport, plain loop", e2e.get("transport_cpu_us_q1000"), "plain", ""),
                    ("ours", e2e.get("ours_cpu_us_q1000"), "ours", ""),
                    ("Python original", e2e.get("python_cpu_us_q1000"), "python", ""),
                ],
                note="shorter is better; every thread of the consuming process, broker excluded",
            )
        )
    print(f"figures written to {out_dir}")


if __name__ == "__main__":
    main()

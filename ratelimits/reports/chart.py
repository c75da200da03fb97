"""The usage report's chart: requests per period by outcome, as SVG drawn on the server.

No JavaScript and nothing loaded from elsewhere: stacked bars (lines beyond :data:`MAX_BARS`
periods), axes with round labels, a legend with each outcome's total, and a description for
screen readers. Periods counting minutes not drained yet are shaded and marked "live". When the
first periods of the range recorded nothing, the chart starts later (:func:`chart_periods`), so
that the traffic of a young install is not a sliver at the right edge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from ..usage.readers import OUTCOMES, STEPS, Period

__all__ = ["MAX_BARS", "MIN_PERIODS", "chart_periods", "render_chart"]

#: Okabe-Ito colours: told apart with every common colour vision deficiency.
COLORS = {"allowed": "#0072B2", "throttled": "#E69F00", "shed": "#D55E00", "degraded": "#CC79A7"}
LABELS = {"allowed": "allowed", "throttled": "throttled (429)", "shed": "shed (503)", "degraded": "degraded"}
#: The live periods' shade: Okabe-Ito's sky blue, light behind the bars.
LIVE_COLOR = "#56B4E9"
WIDTH, HEIGHT = 960, 340
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 44, 64
#: More periods than this are drawn as lines, not stacked bars (bars would be thinner than a pixel or two).
MAX_BARS = 180
#: Steps between the labelled periods, in periods.
LABEL_STEPS = {
    "minute": (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440),
    "hour": (1, 2, 3, 6, 12, 24, 48, 72, 168, 336, 720),
    "day": (1, 2, 7, 14, 28, 56, 91, 182, 364),
}
MAX_LABELS = 8
#: The fewest periods the chart draws when it leaves out the empty start of the range.
MIN_PERIODS = 60
LIVE_TITLE = "live: counted in the store, not drained yet; may still grow"


def chart_periods(series: Sequence[Period]) -> Sequence[Period]:
    """The periods the chart draws: the range's, less those before the first with requests.

    At least the last :data:`MIN_PERIODS` are kept, so a burst has some quiet before it to be read
    against. Only the chart starts later: the table and its CSV have every period.
    """
    first = next((index for index, period in enumerate(series) if period.requests), None)
    if first is None:
        return series
    return series[min(first, max(len(series) - MIN_PERIODS, 0)) :]


def _compact(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:g}"


def _scale(peak: int, ticks: int = 5) -> tuple[int, int]:
    """A round top for the y axis above ``peak`` and the step between its gridlines."""
    if peak <= 0:
        return 1, 1
    raw = peak / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if raw <= m * magnitude)
    whole = max(round(step), 1)
    return whole * math.ceil(peak / whole), whole


def _label_step(count: int, granularity: str) -> int:
    for step in LABEL_STEPS[granularity]:
        if math.ceil(count / step) <= MAX_LABELS:
            return step
    return max(1, math.ceil(count / MAX_LABELS))


def _period_label(start: datetime, granularity: str) -> str:
    return f"{start:%Y-%m-%d}" if granularity == "day" else f"{start:%Y-%m-%d %H:%M}"


def render_chart(series: Sequence[Period], granularity: str, *, left_out: int = 0) -> SafeString:
    """Requests per period as an SVG: stacked bars by outcome (lines beyond :data:`MAX_BARS` periods).

    ``left_out``: how many empty periods of the range before ``series`` are not drawn (said in the description).
    """
    count = len(series)
    bars = count <= MAX_BARS
    if bars:
        peak = max((p.requests for p in series), default=0)
    else:
        peak = max((getattr(p, m) for p in series for m in OUTCOMES), default=0)
    top, step = _scale(peak)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(count, 1)
    bottom = TOP + plot_h

    def y(value: float) -> float:
        return bottom - value / top * plot_h

    totals = {m: sum(getattr(p, m) for p in series) for m in OUTCOMES}
    kind = "stacked bars" if bars else "lines"
    title = f"Requests per {granularity} by outcome"
    if series:
        span = (
            f"from {_period_label(series[0].start, granularity)} to {_period_label(series[-1].start, granularity)} UTC"
        )
    else:
        span = "(no periods in the range)"
    desc = (
        f"{kind.capitalize()}, {count} periods {span}: "
        + ", ".join(f"{totals[m]:,} {LABELS[m]}" for m in OUTCOMES)
        + "."
    )
    busiest = max(series, key=lambda p: p.requests, default=None)
    if busiest is not None and busiest.requests:
        desc += f" Busiest period: {_period_label(busiest.start, granularity)} with {busiest.requests:,} requests."
    if left_out:
        desc += f" The {left_out:,} periods before the first, in which nothing was recorded, are not drawn."
    live = [index for index, period in enumerate(series) if period.live]
    if live:
        desc += f" Live (counted in the store, not drained yet): {_period_label(series[live[0]].start, granularity)}"
        if len(live) > 1:
            desc += f" to {_period_label(series[live[-1]].start, granularity)}"
        desc += "."
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="usage-chart" id="usage-chart" viewBox="0 0 {WIDTH} {HEIGHT}"'
        f' role="img" aria-label="{escape(title)}" aria-describedby="usage-chart-desc" data-kind="{kind}"'
        ' font-family="inherit" font-size="12" fill="currentColor">',
        f'<title id="usage-chart-title">{escape(title)}</title>',
        f'<desc id="usage-chart-desc">{escape(desc)}</desc>',
    ]
    # Live periods: shaded behind their data, labelled above it.
    if live:
        out.append('<g class="live" aria-hidden="true">')
        for index in live:
            out.append(
                f'<rect class="live-band" x="{LEFT + index * slot:.1f}" y="{TOP}" width="{slot:.1f}" height="{plot_h}"'
                f' fill="{LIVE_COLOR}" fill-opacity="0.18"><title>{escape(LIVE_TITLE)}</title></rect>'
            )
        at = LEFT + (live[-1] + 0.5) * slot
        out.append(f'<text class="live-label" x="{at:.1f}" y="{TOP - 4}" text-anchor="middle">live</text></g>')
    # Gridlines and the y axis.
    out.append('<g class="y-axis" aria-hidden="true">')
    for value in range(0, top + 1, step):
        at = y(value)
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{at:.1f}" y2="{at:.1f}" stroke="currentColor"'
            f' stroke-opacity="{0.6 if value == 0 else 0.15}"/>'
            f'<text x="{LEFT - 8}" y="{at + 4:.1f}" text-anchor="end">{_compact(value)}</text>'
        )
    out.append(
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{bottom}" stroke="currentColor" stroke-opacity="0.6"/>'
        f'<text transform="translate(16 {TOP + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
        f"requests per {escape(granularity)}</text></g>"
    )
    # The x axis: labels on round periods, the date under the first label of each day.
    out.append('<g class="x-axis" aria-hidden="true">')
    label_every = _label_step(count, granularity)
    unit = STEPS[granularity].total_seconds()
    last_day = ""
    for index, period in enumerate(series):
        if int(period.start.timestamp() // unit) % label_every:
            continue
        x = LEFT + (index + 0.5) * slot
        day = f"{period.start:%Y-%m-%d}"
        first, second = (day, "") if granularity == "day" else (f"{period.start:%H:%M}", day if day != last_day else "")
        last_day = day
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 5}" stroke="currentColor"'
            f' stroke-opacity="0.6"/><text x="{x:.1f}" y="{bottom + 18}" text-anchor="middle">{first}'
            + (f'<tspan x="{x:.1f}" dy="14">{second}</tspan>' if second else "")
            + "</text>"
        )
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">period start (UTC)</text></g>')
    # The data.
    if bars:
        width = max(slot * 0.8, 1.0)
        stacked = [0] * count
        for metric in OUTCOMES:
            out.append(f'<g class="series" data-outcome="{metric}" fill="{COLORS[metric]}">')
            for index, period in enumerate(series):
                value = getattr(period, metric)
                if not value:
                    continue
                low, high = y(stacked[index]), y(stacked[index] + value)
                stacked[index] += value
                x = LEFT + index * slot + (slot - width) / 2
                marked = (' data-live="1"', f" ({LIVE_TITLE})") if period.live else ("", "")
                out.append(
                    f'<rect x="{x:.1f}" y="{high:.1f}" width="{width:.1f}" height="{max(low - high, 0.5):.1f}"'
                    f"{marked[0]}><title>{_period_label(period.start, granularity)} UTC: {value:,} {LABELS[metric]}"
                    f"{escape(marked[1])}</title></rect>"
                )
            out.append("</g>")
    else:
        for metric in OUTCOMES:
            points = " ".join(
                f"{'M' if i == 0 else 'L'}{LEFT + (i + 0.5) * slot:.1f} {y(getattr(p, metric)):.1f}"
                for i, p in enumerate(series)
            )
            out.append(
                f'<path class="series" data-outcome="{metric}" d="{points}" fill="none" stroke="{COLORS[metric]}"'
                f' stroke-width="1.5" stroke-linejoin="round"><title>{LABELS[metric]}</title></path>'
            )
    if peak == 0:
        out.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" class="empty">'
            "No usage recorded in this range</text>"
        )
    # The legend, with each outcome's total.
    out.append('<g class="legend">')
    x = float(LEFT)
    for metric in OUTCOMES:
        text = f"{LABELS[metric]}: {totals[metric]:,}"
        out.append(
            f'<rect x="{x:.1f}" y="14" width="12" height="12" fill="{COLORS[metric]}"/>'
            f'<text x="{x + 17:.1f}" y="24">{escape(text)}</text>'
        )
        x += 40 + 7.2 * len(text)
    if live:
        out.append(
            f'<rect x="{x:.1f}" y="14" width="12" height="12" fill="{LIVE_COLOR}" fill-opacity="0.18"'
            ' stroke="currentColor" stroke-opacity="0.4"/>'
            f'<text x="{x + 17:.1f}" y="24">live (not drained yet)</text>'
        )
    out.append("</g></svg>")
    return mark_safe("".join(out))  # every interpolated string is escaped, or a number

//! The report's plots as inline SVG, written as text so the page needs no script library, no
//! network and no font: CDFs, a histogram, stacked stage bars and a waterfall of request
//! timelines. Each plot is a `<figure class="plot">` with a stable `id`, and every drawn element
//! carries `data-series` (the run's label) plus what it shows (`data-points`, `data-count`,
//! `data-stage`, `data-value`), so a test can check in a real browser that something was drawn.
//! Values arrive already computed (by the `timeline` definitions, via `report::Metric`); this
//! module only maps them to pixels.

use super::esc;
use std::fmt::Write as _;

const W: f64 = 620.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 40.0;
/// Points kept per CDF curve; larger runs are sampled at evenly spaced ranks.
const CDF_POINTS: usize = 400;
/// Bins of the chunk-gap histogram (the last one also holds everything above the range).
pub(super) const HIST_BINS: usize = 30;

/// One run's samples in a plot.
#[derive(Debug)]
pub(super) struct Series<'a> {
    pub label: &'a str,
    pub color: &'a str,
    pub values: Vec<f64>,
}

/// One stacked segment (a stage, or a client-side phase) of a bar.
#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub name: String,
    pub color: &'static str,
    pub ms: f64,
}

/// One horizontal stacked bar.
#[derive(Debug)]
pub(super) struct Bar<'a> {
    /// Row label shown on the left.
    pub row: String,
    pub series: &'a str,
    /// `p50`/`p99` for stage bars, the request id for the waterfall.
    pub key: String,
    pub segments: Vec<Segment>,
    /// A tick drawn across the bar (the client TTFT in the waterfall), ms.
    pub mark_ms: Option<f64>,
    /// Hover text.
    pub title: String,
}

struct Axis {
    lo: f64,
    hi: f64,
    px_lo: f64,
    px_hi: f64,
}

impl Axis {
    fn at(&self, v: f64) -> f64 {
        let span = if self.hi > self.lo { self.hi - self.lo } else { 1.0 };
        self.px_lo + (v - self.lo) / span * (self.px_hi - self.px_lo)
    }
}

/// Up to about `n` round tick values covering `[0, hi]`, and the rounded-up end of the axis.
fn ticks(hi: f64, n: usize) -> (Vec<f64>, f64) {
    let hi = if hi.is_finite() && hi > 0.0 { hi } else { 1.0 };
    let raw = hi / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let end = (hi / step).ceil() * step;
    let count = (end / step).round() as usize;
    ((0..=count).map(|i| i as f64 * step).collect(), end)
}

fn num(v: f64) -> String {
    if v == 0.0 || v.abs() >= 10.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn open_figure(out: &mut String, id: &str, kind: &str, title: &str) {
    let _ = write!(
        out,
        r#"<figure class="plot" id="{}" data-plot="{}"><figcaption>{}</figcaption>"#,
        esc(id),
        esc(kind),
        esc(title)
    );
}

fn note(out: &mut String, text: &str) {
    let _ = write!(out, r#"<p class="note">{}</p>"#, esc(text));
}

fn legend(out: &mut String, items: &[(&str, &str)]) {
    out.push_str(r#"<div class="legend">"#);
    for (name, color) in items {
        let _ = write!(out, r#"<span><i style="background:{}"></i>{}</span>"#, esc(color), esc(name));
    }
    out.push_str("</div>");
}

/// Axes, grid and labels of an x–y frame.
fn frame(out: &mut String, x: &Axis, y: &Axis, xt: &[f64], yt: &[f64], x_label: &str, y_label: &str) {
    frame_with(out, (x, y), (xt, yt), (x_label, y_label), num);
}

/// [`frame`], each tick labelled `label(value)`.
fn frame_with(
    out: &mut String,
    (x, y): (&Axis, &Axis),
    (xt, yt): (&[f64], &[f64]),
    (x_label, y_label): (&str, &str),
    label: fn(f64) -> String,
) {
    out.push_str(r#"<g class="axes">"#);
    for v in yt {
        let py = y.at(*v);
        let _ = write!(
            out,
            r#"<line class="grid" x1="{:.1}" x2="{:.1}" y1="{py:.1}" y2="{py:.1}"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            x.px_lo,
            x.px_hi,
            x.px_lo - 6.0,
            py + 4.0,
            label(*v)
        );
    }
    for v in xt {
        let px = x.at(*v);
        let _ = write!(
            out,
            r#"<line class="tick" x1="{px:.1}" x2="{px:.1}" y1="{:.1}" y2="{:.1}"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            y.px_lo,
            y.px_lo + 4.0,
            y.px_lo + 16.0,
            label(*v)
        );
    }
    let _ = write!(
        out,
        r#"<line class="axis" x1="{:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text transform="translate(14,{:.1}) rotate(-90)" text-anchor="middle">{}</text></g>"#,
        x.px_lo,
        x.px_hi,
        y.px_lo,
        y.px_lo,
        (x.px_lo + x.px_hi) / 2.0,
        y.px_lo + 34.0,
        esc(x_label),
        (y.px_lo + y.px_hi) / 2.0,
        esc(y_label)
    );
}

fn svg_open(out: &mut String, h: f64, label: &str) {
    let _ = write!(
        out,
        r#"<svg viewBox="0 0 {W:.0} {h:.0}" width="{W:.0}" height="{h:.0}" role="img" aria-label="{}">"#,
        esc(label)
    );
}

/// Empirical CDFs of one metric, every run overlaid.
pub(super) fn cdf(id: &str, title: &str, unit: &str, series: &[Series<'_>]) -> String {
    let mut out = String::new();
    open_figure(&mut out, id, "cdf", title);
    let max =
        series.iter().flat_map(|s| s.values.iter().copied()).filter(|v| v.is_finite()).fold(0.0, f64::max);
    if series.iter().all(|s| s.values.is_empty()) {
        note(&mut out, "no samples: no completed request has this metric");
        out.push_str("</figure>");
        return out;
    }
    let h = 300.0;
    let (xt, x_end) = ticks(max, 8);
    let x = Axis { lo: 0.0, hi: x_end, px_lo: LEFT, px_hi: W - RIGHT };
    let y = Axis { lo: 0.0, hi: 1.0, px_lo: h - BOTTOM, px_hi: TOP };
    svg_open(&mut out, h, title);
    frame(&mut out, &x, &y, &xt, &[0.0, 0.25, 0.5, 0.75, 0.9, 1.0], unit, "fraction ≤ x");
    for s in series {
        let mut v: Vec<f64> = s.values.iter().copied().filter(|v| v.is_finite()).collect();
        if v.is_empty() {
            continue;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let keep = n.min(CDF_POINTS);
        let mut d = format!("M{:.1},{:.1}", x.at(v[0]), y.at(0.0));
        for k in 0..keep {
            // Evenly spaced ranks, always ending at the largest sample.
            let i = if keep == 1 { 0 } else { k * (n - 1) / (keep - 1) };
            let _ = write!(d, " L{:.1},{:.2}", x.at(v[i]), y.at((i + 1) as f64 / n as f64));
        }
        let _ = write!(
            out,
            r#"<path class="series" fill="none" stroke="{}" stroke-width="2" data-series="{}" data-points="{n}" d="{d}"><title>{}: {n} samples, median {} {}, max {} {}</title></path>"#,
            esc(s.color),
            esc(s.label),
            esc(s.label),
            num(v[(n - 1) / 2]),
            esc(unit),
            num(v[n - 1]),
            esc(unit)
        );
    }
    out.push_str("</svg>");
    let items: Vec<(&str, &str)> = series.iter().map(|s| (s.label, s.color)).collect();
    legend(&mut out, &items);
    for s in series.iter().filter(|s| s.values.is_empty()) {
        note(&mut out, &format!("{}: no samples", s.label));
    }
    out.push_str("</figure>");
    out
}

/// Decades `10^k` covering `[lo, hi]` (both > 0), as tick values.
fn decades(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a..=b.max(a + 1)).map(|k| 10f64.powi(k)).collect()
}

/// The tail of one metric, every run overlaid: the share of requests slower than x (a CCDF) on
/// log–log axes, so the p99 and p99.9 — a few pixels at the right edge of a linear plot — get
/// as much room as the median. Each run's p50, p99 and p99.9 are marked (`data-mark`).
pub(super) fn ccdf(id: &str, title: &str, unit: &str, series: &[Series<'_>]) -> String {
    let mut out = String::new();
    open_figure(&mut out, id, "ccdf", title);
    let positive = |s: &Series<'_>| -> Vec<f64> {
        let mut v: Vec<f64> = s.values.iter().copied().filter(|v| v.is_finite() && *v > 0.0).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let sorted: Vec<Vec<f64>> = series.iter().map(positive).collect();
    if sorted.iter().all(Vec::is_empty) {
        note(&mut out, "no samples above zero: nothing to draw on a log axis");
        out.push_str("</figure>");
        return out;
    }
    let lo = sorted.iter().filter_map(|v| v.first().copied()).fold(f64::INFINITY, f64::min);
    let hi = sorted.iter().filter_map(|v| v.last().copied()).fold(0.0, f64::max);
    let n_max = sorted.iter().map(Vec::len).max().unwrap_or(1).max(2) as f64;
    let xt = decades(lo, hi);
    let yt = decades(1.0 / n_max, 1.0);
    let (x_lo, x_hi) = (xt[0].log10(), xt[xt.len() - 1].log10());
    let h = 300.0;
    let x = Axis { lo: x_lo, hi: x_hi, px_lo: LEFT, px_hi: W - RIGHT };
    let y = Axis { lo: yt[0].log10(), hi: 0.0, px_lo: h - BOTTOM, px_hi: TOP };
    svg_open(&mut out, h, title);
    let xl: Vec<f64> = xt.iter().map(|v| v.log10()).collect();
    let yl: Vec<f64> = yt.iter().map(|v| v.log10()).collect();
    frame_log(&mut out, &x, &y, &xl, &yl, &format!("{unit} (log)"), "share slower than x (log)");
    for (s, v) in series.iter().zip(&sorted) {
        if v.is_empty() {
            continue;
        }
        let n = v.len();
        let keep = n.min(CDF_POINTS);
        let mut d = String::new();
        for k in 0..keep {
            let i = if keep == 1 { 0 } else { k * (n - 1) / (keep - 1) };
            // Share strictly slower than v[i]; the slowest sample is drawn at 1/n.
            let share = ((n - 1 - i) as f64 / n as f64).max(1.0 / n as f64);
            let cmd = if d.is_empty() { 'M' } else { 'L' };
            let _ = write!(d, "{cmd}{:.1},{:.1} ", x.at(v[i].log10()), y.at(share.log10()));
        }
        let _ = write!(
            out,
            r#"<path class="series" fill="none" stroke="{}" stroke-width="2" data-series="{}" data-points="{n}" d="{}"><title>{}: {n} samples</title></path>"#,
            esc(s.color),
            esc(s.label),
            d.trim_end(),
            esc(s.label)
        );
        // The run's own percentiles, as the summary table defines them (`tokenpath_timeline`).
        let Some(stats) = tokenpath_timeline::Summary::from_samples(&s.values) else { continue };
        for (name, q, value) in
            [("p50", 0.50, stats.p50), ("p99", 0.99, stats.p99), ("p99.9", 0.999, stats.p999)]
        {
            if value <= 0.0 {
                continue; // not on a log axis
            }
            let share = (1.0_f64 - q).max(1.0 / n as f64);
            let _ = write!(
                out,
                r#"<circle class="mark" r="4" fill="{}" cx="{:.1}" cy="{:.1}" data-series="{}" data-mark="{name}" data-value="{:.3}"><title>{}: {name} {} {}</title></circle>"#,
                esc(s.color),
                x.at(value.log10()),
                y.at(share.log10()),
                esc(s.label),
                value,
                esc(s.label),
                num(value),
                esc(unit)
            );
        }
    }
    out.push_str("</svg>");
    let items: Vec<(&str, &str)> = series.iter().map(|s| (s.label, s.color)).collect();
    legend(&mut out, &items);
    note(&mut out, "dots: each run's p50, p99 and p99.9");
    out.push_str("</figure>");
    out
}

/// [`frame`] with its tick values given as log10s, labelled with the values themselves.
fn frame_log(out: &mut String, x: &Axis, y: &Axis, xl: &[f64], yl: &[f64], x_label: &str, y_label: &str) {
    frame_with(out, (x, y), (xl, yl), (x_label, y_label), |v| {
        // A decade: 0.001, 0.01, 0.1, 1, 10, 100, ...
        let k = v.round() as i32;
        if k < 0 {
            format!("{:.*}", k.unsigned_abs() as usize, 10f64.powi(k))
        } else {
            format!("{:.0}", 10f64.powi(k))
        }
    });
}

/// A histogram of one metric per run, bars side by side within each bin, heights as the share of
/// that run's samples (so runs of different sizes compare). `upper` is the range's end; the last
/// bin also holds every sample above it.
pub(super) fn histogram(id: &str, title: &str, unit: &str, upper: f64, series: &[Series<'_>]) -> String {
    let mut out = String::new();
    open_figure(&mut out, id, "histogram", title);
    if series.iter().all(|s| s.values.is_empty()) {
        note(&mut out, "no samples: no completed request had two token-bearing events");
        out.push_str("</figure>");
        return out;
    }
    let upper = if upper.is_finite() && upper > 0.0 { upper } else { 1.0 };
    let (xt, x_end) = ticks(upper, 8);
    let bin_w = x_end / HIST_BINS as f64;
    let shares: Vec<Vec<(u64, f64)>> = series
        .iter()
        .map(|s| {
            let mut counts = [0u64; HIST_BINS];
            for v in s.values.iter().filter(|v| v.is_finite() && **v >= 0.0) {
                counts[((v / bin_w) as usize).min(HIST_BINS - 1)] += 1;
            }
            let n = s.values.len().max(1) as f64;
            counts.iter().map(|c| (*c, *c as f64 / n)).collect()
        })
        .collect();
    let top = shares.iter().flatten().map(|(_, f)| *f).fold(0.0, f64::max);
    let (yt, y_end) = ticks(top, 5);
    let h = 300.0;
    let x = Axis { lo: 0.0, hi: x_end, px_lo: LEFT, px_hi: W - RIGHT };
    let y = Axis { lo: 0.0, hi: y_end, px_lo: h - BOTTOM, px_hi: TOP };
    svg_open(&mut out, h, title);
    frame(&mut out, &x, &y, &xt, &yt, unit, "share of gaps");
    let per = (x.at(bin_w) - x.at(0.0)) / series.len() as f64;
    for (si, (s, bins)) in series.iter().zip(&shares).enumerate() {
        for (b, (count, share)) in bins.iter().enumerate().filter(|(_, (c, _))| *c > 0) {
            let px = x.at(b as f64 * bin_w) + si as f64 * per;
            let py = y.at(*share);
            let _ = write!(
                out,
                r#"<rect class="series" x="{px:.1}" y="{py:.1}" width="{:.1}" height="{:.1}" fill="{}" data-series="{}" data-bin="{b}" data-count="{count}"><title>{}: {count} gaps in [{}, {}) {}</title></rect>"#,
                (per - 0.5).max(0.5),
                (y.at(0.0) - py).max(0.5),
                esc(s.color),
                esc(s.label),
                esc(s.label),
                num(b as f64 * bin_w),
                num((b + 1) as f64 * bin_w),
                esc(unit)
            );
        }
    }
    out.push_str("</svg>");
    let items: Vec<(&str, &str)> = series.iter().map(|s| (s.label, s.color)).collect();
    legend(&mut out, &items);
    note(&mut out, &format!("last bin includes every gap above {} {unit}", num(x_end - bin_w)));
    out.push_str("</figure>");
    out
}

/// Horizontal stacked bars, one row each, on a shared ms axis. `missing` lists rows drawn as a
/// note instead of a bar (a run whose server sent no timing).
pub(super) fn stacked_bars(
    id: &str,
    kind: &str,
    title: &str,
    bars: &[Bar<'_>],
    missing: &[String],
    legend_items: &[(&str, &str)],
) -> String {
    let mut out = String::new();
    open_figure(&mut out, id, kind, title);
    if !bars.is_empty() {
        let max = bars
            .iter()
            .map(|b| b.segments.iter().map(|s| s.ms).sum::<f64>().max(b.mark_ms.unwrap_or(0.0)))
            .fold(0.0, f64::max);
        let row_h = 22.0;
        let label_w = 170.0;
        let h = TOP + bars.len() as f64 * row_h + BOTTOM;
        let (xt, x_end) = ticks(max, 8);
        let x = Axis { lo: 0.0, hi: x_end, px_lo: label_w, px_hi: W - RIGHT };
        let y = Axis { lo: 0.0, hi: bars.len() as f64, px_lo: h - BOTTOM, px_hi: TOP };
        svg_open(&mut out, h, title);
        frame(&mut out, &x, &y, &xt, &[], "ms", "");
        for (i, bar) in bars.iter().enumerate() {
            let top = TOP + i as f64 * row_h + 3.0;
            let _ = write!(
                out,
                r#"<g class="bar" data-series="{}" data-key="{}"><title>{}</title><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                esc(bar.series),
                esc(&bar.key),
                esc(&bar.title),
                label_w - 6.0,
                top + 12.0,
                esc(&bar.row)
            );
            let mut at = 0.0;
            for seg in bar.segments.iter().filter(|s| s.ms.is_finite() && s.ms > 0.0) {
                let (x0, x1) = (x.at(at), x.at(at + seg.ms));
                let _ = write!(
                    out,
                    r#"<rect class="series" x="{x0:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}" data-series="{}" data-stage="{}" data-stat="{}" data-value="{:.3}"><title>{}: {} {} ms</title></rect>"#,
                    (x1 - x0).max(0.5),
                    row_h - 6.0,
                    seg.color,
                    esc(bar.series),
                    esc(&seg.name),
                    esc(&bar.key),
                    seg.ms,
                    esc(&bar.row),
                    esc(&seg.name),
                    num(seg.ms)
                );
                at += seg.ms;
            }
            if let Some(m) = bar.mark_ms.filter(|m| m.is_finite()) {
                let px = x.at(m);
                let _ = write!(
                    out,
                    r#"<line class="mark" x1="{px:.1}" x2="{px:.1}" y1="{:.1}" y2="{:.1}" data-mark="ttft" data-value="{m:.3}"/>"#,
                    top - 2.0,
                    top + row_h - 4.0
                );
            }
            out.push_str("</g>");
        }
        out.push_str("</svg>");
        legend(&mut out, legend_items);
    }
    for m in missing {
        note(&mut out, m);
    }
    out.push_str("</figure>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(97.0, 5), (vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0], 100.0));
        let (t, end) = ticks(0.0, 4);
        assert_eq!((t, end), (vec![0.0, 0.5, 1.0], 1.0));
        assert_eq!(num(0.25), "0.25");
        assert_eq!(num(1234.5), "1234");
    }

    #[test]
    fn histogram_overflow_goes_to_the_last_bin() {
        let s = [Series { label: "a", color: "#000", values: vec![1.0, 2.0, 1e9] }];
        let html = histogram("h", "gaps", "ms", 10.0, &s);
        assert_eq!(html.matches("data-count=").count(), 3);
        assert!(html.contains(&format!(r#"data-bin="{}" data-count="1""#, HIST_BINS - 1)), "{html}");
    }

    #[test]
    fn cdf_keeps_a_bounded_number_of_points() {
        let s = [Series { label: "big", color: "#000", values: (0..100_000).map(f64::from).collect() }];
        let html = cdf("c", "TTFT", "ms", &s);
        assert!(html.contains(r#"data-points="100000""#));
        assert!(html.matches(" L").count() <= CDF_POINTS);
    }
}

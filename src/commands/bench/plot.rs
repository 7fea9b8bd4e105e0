//! The benchmarks' plots, plain SVG written by hand: a few dozen elements
//! do not need a plotting library.
//!
//! - [`svg`], the ratio plot (`overhead`): one column per (workload, pair),
//!   a dot at the median ratio and a bar over its 95 % confidence interval,
//!   with the line of no overhead (1.0) and each pair's target;
//! - [`curve`], lines over a common x axis (`soak`: resident memory against
//!   requests served), the y axis from zero so that a flat line looks flat
//!   at its true scale.

use std::fmt::Write;

/// One column of the plot.
pub struct Column<'a> {
    /// Workload name (x label, first line).
    pub workload: &'a str,
    /// Pair name, e.g. `debug/off` (x label, second line).
    pub pair: &'a str,
    /// Low end of the median's 95 % interval.
    pub low: f64,
    /// Median ratio.
    pub median: f64,
    /// High end of the median's 95 % interval.
    pub high: f64,
    /// The pair's target ratio, if it has one.
    pub target: Option<f64>,
}

const WIDTH_PER_COLUMN: f64 = 110.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 60.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 70.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The opening of a `width` × [`HEIGHT`] document: white ground, `title`
/// centred on top.
fn header(width: f64, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{HEIGHT:.0}" viewBox="0 0 {width:.0} {HEIGHT:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="20" text-anchor="middle" font-size="13">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    s
}

/// The SVG document for `columns` under `title`.
pub fn svg(title: &str, columns: &[Column<'_>]) -> String {
    let width = LEFT + 20.0 + WIDTH_PER_COLUMN * columns.len().max(1) as f64;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let (mut lo, mut hi) = (1.0f64, 1.0f64);
    for c in columns {
        lo = lo.min(c.low);
        hi = hi.max(c.high).max(c.target.unwrap_or(1.0));
    }
    let pad = ((hi - lo) * 0.1).max(0.01);
    let (lo, hi) = (lo - pad, hi + pad);
    let y = |v: f64| TOP + (hi - v) / (hi - lo) * plot_h;
    let mut s = header(width, title);
    // Axis with five ticks.
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/>"#,
        TOP + plot_h
    );
    for i in 0..=4 {
        let v = lo + (hi - lo) * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{LEFT}" y2="{y:.1}" stroke="black"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.3}</text>"#,
            LEFT - 4.0,
            LEFT - 6.0,
            y(v) + 4.0,
            y = y(v)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">time ratio to off (off tokens/s ÷ variant tokens/s)</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{y1:.1}" x2="{:.1}" y2="{y1:.1}" stroke="#888" stroke-dasharray="4 3"/>"##,
        width - 10.0,
        y1 = y(1.0)
    );
    for (i, c) in columns.iter().enumerate() {
        let x = LEFT + WIDTH_PER_COLUMN * (i as f64 + 0.5);
        let color = if c.pair.starts_with("shim") {
            "#c0392b"
        } else {
            "#2a6fb0"
        };
        if let Some(t) = c.target {
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" y1="{yt:.1}" x2="{:.1}" y2="{yt:.1}" stroke="#2a2" stroke-width="2"><title>target {t:.2}</title></line>"##,
                x - 30.0,
                x + 30.0,
                yt = y(t)
            );
        }
        let _ = writeln!(
            s,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/><line x1="{:.1}" y1="{ymin:.1}" x2="{:.1}" y2="{ymin:.1}" stroke="{color}"/><line x1="{:.1}" y1="{ymax:.1}" x2="{:.1}" y2="{ymax:.1}" stroke="{color}"/>"#,
            y(c.low),
            y(c.high),
            x - 8.0,
            x + 8.0,
            x - 8.0,
            x + 8.0,
            ymin = y(c.low),
            ymax = y(c.high)
        );
        let _ = writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{:.1}" r="5" fill="{color}"><title>{} {}: 95 % interval {:.3} to {:.3}, median {:.3}</title></circle><text x="{:.1}" y="{:.1}">{:.3}</text>"#,
            y(c.median),
            escape(c.workload),
            escape(c.pair),
            c.low,
            c.high,
            c.median,
            x + 9.0,
            y(c.median) + 4.0,
            c.median
        );
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_h + 18.0,
            escape(c.workload),
            TOP + plot_h + 32.0,
            escape(c.pair)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{:.1}" fill="#555">dot: median over rounds; bar: its 95 % confidence interval; green: target; dashed: no overhead</text>"##,
        HEIGHT - 10.0
    );
    s.push_str("</svg>\n");
    s
}

/// One line of a [`curve`] plot: its name (legend) and its points (x, y).
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// Points in x order.
    pub points: &'a [(f64, f64)],
}

const CURVE_WIDTH: f64 = 720.0;
const CURVE_RIGHT: f64 = 150.0;
const COLORS: [&str; 4] = ["#2a6fb0", "#c0392b", "#27ae60", "#8e44ad"];

/// A round tick step for `span` split in about `parts`: 1, 2 or 5 × 10^k.
fn tick_step(span: f64, parts: f64) -> f64 {
    let raw = (span / parts).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    step.max(f64::MIN_POSITIVE)
}

/// `12345.0` as `12,345`.
pub fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if v < 0.0 { format!("-{out}") } else { out }
}

/// The SVG document of `series` under `title`: both axes from zero, ticks
/// at round values, a legend, and `note` under the plot.
pub fn curve(
    title: &str,
    x_label: &str,
    y_label: &str,
    note: &str,
    series: &[Series<'_>],
) -> String {
    let plot_w = CURVE_WIDTH - LEFT - CURVE_RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let points = || series.iter().flat_map(|s| s.points.iter());
    let x_max = points().map(|p| p.0).fold(0.0, f64::max).max(1.0);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max).max(1.0) * 1.15;
    let (x_step, y_step) = (tick_step(x_max, 5.0), tick_step(y_max, 5.0));
    let (x_max, y_max) = (
        (x_max / x_step).ceil() * x_step,
        (y_max / y_step).ceil() * y_step,
    );
    let x = |v: f64| LEFT + v / x_max * plot_w;
    let y = |v: f64| TOP + (1.0 - v / y_max) * plot_h;
    let mut s = header(CURVE_WIDTH, title);
    let _ = writeln!(
        s,
        r#"<path d="M{LEFT} {TOP} V{:.1} H{:.1}" fill="none" stroke="black"/>"#,
        TOP + plot_h,
        LEFT + plot_w
    );
    let mut v = 0.0;
    while v <= y_max + y_step / 2.0 {
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{yv:.1}" x2="{:.1}" y2="{yv:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT,
            LEFT + plot_w,
            LEFT - 6.0,
            y(v) + 4.0,
            if y_step < 1.0 {
                format!("{v:.1}")
            } else {
                thousands(v)
            },
            yv = y(v)
        );
        v += y_step;
    }
    let mut v = 0.0;
    while v <= x_max + x_step / 2.0 {
        let _ = writeln!(
            s,
            r#"<line x1="{xv:.1}" y1="{:.1}" x2="{xv:.1}" y2="{:.1}" stroke="black"/><text x="{xv:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_h,
            TOP + plot_h + 4.0,
            TOP + plot_h + 16.0,
            thousands(v),
            xv = x(v)
        );
        v += x_step;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        TOP + plot_h + 34.0,
        escape(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0,
        escape(y_label)
    );
    for (i, line) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = line
            .points
            .iter()
            .map(|&(px, py)| format!("{:.1},{:.1}", x(px), y(py)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"><title>{}</title></polyline>"#,
            path.join(" "),
            escape(line.name)
        );
        let ly = TOP + 14.0 + 18.0 * i as f64;
        let lx = LEFT + plot_w + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            escape(line.name)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{:.1}" fill="#555">{}</text>"##,
        HEIGHT - 10.0,
        escape(note)
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_dot_per_column_and_escapes_labels() {
        let cols = [
            Column {
                workload: "a<b",
                pair: "debug/off",
                low: 0.99,
                median: 1.01,
                high: 1.05,
                target: Some(1.03),
            },
            Column {
                workload: "a<b",
                pair: "shim/off",
                low: 1.0,
                median: 1.0,
                high: 1.0,
                target: None,
            },
        ];
        let s = svg("t", &cols);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<circle").count(), 2);
        assert!(s.contains("a&lt;b") && !s.contains("a<b"));
    }

    #[test]
    fn curve_has_one_line_per_series_and_round_ticks() {
        let a = [(0.0, 9.5), (50_000.0, 10.1), (100_000.0, 10.0)];
        let b = [(0.0, 11.0), (100_000.0, 12.0)];
        let s = curve(
            "t",
            "requests",
            "MiB",
            "n<1",
            &[
                Series {
                    name: "unified",
                    points: &a,
                },
                Series {
                    name: "disagg",
                    points: &b,
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains(">100,000<") && s.contains(">0<"), "{s}");
        assert!(s.contains("n&lt;1"));
        assert_eq!(tick_step(100_000.0, 5.0), 20_000.0);
        assert_eq!(tick_step(13.8, 5.0), 5.0);
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }
}

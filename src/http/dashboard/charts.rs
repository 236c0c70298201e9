//! Bar charts as inline SVG, drawn on the server: no script, no external assets. Every bar
//! carries its value in a tooltip (`<title>`) and in `data-` attributes, and every chart is
//! followed by a table of the same numbers for screen readers and for copying.

use maud::{Markup, html};

use super::units::{self, Quantity};

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 170.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 22.0;
/// Colour-blind-safe (Okabe–Ito), in series order.
const PALETTE: [&str; 6] = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9"];

pub struct Series {
    /// Shown in tooltips, the legend and the table.
    pub name: &'static str,
    /// `data-series` of its bars (tests and scripts find them by it).
    pub key: &'static str,
    pub values: Vec<f64>,
}

pub struct BarChart<'a> {
    /// `data-chart` of the figure.
    pub id: &'a str,
    pub title: &'a str,
    /// One per bar position (e.g. the day).
    pub labels: &'a [String],
    pub series: Vec<Series>,
    /// Stacked bars (parts of one total) or side by side.
    pub stacked: bool,
    /// Drawn as a dashed line with the scale reaching it — when the data reaches a quarter of
    /// it; further off, small usage would be a sliver under a far line, so the scale fits the
    /// data and a note says how far below the limit it is.
    pub limit: Option<f64>,
    /// What the values are: their format and the round values the scale ends on.
    pub quantity: Quantity,
}

/// One drawn bar.
struct Bar<'a> {
    x: f64,
    y: f64,
    width: f64,
    height: f64,
    colour: &'static str,
    series: &'a Series,
    label: &'a str,
    value: f64,
}

impl BarChart<'_> {
    fn bars(&self, y: impl Fn(f64) -> f64, slot: f64) -> Vec<Bar<'_>> {
        let width = if self.stacked { slot * 0.7 } else { slot * 0.7 / self.series.len().max(1) as f64 };
        let mut bars = Vec::new();
        for (i, label) in self.labels.iter().enumerate() {
            let x0 = LEFT + i as f64 * slot + slot * 0.15;
            let mut base = 0.0;
            for (k, series) in self.series.iter().enumerate() {
                let value = series.values.get(i).copied().unwrap_or(0.0);
                let (bottom, x) = if self.stacked { (base, x0) } else { (0.0, x0 + k as f64 * width) };
                let (top, floor) = (y(bottom + value), y(bottom));
                bars.push(Bar {
                    x,
                    y: top,
                    width,
                    height: floor - top,
                    colour: PALETTE[k % PALETTE.len()],
                    series,
                    label,
                    value,
                });
                if self.stacked {
                    base += value;
                }
            }
        }
        bars
    }

    pub fn render(&self) -> Markup {
        let n = self.labels.len().max(1);
        let totals = (0..n).map(|i| {
            let values = self.series.iter().map(|s| s.values.get(i).copied().unwrap_or(0.0));
            if self.stacked { values.sum() } else { values.fold(0.0, f64::max) }
        });
        let highest = totals.fold(0.0, f64::max);
        let limit_in_range = self.limit.filter(|limit| highest >= limit / 4.0);
        let limit_off_scale = self.limit.filter(|_| limit_in_range.is_none());
        let top = self.quantity.round_up(highest.max(limit_in_range.unwrap_or(0.0)));
        let format = |v: f64| self.quantity.format(v);
        let plot_h = HEIGHT - TOP - BOTTOM;
        let slot = (WIDTH - LEFT) / n as f64;
        let y = |v: f64| TOP + plot_h - v / top * plot_h;
        let every = n.div_ceil(6).max(1); // at most about six axis labels
        html! {
            figure data-chart=(self.id) {
                figcaption { (self.title) }
                svg viewBox=(format!("0 0 {WIDTH} {HEIGHT}")) width=(WIDTH) height=(HEIGHT) role="img"
                    aria-label=(format!("{}: chart; the table below has the numbers", self.title)) {
                    line x1=(LEFT) y1=(y(0.0)) x2=(WIDTH) y2=(y(0.0)) stroke="#888" {}
                    line x1=(LEFT) y1=(y(top / 2.0)) x2=(WIDTH) y2=(y(top / 2.0)) stroke="#ddd" {}
                    text x=(LEFT - 6.0) y=(TOP + 8.0) text-anchor="end" font-size="11" data-axis="top" { (format(top)) }
                    text x=(LEFT - 6.0) y=(y(top / 2.0) + 4.0) text-anchor="end" font-size="11" data-axis="middle" { (format(top / 2.0)) }
                    text x=(LEFT - 6.0) y=(y(0.0)) text-anchor="end" font-size="11" { "0" }
                    @for (i, label) in self.labels.iter().enumerate() {
                        @if i % every == 0 {
                            text x=(format!("{:.1}", LEFT + i as f64 * slot + slot * 0.15)) y=(HEIGHT - 6.0) font-size="11" { (label) }
                        }
                    }
                    @for bar in self.bars(y, slot) {
                        rect x=(format!("{:.1}", bar.x)) y=(format!("{:.1}", bar.y)) width=(format!("{:.1}", bar.width))
                            height=(format!("{:.1}", bar.height)) fill=(bar.colour) data-series=(bar.series.key)
                            data-label=(bar.label) data-value=(bar.value) {
                            title { (bar.label) " · " (bar.series.name) ": " (format(bar.value)) }
                        }
                    }
                    @if let Some(limit) = limit_in_range {
                        line x1=(LEFT) y1=(y(limit)) x2=(WIDTH) y2=(y(limit)) stroke="#b00020" stroke-dasharray="5 4"
                            data-limit=(limit) {
                            title { "limit: " (format(limit)) }
                        }
                    }
                }
                @if let Some(limit) = limit_off_scale {
                    p.note data-limit-off-scale=(limit) {
                        "The limit, " (format(limit)) ", is off this scale: the highest day reached "
                        (share(highest, limit)) " of it."
                    }
                }
                @if self.series.len() > 1 {
                    p.legend {
                        @for (k, series) in self.series.iter().enumerate() {
                            span.swatch style=(format!("background:{}", PALETTE[k % PALETTE.len()])) {}
                            (series.name) " "
                        }
                    }
                }
                details {
                    summary { "Numbers: " (self.title) }
                    table {
                        thead { tr { th scope="col" { "day" } @for s in &self.series { th scope="col" { (s.name) } } } }
                        tbody {
                            @for (i, label) in self.labels.iter().enumerate() {
                                tr {
                                    th scope="row" { (label) }
                                    @for s in &self.series {
                                        td { (format(s.values.get(i).copied().unwrap_or(0.0))) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `used` as a share of `limit`, readable however small (`0.1 %`, `less than 0.01 %`).
fn share(used: f64, limit: f64) -> String {
    let percent = units::percent(used, limit);
    match percent {
        0.0 => "0 %".to_owned(),
        p if p < 0.01 => "less than 0.01 %".to_owned(),
        p if p < 1.0 => format!("{p:.2} %"),
        p => format!("{p:.0} %"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_carry_their_values_and_the_table_repeats_them() {
        let labels = vec!["Nov 1".to_owned(), "Nov 2".to_owned()];
        let chart = BarChart {
            id: "egress",
            title: "Egress per day",
            labels: &labels,
            series: vec![Series { name: "egress", key: "egress", values: vec![10.0, 30.0] }],
            stacked: true,
            limit: Some(40.0),
            quantity: Quantity::Bytes,
        };
        let svg = chart.render().into_string();
        assert!(svg.contains(r#"data-series="egress" data-label="Nov 2" data-value="30""#), "{svg}");
        assert!(svg.contains("<title>Nov 2 · egress: 30 B</title>"), "{svg}");
        assert!(svg.contains(r#"data-limit="40""#), "{svg}");
        assert!(svg.contains("<td>30 B</td>"), "{svg}");
        // The 40-byte limit is the top of the scale: the 30 bar is three quarters of the plot.
        let plot = HEIGHT - TOP - BOTTOM;
        assert!(svg.contains(&format!(r#"height="{:.1}""#, plot * 0.75)), "{svg}");
    }

    #[test]
    fn small_usage_gets_its_own_scale_and_a_note_on_the_limit() {
        let labels = vec!["Nov 1".to_owned()];
        let chart = BarChart {
            id: "storage",
            title: "Stored bytes",
            labels: &labels,
            series: vec![Series { name: "stored", key: "stored", values: vec![51.0 * 1024.0 * 1024.0] }],
            stacked: true,
            limit: Some(50.0 * 1024.0 * 1024.0 * 1024.0),
            quantity: Quantity::Bytes,
        };
        let html = chart.render().into_string();
        assert!(html.contains(r#"data-axis="top">60 MiB<"#), "{html}");
        assert!(html.contains(r#"data-axis="middle">30 MiB<"#), "{html}");
        assert!(!html.contains("data-limit="), "no limit line far off the scale: {html}");
        assert!(html.contains("The limit, 50 GiB, is off this scale: the highest day reached 0.10 % of it."), "{html}");
    }
}

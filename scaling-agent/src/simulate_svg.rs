//! `scaling-agent simulate --svg FILE`: the simulated day as a picture, one column per volume and three
//! rows (work items waiting, instances, cost so far), a line per strategy (this agent, the KEDA-like
//! default, the fixed fleet), drawn with `plotters`' SVG backend (no font files: the text is SVG text).

use std::path::Path;

use plotters::prelude::*;

use crate::simulate::{Day, Sample, SimArgs, Strategy};

/// Each strategy's colour.
fn colour(s: Strategy) -> RGBColor {
    match s {
        Strategy::Agent => RGBColor(9, 105, 218),
        Strategy::KedaDefault => RGBColor(207, 34, 46),
        Strategy::FixedPeak => RGBColor(101, 109, 118),
    }
}

/// What a row shows, and how to read it off a sample.
struct Row {
    title: &'static str,
    value: fn(&Sample) -> f64,
}

const ROWS: [Row; 3] = [
    Row { title: "work items waiting or in flight", value: |s| s.waiting as f64 },
    Row { title: "instances", value: |s| f64::from(s.instances) },
    Row { title: "cost so far, USD", value: |s| s.cost },
];

/// Draws `days` into `path` as SVG.
pub fn draw(a: &SimArgs, days: &[Day], path: &Path) -> Result<(), String> {
    let columns = days.len().max(1) as u32;
    let size = (420 * columns + 40, 760);
    let root = SVGBackend::new(path, size).into_drawing_area();
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let title = format!(
        "A simulated day (seed {}): SLA {} s, {} work items/s per instance, {} s to start, ${}/instance-hour",
        a.seed, a.sla_secs, a.instance_throughput, a.startup_secs, a.price_instance_hour
    );
    let (header, body) = root.split_vertically(50);
    header.titled(&title, ("sans-serif", 16)).map_err(|e| fail(&e))?;
    let legend = crate::simulate::STRATEGIES.iter().enumerate();
    for (i, s) in legend {
        let x = 20 + 220 * i as i32;
        header.draw(&Rectangle::new([(x, 30), (x + 18, 34)], colour(*s).filled())).map_err(|e| fail(&e))?;
        header.draw(&Text::new(s.label(), (x + 24, 26), ("sans-serif", 13))).map_err(|e| fail(&e))?;
    }
    let cells = body.split_evenly((ROWS.len(), columns as usize));
    for (c, day) in days.iter().enumerate() {
        for (r, row) in ROWS.iter().enumerate() {
            let area = &cells[r * columns as usize + c];
            let top = day.outcomes.iter().flat_map(|(_, o)| o.timeline.iter().map(row.value)).fold(0.0_f64, f64::max).max(1.0) * 1.05;
            let caption = if r == 0 { format!("{}x: {}", day.scale, row.title) } else { row.title.to_string() };
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 13))
                .margin(8)
                .x_label_area_size(24)
                .y_label_area_size(52)
                .build_cartesian_2d(0.0_f64..24.0_f64, 0.0_f64..top)
                .map_err(|e| fail(&e))?;
            chart
                .configure_mesh()
                .x_labels(7)
                .x_label_formatter(&|h| format!("{h:02.0}:00"))
                .y_labels(5)
                .y_label_formatter(&|v| short(*v))
                .light_line_style(WHITE)
                .draw()
                .map_err(|e| fail(&e))?;
            // The agent's line last, on top.
            for (s, o) in day.outcomes.iter().rev() {
                let points = o.timeline.iter().map(|p| (p.t as f64 / 3600.0, (row.value)(p)));
                chart.draw_series(LineSeries::new(points, colour(*s).stroke_width(2))).map_err(|e| fail(&e))?;
            }
        }
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// A number for an axis: 1.2k, 3.4M, 0.05.
fn short(v: f64) -> String {
    match v.abs() {
        x if x >= 1e6 => format!("{:.1}M", v / 1e6),
        x if x >= 1e4 => format!("{:.0}k", v / 1e3),
        x if x >= 100.0 => format!("{v:.0}"),
        x if x >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{run_all, SimArgs};

    #[test]
    fn the_day_is_drawn_with_a_line_per_strategy_in_each_panel() {
        let a = SimArgs { scales: vec![1, 100], ..SimArgs::default() };
        let days = run_all(&a);
        for d in &days {
            for (_, o) in &d.outcomes {
                assert_eq!(o.timeline.len() as u64, 86_400 / crate::simulate::SAMPLE_EVERY, "a sample a minute");
                assert!(o.timeline.windows(2).all(|w| w[1].cost >= w[0].cost), "cost only grows");
            }
            let agent = &d.outcomes[0].1;
            assert!(agent.timeline.iter().any(|s| s.waiting > 0) && agent.timeline.iter().any(|s| s.instances > 0), "the busy hours show");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("day.svg");
        draw(&a, &days, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", &svg[..200.min(svg.len())]);
        // 2 volumes x 3 rows: a line in each strategy's colour (the axes and ticks are black).
        for s in crate::simulate::STRATEGIES {
            let RGBColor(r, g, b) = colour(s);
            let stroke = format!("stroke=\"#{r:02X}{g:02X}{b:02X}\"");
            let lines = svg.split("<polyline").skip(1).filter(|p| p.split('>').next().is_some_and(|tag| tag.contains(&stroke))).count();
            assert_eq!(lines, 6, "{}: a line per panel", s.label());
        }
        for s in crate::simulate::STRATEGIES {
            assert!(svg.contains(s.label()), "the legend names {}", s.label());
        }
        assert!(svg.contains("100x: work items waiting"), "the volumes are captioned");
    }
}

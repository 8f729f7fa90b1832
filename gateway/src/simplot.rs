//! The simulator's plot: replicas over time for each policy, against the
//! replicas the demand needs at the target, as SVG (text needs no fonts).

use std::path::Path;
use std::time::Duration;

use plotters::prelude::*;
use warmgate_autoscaler::sim::SimReport;

/// Seconds per plotted point: an hour-long trace stays a few hundred kB.
const STEP: f64 = 5.0;

/// Writes the plot of `reports` (which share one trace) to `file`.
pub fn replicas_svg(
    file: &Path,
    reports: &[SimReport],
    target: f64,
    cold: Duration,
) -> anyhow::Result<()> {
    let sample = |r: &SimReport, f: &dyn Fn(&(f64, f64, u32)) -> f64| -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        let mut next = 0.0;
        for p in &r.timeline {
            if p.0 >= next {
                out.push((p.0 / 60.0, f(p)));
                next = p.0 + STEP;
            }
        }
        out
    };
    let end = reports
        .iter()
        .filter_map(|r| r.timeline.last().map(|p| p.0 / 60.0))
        .fold(1.0_f64, f64::max);
    let top = reports
        .iter()
        .flat_map(|r| r.timeline.iter().map(|p| f64::from(p.2)))
        .fold(1.0_f64, f64::max)
        * 1.15;
    let root = SVGBackend::new(file, (1200, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "replicas over time, cold start {}",
                humantime::format_duration(cold)
            ),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..end, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("minutes")
        .y_desc("replicas")
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    if let Some(first) = reports.first() {
        chart
            .draw_series(LineSeries::new(
                sample(first, &|p| p.1 / target),
                RGBColor(170, 170, 170),
            ))?
            .label("demand / target")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RGBColor(170, 170, 170)));
    }
    let colours = [BLUE, RED, GREEN, MAGENTA, BLACK, CYAN];
    for (i, r) in reports.iter().enumerate() {
        let colour = colours[i % colours.len()];
        chart
            .draw_series(LineSeries::new(
                sample(r, &|p| f64::from(p.2)),
                colour.stroke_width(2),
            ))?
            .label(format!("{} ({:.0} replica-s)", r.policy, r.replica_seconds))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

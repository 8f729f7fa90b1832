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

/// Writes the sweep as one SVG: a panel per workload (rows) and cold start
/// (columns), each policy a point at (replica-seconds against Knative's,
/// p99 wait), and the clairvoyant schedule's frontier as a line. Lower
/// left is better; a point below and left of another dominates it.
pub fn sweep_svg(
    file: &Path,
    cells: &[warmgate_autoscaler::sim::sweep::Cell],
) -> anyhow::Result<()> {
    let mut workloads: Vec<&str> = Vec::new();
    let mut colds: Vec<Duration> = Vec::new();
    for c in cells {
        if !workloads.contains(&c.workload.as_str()) {
            workloads.push(&c.workload);
        }
        if !colds.contains(&c.cold_start) {
            colds.push(c.cold_start);
        }
    }
    let (rows, cols) = (workloads.len().max(1), colds.len().max(1));
    let (w, h) = (380 * cols as u32, 300 * rows as u32 + 60);
    let root = SVGBackend::new(file, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let (legend, grid) = root.split_vertically(60);
    if let Some(first) = cells.first() {
        draw_legend(&legend, first)?;
    }
    let panels = grid.split_evenly((rows, cols));
    for c in cells {
        let r = workloads.iter().position(|w| *w == c.workload).unwrap_or(0);
        let k = colds.iter().position(|d| *d == c.cold_start).unwrap_or(0);
        draw_panel(&panels[r * cols + k], c)?;
    }
    root.present()?;
    Ok(())
}

/// The colours of a sweep's policies, in the order of its rows.
const COLOURS: [RGBColor; 5] = [BLUE, MAGENTA, RED, GREEN, BLACK];

/// The sweep's legend: each policy's colour and name, the frontier's
/// line, and what the axes are.
fn draw_legend(
    legend: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    first: &warmgate_autoscaler::sim::sweep::Cell,
) -> anyhow::Result<()> {
    let mut x = 10;
    for (i, row) in first.rows.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        legend.draw(&Circle::new((x, 20), 5, colour.filled()))?;
        // "always at peak (3)": the count differs per panel.
        let name = row
            .report
            .policy
            .split(" (")
            .next()
            .unwrap_or(&row.report.policy)
            .to_string();
        let width = 12 + 9 * name.len() as i32;
        legend.draw(&Text::new(name, (x + 10, 12), ("sans-serif", 15)))?;
        x += width;
    }
    legend.draw(&PathElement::new(
        [(x, 20), (x + 20, 20)],
        RGBColor(150, 150, 150).stroke_width(2),
    ))?;
    legend.draw(&Text::new(
        "clairvoyant frontier",
        (x + 25, 12),
        ("sans-serif", 15),
    ))?;
    legend.draw(&Text::new(
        "x: replica-seconds / Knative's   y: p99 wait (s)   lower left is better",
        (10, 38),
        ("sans-serif", 14),
    ))?;
    Ok(())
}

/// One cell's panel: each policy's point and the clairvoyant frontier.
fn draw_panel(
    panel: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    c: &warmgate_autoscaler::sim::sweep::Cell,
) -> anyhow::Result<()> {
    let knative = c.rows[warmgate_autoscaler::sim::sweep::KNATIVE]
        .report
        .replica_seconds
        .max(1e-9);
    let points: Vec<(f64, f64)> = c
        .rows
        .iter()
        .map(|row| (row.report.replica_seconds / knative, row.report.p99()))
        .collect();
    let mut frontier: Vec<(f64, f64)> = c
        .frontier
        .points
        .iter()
        .map(|&(rs, p99)| (rs / knative, p99))
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    let xmax = points
        .iter()
        .chain(&frontier)
        .map(|p| p.0)
        .fold(1.2_f64, f64::max)
        * 1.1;
    let ymax = points.iter().map(|p| p.1).fold(1.0_f64, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(panel)
        .caption(
            format!(
                "{}, cold start {}",
                c.workload,
                humantime::format_duration(c.cold_start)
            ),
            ("sans-serif", 15),
        )
        .margin(8)
        .x_label_area_size(25)
        .y_label_area_size(35)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .x_labels(5)
        .y_labels(5)
        .draw()?;
    chart.draw_series(LineSeries::new(
        frontier.into_iter().filter(|p| p.1 <= ymax),
        RGBColor(150, 150, 150).stroke_width(2),
    ))?;
    for (i, p) in points.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart.draw_series(std::iter::once(Circle::new(*p, 5, colour.filled())))?;
    }
    Ok(())
}

//! The loss plot: a run's `metrics.jsonl` drawn as training and held-out loss against step.
//!
//! This module owns reading the metrics file for plotting and drawing the PNG, nothing else:
//! the training loop decides what it logs, and any key other than `step`, `loss` and `val_loss`
//! is ignored here, so new metrics never break plotting.
//!
//! The labels are set in DejaVu Sans, embedded in the binary (`assets/DejaVuSans.ttf`, with its
//! licence beside it): plotters' `ab_glyph` backend draws only fonts registered with it, and a
//! CI machine or a bare container may have no system fonts at all.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::register_font;
use serde_json::Value;

use crate::error::{Result, TrainError};

/// The size of the PNG [`plot_metrics`] draws, in pixels (width, height).
pub const DEFAULT_SIZE: (u32, u32) = (1024, 640);

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// The two curves read from a metrics file, as (step, loss) points in file order.
#[derive(Debug, Default, PartialEq)]
struct Curves {
    train: Vec<(f64, f64)>,
    val: Vec<(f64, f64)>,
}

/// Draws `metrics_jsonl`'s training loss (`loss`) and held-out loss (`val_loss`) against
/// `step` into the PNG `out_png`, [`DEFAULT_SIZE`] pixels, creating its directory if needed.
///
/// The file is JSON lines: one object per line, blank lines ignored. A line with `loss` or
/// `val_loss` must have a numeric `step`; a `null` loss (what serde_json writes for NaN or
/// infinity, as a diverged run logs) is left out of the curve rather than failing the plot.
/// Errors: a malformed line (`TrainError::Metrics`, naming the file and the line number), a file
/// with nothing to plot (`TrainError::Metrics`), a size too small to draw (`TrainError::InvalidArgument`), and failures reading or writing (`TrainError::Io`).
pub fn plot_metrics(metrics_jsonl: &Path, out_png: &Path) -> Result<()> {
    plot_metrics_sized(metrics_jsonl, out_png, DEFAULT_SIZE)
}

/// [`plot_metrics`] at `size` pixels (width, height).
pub fn plot_metrics_sized(metrics_jsonl: &Path, out_png: &Path, size: (u32, u32)) -> Result<()> {
    if size.0 < 200 || size.1 < 150 {
        return Err(TrainError::InvalidArgument {
            name: "size".into(),
            detail: format!(
                "{}: a {}x{} plot is too small to draw (at least 200x150)",
                out_png.display(),
                size.0,
                size.1
            ),
        });
    }
    let text = fs::read_to_string(metrics_jsonl).map_err(|e| TrainError::io(metrics_jsonl, e))?;
    let curves = parse_metrics(metrics_jsonl, &text)?;
    if curves.train.is_empty() && curves.val.is_empty() {
        return Err(TrainError::Metrics {
            path: metrics_jsonl.display().to_string(),
            detail: "no line has a finite `loss` or `val_loss`, so there is nothing to plot".into(),
        });
    }
    register_bundled_font()?;
    if let Some(dir) = out_png.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    }
    // The run's directory names the plot: `runs/ctx32k/metrics.jsonl` is "ctx32k".
    let run = metrics_jsonl.parent().and_then(Path::file_name).and_then(|n| n.to_str());
    let title = match run {
        Some(run) => format!("{run}: loss by step"),
        None => "loss by step".to_string(),
    };
    draw(&curves, &title, out_png, size)
}

/// Reads the (step, loss) points of a metrics file's text; `path` is for errors.
fn parse_metrics(path: &Path, text: &str) -> Result<Curves> {
    let mut curves = Curves::default();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let bad = |what: String| TrainError::Metrics { path: format!("{}:{line_no}", path.display()), detail: what };
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(bad("not a JSON object".to_string()));
        };
        let mut step = None;
        for (key, series) in [("loss", &mut curves.train), ("val_loss", &mut curves.val)] {
            let loss = match obj.get(key) {
                None | Some(Value::Null) => continue,
                Some(v) => v.as_f64().ok_or_else(|| bad(format!("`{key}` is {v}, not a number")))?,
            };
            let step = match step {
                Some(step) => step,
                None => {
                    let s = obj
                        .get("step")
                        .and_then(Value::as_f64)
                        .filter(|s| s.is_finite())
                        .ok_or_else(|| bad(format!("a line with `{key}` needs a numeric `step`")))?;
                    *step.insert(s)
                }
            };
            series.push((step, loss));
        }
    }
    Ok(curves)
}

/// Registers the embedded font as plotters' default family, once per process.
fn register_bundled_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    // "sans-serif" is the family every plotters default (axis labels, legend) asks for.
    let ok = *REGISTERED.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(TrainError::Internal(
            "assets/DejaVuSans.ttf, built into this binary, is not a font plotters can read".into(),
        ))
    }
}

/// The range `lo..hi` padded by 5% each side, widened when flat so a single point shows.
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let pad = if hi > lo { (hi - lo) * 0.05 } else { lo.abs().max(1.0) * 0.05 };
    (lo - pad)..(hi + pad)
}

fn draw(curves: &Curves, title: &str, out_png: &Path, size: (u32, u32)) -> Result<()> {
    let failed =
        |e: &dyn std::fmt::Display| TrainError::io(out_png, io::Error::other(format!("drawing the plot: {e}")));
    let points = || curves.train.iter().chain(&curves.val);
    let (x_lo, x_hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let (y_lo, y_hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));

    let root = BitMapBackend::new(out_png, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(padded(x_lo, x_hi), padded(y_lo, y_hi))
        .map_err(|e| failed(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        // Steps are whole numbers; `5.0` would suggest otherwise.
        .x_label_formatter(&|x| if x.fract() == 0.0 { format!("{x:.0}") } else { format!("{x:.1}") })
        .y_desc("loss")
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(|e| failed(&e))?;

    let train_color = RGBColor(31, 119, 180);
    let val_color = RGBColor(214, 39, 40);
    if !curves.train.is_empty() {
        chart
            .draw_series(LineSeries::new(curves.train.iter().copied(), train_color.stroke_width(2)))
            .map_err(|e| failed(&e))?
            .label("train loss")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], train_color.stroke_width(2)));
    }
    if !curves.val.is_empty() {
        // Held-out loss is measured rarely: its points are marked so a lone one still shows.
        chart
            .draw_series(LineSeries::new(curves.val.iter().copied(), val_color.stroke_width(2)).point_size(4))
            .map_err(|e| failed(&e))?
            .label("held-out loss (val_loss)")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], val_color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| failed(&e))?;
    root.present().map_err(|e| failed(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png_size(bytes: &[u8]) -> (u32, u32) {
        // The IHDR chunk comes first: 8-byte signature, 4-byte length, "IHDR", width, height.
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        (be(16), be(20))
    }

    #[test]
    fn plots_both_curves_into_a_png_of_the_requested_size() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("run-a").join("metrics.jsonl");
        fs::create_dir_all(metrics.parent().unwrap()).unwrap();
        let mut text = String::from("{\"config\": {\"lr\": 0.001}}\n\n");
        let loss_at = |step: u32| 5.0 * (-(step as f64) / 20.0).exp() + 1.0;
        for step in 0..50 {
            let loss = loss_at(step);
            text.push_str(&format!("{{\"step\": {step}, \"loss\": {loss}, \"lr\": 0.001, \"tok_per_s\": 1234.5}}\n"));
            if step % 10 == 9 {
                text.push_str(&format!("{{\"step\": {step}, \"val_loss\": {}}}\n", loss + 0.2));
            }
        }
        // A diverged step logs `null` (serde_json's NaN); it is skipped, not fatal.
        text.push_str("{\"step\": 50, \"loss\": null}\n");
        fs::write(&metrics, text).unwrap();

        let curves = parse_metrics(&metrics, &fs::read_to_string(&metrics).unwrap()).unwrap();
        assert_eq!((curves.train.len(), curves.val.len()), (50, 5));
        assert_eq!(curves.val[0], (9.0, loss_at(9) + 0.2));

        let out = dir.path().join("plots").join("loss.png");
        plot_metrics_sized(&metrics, &out, (640, 400)).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(png_size(&bytes), (640, 400));

        plot_metrics(&metrics, &out).unwrap();
        assert_eq!(png_size(&fs::read(&out).unwrap()), DEFAULT_SIZE);
    }

    #[test]
    fn plots_a_single_point() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        fs::write(&metrics, "{\"step\": 3, \"val_loss\": 2.5}\n").unwrap();
        let out = dir.path().join("loss.png");
        plot_metrics(&metrics, &out).unwrap();
        assert_eq!(&fs::read(&out).unwrap()[..4], b"\x89PNG");
    }

    fn config_error(text: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        fs::write(&metrics, text).unwrap();
        let out = dir.path().join("loss.png");
        let msg = match plot_metrics(&metrics, &out) {
            Err(e @ TrainError::Metrics { .. }) => e.to_string(),
            other => panic!("expected a metrics error, got {other:?}"),
        };
        assert!(msg.contains("metrics.jsonl"), "{msg}");
        assert!(!out.exists(), "no plot is drawn from a bad file");
        msg
    }

    #[test]
    fn a_malformed_line_names_the_file_and_line() {
        let good = "{\"step\": 1, \"loss\": 3.0}\n";
        let msg = config_error(&format!("{good}\n{good}{{\"step\": 2, \"loss\": 2.9\n"));
        assert!(msg.contains("metrics.jsonl:4: not valid JSON"), "{msg}");
        let msg = config_error(&format!("{good}[1, 2]\n"));
        assert!(msg.contains("metrics.jsonl:2: not a JSON object"), "{msg}");
        let msg = config_error(&format!("{good}{{\"step\": 2, \"loss\": \"low\"}}\n"));
        assert!(msg.contains("metrics.jsonl:2: `loss` is \"low\", not a number"), "{msg}");
        let msg = config_error(&format!("{good}{{\"val_loss\": 2.0}}\n"));
        assert!(msg.contains("metrics.jsonl:2: a line with `val_loss` needs a numeric `step`"), "{msg}");
        let msg = config_error("{\"step\": 1, \"lr\": 0.1}\n\n");
        assert!(msg.contains("nothing to plot"), "{msg}");
    }
}

//! PNG line charts for benchmark sweeps (plotters, pure Rust: no C font or image libraries).

use std::path::Path;

use plotters::prelude::*;

/// Fonts tried for labels; the first that exists is used. Without one, no chart is drawn.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/Library/Fonts/Arial.ttf",
];

/// Registers a system font for plotters once; `false` when none is found.
fn ensure_font() -> bool {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        for candidate in FONT_CANDIDATES {
            if let Ok(bytes) = std::fs::read(candidate) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` as lines with points; x on a log scale when `log_x`.
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series], log_x: bool) -> Result<(), String> {
    if !ensure_font() {
        return Err("no TrueType font found for chart labels (install fonts-dejavu-core)".into());
    }
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let all = series.iter().flat_map(|s| s.points.iter());
    let (x_min, x_max) = all.clone().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let y_max = all.fold(0.0f64, |m, p| m.max(p.1)) * 1.1;
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    // Ten colours: a rebalance bench draws two series per scenario and method (up to eight).
    let palette = [
        BLUE,
        RED,
        GREEN,
        MAGENTA,
        BLACK,
        CYAN,
        RGBColor(255, 140, 0),
        RGBColor(128, 0, 128),
        RGBColor(0, 128, 128),
        RGBColor(139, 69, 19),
    ];
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let color = palette[i % palette.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
                chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|e| err(&e))?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder.caption(title, ("sans-serif", 22)).margin(15).x_label_area_size(45).y_label_area_size(70);
    if log_x {
        draw!(builder.build_cartesian_2d((x_min..x_max).log_scale(), 0.0..y_max).map_err(|e| err(&e))?);
    } else {
        draw!(builder.build_cartesian_2d(x_min..x_max, 0.0..y_max).map_err(|e| err(&e))?);
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

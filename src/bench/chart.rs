//! A small SVG line chart: throughput against the swept value.

use std::fmt::Write;

/// Renders `points` (x, GB/s) as an SVG line chart titled `title`, x axis `x_label`.
pub fn svg(title: &str, x_label: &str, points: &[(f64, f64)]) -> String {
    let (w, h, m) = (640.0, 400.0, 60.0);
    let max_x = points.iter().map(|p| p.0).fold(f64::MIN, f64::max);
    let min_x = points.iter().map(|p| p.0).fold(f64::MAX, f64::min);
    let max_y = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let span_x = (max_x - min_x).max(1e-9);
    let px = |x: f64| m + (x - min_x) / span_x * (w - 2.0 * m);
    let py = |y: f64| h - m - y / max_y * (h - 2.0 * m);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        w / 2.0,
        h - 15.0,
        escape(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">GB/s</text>"#,
        h / 2.0,
        h / 2.0
    );
    for i in 0..=4 {
        let y = max_y * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{y:.1}</text>"#,
            m - 6.0,
            py(y) + 4.0
        );
    }
    let line: Vec<String> = points
        .iter()
        .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="steelblue" stroke-width="2" points="{}"/>"#,
        line.join(" ")
    );
    for &(x, y) in points {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="steelblue"/>"#,
            px(x),
            py(y)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{x}</text>"#,
            px(x),
            h - m + 16.0
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn renders_points() {
        let s = super::svg("t <1>", "tokens", &[(512.0, 1.0), (2048.0, 3.5)]);
        assert!(s.starts_with("<svg") && s.contains("<polyline") && s.contains("t &lt;1&gt;"));
        assert_eq!(s.matches("<circle").count(), 2);
    }
}

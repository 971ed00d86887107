//! `loss.svg`: the run's training and validation loss against step, as a plain SVG line chart
//! (no plotting dependency), rewritten as the run goes.

/// An SVG line chart of loss against step: training in blue, validation in orange, with axis
/// ranges and tick labels.
pub(super) fn loss_svg(train: &[(usize, f64)], valid: &[(usize, f64)]) -> String {
    let (w, h, m) = (720.0, 420.0, 56.0);
    let all = train.iter().chain(valid).filter(|p| p.1.is_finite());
    let (mut x1, mut y0, mut y1) = (1usize, f64::MAX, f64::MIN);
    for &(s, l) in all {
        x1 = x1.max(s);
        y0 = y0.min(l);
        y1 = y1.max(l);
    }
    if y0 > y1 {
        (y0, y1) = (0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let px = |s: usize| m + (s as f64 / x1 as f64) * (w - 2.0 * m);
    let py = |l: f64| h - m - (l - y0) / (y1 - y0) * (h - 2.0 * m);
    let line = |pts: &[(usize, f64)], color: &str| {
        let p: Vec<String> = pts
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(s, l)| format!("{:.1},{:.1}", px(s), py(l)))
            .collect();
        format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            p.join(" ")
        )
    };
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<line x1="{m}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{b}" stroke="black"/>
"#,
        b = h - m,
        r = w - m
    );
    for i in 0..=4 {
        let l = y0 + (y1 - y0) * i as f64 / 4.0;
        svg += &format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{l:.3}</text>"#,
            m - 6.0,
            py(l) + 4.0
        );
        let s = x1 * i / 4;
        svg += &format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{s}</text>"#,
            px(s),
            h - m + 16.0
        );
    }
    svg += &format!(
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        w / 2.0,
        h - 12.0
    );
    svg += &line(train, "#1f77b4");
    svg += &line(valid, "#ff7f0e");
    svg += &format!(
        r##"<text x="{:.1}" y="24" fill="#1f77b4">train loss</text><text x="{:.1}" y="24" fill="#ff7f0e">validation loss</text></svg>
"##,
        w - 240.0,
        w - 150.0
    );
    svg
}

//! The reference YUV -> RGB conversion against ffmpeg's swscale (exact path: nearest chroma,
//! accurate rounding, bit-exact), within 1 LSB on every pixel, for BT.601 and BT.709 in limited
//! and full range, from I420, NV12 and YUYV. Fixtures: `fixtures/isp-ffmpeg/make.sh`.

use isp_v4l2::isp::{Layout, Matrix, Preprocess, Range, Resize, preprocess, to_rgb8};
use isp_v4l2::{FrameDesc, PixelFormat};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../../fixtures/isp-ffmpeg/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn conversions_agree_with_swscale_within_one_lsb() {
    let inputs = [
        ("i420", PixelFormat::I420, "i420"),
        ("nv12", PixelFormat::Nv12, "i420"),
        ("yuyv", PixelFormat::Yuyv, "yuyv"),
    ];
    for (ext, format, reference) in inputs {
        let desc = FrameDesc::new(64, 48, format).unwrap();
        let yuv = fixture(&format!("testsrc2_64x48.{ext}"));
        for (m, matrix) in [("bt601", Matrix::Bt601), ("bt709", Matrix::Bt709)] {
            for (r, range) in [("tv", Range::Limited), ("pc", Range::Full)] {
                let want = fixture(&format!("testsrc2_64x48.{reference}.{m}.{r}.rgb"));
                let got = to_rgb8(&desc, &yuv, matrix, range).unwrap();
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| a.abs_diff(*b))
                    .max()
                    .unwrap();
                let off = got
                    .iter()
                    .zip(&want)
                    .filter(|(a, b)| a.abs_diff(**b) > 0)
                    .count();
                eprintln!(
                    "{ext} {m} {r}: max diff {worst} LSB, {off} of {} values differ",
                    got.len()
                );
                assert!(worst <= 1, "{ext} {m} {r}: {worst} LSB from swscale");
            }
        }
    }
}

/// 8-bit RGB from the fused pass: identity normalisation (`mean` 0, `std` 1/255 gives values in
/// 0..=255), HWC, rounded to nearest.
fn preprocess_rgb8(desc: &FrameDesc, yuv: &[u8], p: Preprocess) -> Vec<u8> {
    let p = Preprocess {
        mean: [0.0; 3],
        std: [1.0 / 255.0; 3],
        layout: Layout::Hwc,
        crop: None,
        ..p
    };
    let mut out = vec![0f32; 3 * p.width * p.height];
    preprocess(desc, yuv, &p, &mut out).unwrap();
    out.iter()
        .map(|v| v.round().clamp(0.0, 255.0) as u8)
        .collect()
}

#[test]
fn resizes_agree_with_swscale_within_one_lsb() {
    let mut combos = Vec::new();
    for flag in ["bilinear", "area"] {
        for size in [(24, 20), (40, 30)] {
            for m in ["bt601", "bt709"] {
                for r in ["tv", "pc"] {
                    combos.push((flag, size, m, r));
                }
            }
        }
        combos.push((flag, (100, 70), "bt601", "tv"));
        combos.push((flag, (100, 70), "bt709", "pc"));
    }
    let inputs = [
        ("i420", PixelFormat::I420, "i420"),
        ("nv12", PixelFormat::Nv12, "i420"),
        ("yuyv", PixelFormat::Yuyv, "yuyv"),
    ];
    let mut failures = Vec::new();
    for (ext, format, reference) in inputs {
        let desc = FrameDesc::new(64, 48, format).unwrap();
        let yuv = fixture(&format!("testsrc2_64x48.{ext}"));
        for &(flag, (w, h), m, r) in &combos {
            let p = Preprocess {
                matrix: if m == "bt601" {
                    Matrix::Bt601
                } else {
                    Matrix::Bt709
                },
                range: if r == "tv" {
                    Range::Limited
                } else {
                    Range::Full
                },
                width: w,
                height: h,
                resize: if flag == "bilinear" {
                    Resize::Bilinear
                } else {
                    Resize::Area
                },
                ..Default::default()
            };
            let name = format!("testsrc2_64x48.{reference}.{flag}.{w}x{h}.{m}.{r}.rgb");
            let want = fixture(&name);
            let got = preprocess_rgb8(&desc, &yuv, p);
            assert_eq!(got.len(), want.len(), "{name}");
            let diffs: Vec<u8> = got.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).collect();
            let worst = diffs.iter().copied().max().unwrap();
            let off = diffs.iter().filter(|&&d| d > 0).count();
            eprintln!(
                "{ext} {flag} {w}x{h} {m} {r}: max diff {worst} LSB, {off} of {} values differ",
                got.len()
            );
            if worst > 1 {
                failures.push(format!("{ext} {flag} {w}x{h} {m} {r}: {worst} LSB"));
            }
        }
    }
    assert!(failures.is_empty(), "beyond 1 LSB of swscale: {failures:?}");
}

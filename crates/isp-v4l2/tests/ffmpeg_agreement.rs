//! The reference YUV -> RGB conversion against ffmpeg's swscale (exact path: nearest chroma,
//! accurate rounding, bit-exact), within 1 LSB on every pixel, for BT.601 and BT.709 in limited
//! and full range, from I420, NV12 and YUYV. Fixtures: `fixtures/isp-ffmpeg/make.sh`.

use isp_v4l2::isp::{Matrix, Range, to_rgb8};
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

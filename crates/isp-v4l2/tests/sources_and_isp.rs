//! Frame sources and the reference ISP: layouts, the pattern source, Y4M parsing (good and bad
//! streams), the colour matrices on known colours, and the fused resize/normalise pass.

use std::io::Cursor;

use isp_v4l2::isp::{
    Coefficients, Crop, Layout, Matrix, Preprocess, Range, Resize, preprocess, to_rgb8,
};
use isp_v4l2::{Error, FrameDesc, FrameSource, Pacing, PatternSource, PixelFormat, Y4mSource};
use uvm_alloc::Access;

#[test]
fn layouts_are_validated() {
    assert!(matches!(
        FrameDesc::new(0, 4, PixelFormat::Nv12),
        Err(Error::BadFrame { .. })
    ));
    assert!(matches!(
        FrameDesc::new(5, 4, PixelFormat::I420),
        Err(Error::BadFrame { .. })
    ));
    assert!(matches!(
        FrameDesc::new(4, 5, PixelFormat::Nv12),
        Err(Error::BadFrame { .. })
    ));
    assert!(FrameDesc::new(4, 5, PixelFormat::Yuyv).is_ok());
    assert!(FrameDesc::new(5, 5, PixelFormat::Yuv444p).is_ok());
    assert!(matches!(
        FrameDesc::new(usize::MAX / 2, 3, PixelFormat::Rgb24),
        Err(Error::BadFrame { .. })
    ));
    assert_eq!(
        FrameDesc::new(1920, 1080, PixelFormat::Nv12)
            .unwrap()
            .byte_len(),
        1920 * 1080 * 3 / 2
    );
}

#[test]
fn known_colours_convert_exactly() {
    let c = Coefficients::new(Matrix::Bt601, Range::Limited);
    let round = |v: [f32; 3]| v.map(|x| x.round().clamp(0.0, 255.0) as u8);
    assert_eq!(round(c.rgb(235, 128, 128)), [255, 255, 255]);
    assert_eq!(round(c.rgb(16, 128, 128)), [0, 0, 0]);
    // BT.601 limited-range red, green, blue from the usual tables, whose YUV codes are
    // themselves rounded: within 1 of the primaries.
    let near = |got: [u8; 3], want: [u8; 3]| got.iter().zip(want).all(|(g, w)| g.abs_diff(w) <= 1);
    assert!(near(round(c.rgb(81, 90, 240)), [255, 0, 0]));
    assert!(near(round(c.rgb(145, 54, 34)), [0, 255, 0]));
    assert!(near(round(c.rgb(41, 240, 110)), [0, 0, 255]));
    let f = Coefficients::new(Matrix::Bt709, Range::Full);
    assert_eq!(round(f.rgb(255, 128, 128)), [255, 255, 255]);
    // BT.709 full-range red: Y = 0.2126 * 255, Cr = 0.5 * 255 + 128 clamps at 255.
    let red = round(f.rgb(54, 99, 255));
    assert!(red[0] >= 254 && red[1] <= 1 && red[2] <= 1, "{red:?}");
}

/// Every pixel of every layout holds `PatternSource::sample`'s value (the row-at-a-time writer
/// is the per-pixel definition, just faster), at odd sizes too.
#[test]
fn the_pattern_source_writes_sample_at_every_pixel() {
    for (w, h) in [(64, 32), (30, 18), (1920, 1080)] {
        for format in [
            PixelFormat::Nv12,
            PixelFormat::I420,
            PixelFormat::Yuyv,
            PixelFormat::Yuv422p,
            PixelFormat::Yuv444p,
        ] {
            let mut src =
                PatternSource::new(w, h, format, 60.0, Pacing::AsFastAsPossible, Some(2)).unwrap();
            for n in 0..2u64 {
                let f = src.next_frame().unwrap().unwrap();
                let g = f
                    .buffer
                    .cpu_access(0..f.desc.byte_len(), Access::Read)
                    .unwrap();
                let bytes = g.bytes();
                for y in (0..h).step_by(if w > 100 { 7 } else { 1 }) {
                    for x in 0..w {
                        let (yy, u, v) = f.desc.yuv_at(bytes, x, y).unwrap();
                        let (cx, cy) = match format {
                            PixelFormat::Nv12 | PixelFormat::I420 => (x / 2 * 2, y / 2 * 2),
                            PixelFormat::Yuyv | PixelFormat::Yuv422p => (x / 2 * 2, y),
                            _ => (x, y),
                        };
                        let want_y = PatternSource::sample(w, h, n, x, y).0;
                        let (_, want_u, want_v) = PatternSource::sample(w, h, n, cx, cy);
                        assert_eq!(
                            (yy, u, v),
                            (want_y, want_u, want_v),
                            "{format:?} {w}x{h} ({x}, {y})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_pattern_source_moves_and_signals_its_timeline() {
    for format in [
        PixelFormat::Nv12,
        PixelFormat::I420,
        PixelFormat::Yuyv,
        PixelFormat::Yuv444p,
    ] {
        let mut src =
            PatternSource::new(64, 32, format, 60.0, Pacing::AsFastAsPossible, Some(3)).unwrap();
        let timeline = src.timeline();
        let mut first = None;
        for n in 0..3u64 {
            let f = src.next_frame().unwrap().unwrap();
            assert_eq!((f.sequence, f.ready), (n, n + 1));
            assert_eq!(timeline.value().unwrap(), n + 1);
            let bytes = f
                .buffer
                .cpu_access(0..f.desc.byte_len(), Access::Read)
                .unwrap()
                .bytes()
                .to_vec();
            let rgb = to_rgb8(&f.desc, &bytes, Matrix::Bt601, Range::Limited).unwrap();
            assert_eq!(rgb.len(), 64 * 32 * 3);
            // Top-left pixel is the white bar (ramp -32 at the top).
            assert_eq!(
                f.desc.yuv_at(&bytes, 0, 0).unwrap().0,
                if n == 0 {
                    203
                } else {
                    f.desc.yuv_at(&bytes, 0, 0).unwrap().0
                }
            );
            match &first {
                None => first = Some(rgb),
                Some(f0) => assert_ne!(f0, &rgb, "{format:?}: the pattern moves"),
            }
        }
        assert!(src.next_frame().unwrap().is_none());
    }
}

fn y4m_stream(width: usize, height: usize, colorspace: &str, frames: usize) -> Vec<u8> {
    let mut s = format!("YUV4MPEG2 W{width} H{height} F30:1 Ip A1:1 C{colorspace}\n").into_bytes();
    let chroma = match colorspace {
        "420jpeg" | "420" => (width / 2) * (height / 2),
        "422" => (width / 2) * height,
        _ => width * height,
    };
    for f in 0..frames {
        s.extend_from_slice(b"FRAME\n");
        s.extend((0..width * height).map(|i| (16 + (i + f) % 200) as u8));
        s.extend(std::iter::repeat_n(128u8, 2 * chroma));
    }
    s
}

#[test]
fn y4m_files_decode_into_unified_buffers() {
    for (cs, format) in [
        ("420jpeg", PixelFormat::I420),
        ("422", PixelFormat::Yuv422p),
        ("444", PixelFormat::Yuv444p),
    ] {
        let data = y4m_stream(16, 8, cs, 2);
        let mut src = Y4mSource::new(Cursor::new(data), Pacing::AsFastAsPossible).unwrap();
        assert_eq!(src.desc(), FrameDesc::new(16, 8, format).unwrap());
        assert_eq!(src.rate(), Some(30.0));
        let f = src.next_frame().unwrap().unwrap();
        let bytes = f
            .buffer
            .cpu_access(0..f.desc.byte_len(), Access::Read)
            .unwrap()
            .bytes()
            .to_vec();
        assert_eq!(f.desc.yuv_at(&bytes, 3, 0), Some((19, 128, 128)));
        assert!(src.next_frame().unwrap().is_some());
        assert!(src.next_frame().unwrap().is_none());
    }
}

/// A Y4M file announces its next frame already read into its buffer; `next_frame` delivers that
/// very frame (same buffer, sequence and `ready` value) and signals it only then; the end of
/// the stream announces nothing.
#[test]
fn y4m_files_announce_their_next_frame_filled() {
    let data = y4m_stream(16, 8, "420jpeg", 2);
    let mut src = Y4mSource::new(Cursor::new(data), Pacing::AsFastAsPossible).unwrap();
    let timeline = src.timeline();
    for f in 0..2u64 {
        let announced = src.announce_next().unwrap().expect("a frame is left");
        // Asking again announces the same frame.
        let again = src.announce_next().unwrap().unwrap();
        assert!(std::sync::Arc::ptr_eq(&announced.buffer, &again.buffer));
        assert_eq!((announced.sequence, announced.ready), (f, f + 1));
        assert!(
            timeline.value().unwrap() < announced.ready,
            "signalled early"
        );
        let bytes = announced
            .buffer
            .cpu_access(0..announced.desc.byte_len(), Access::Read)
            .unwrap()
            .bytes()
            .to_vec();
        assert_eq!(
            announced.desc.yuv_at(&bytes, 3, 0),
            Some((19 + f as u8, 128, 128))
        );
        let delivered = src.next_frame().unwrap().unwrap();
        assert!(std::sync::Arc::ptr_eq(&delivered.buffer, &announced.buffer));
        assert_eq!((delivered.sequence, delivered.ready), (f, f + 1));
        assert_eq!(timeline.value().unwrap(), f + 1);
    }
    assert!(src.announce_next().unwrap().is_none());
    assert!(src.next_frame().unwrap().is_none());
}

#[test]
fn bad_y4m_streams_are_clear_errors() {
    let mut truncated = y4m_stream(16, 8, "420jpeg", 1);
    truncated.truncate(truncated.len() - 10);
    let mut src = Y4mSource::new(Cursor::new(truncated), Pacing::AsFastAsPossible).unwrap();
    assert!(matches!(src.next_frame(), Err(Error::Y4m { .. })));
    assert!(matches!(
        Y4mSource::new(
            Cursor::new(b"NOT A Y4M FILE\n".to_vec()),
            Pacing::AsFastAsPossible
        ),
        Err(Error::Y4m { .. })
    ));
    let mono = y4m_stream(16, 8, "mono", 1);
    assert_eq!(
        Y4mSource::new(Cursor::new(mono), Pacing::AsFastAsPossible).unwrap_err(),
        Error::Unsupported {
            what: "Y4M monochrome (no chroma planes)"
        }
    );
    let odd = b"YUV4MPEG2 W15 H8 F30:1 C420jpeg\n".to_vec();
    assert!(matches!(
        Y4mSource::new(Cursor::new(odd), Pacing::AsFastAsPossible),
        Err(Error::BadFrame { .. })
    ));
    // A rate of one frame in 1.1e19 seconds: the second frame's timestamp overflowed
    // `Duration` and panicked (found by `cargo xtask fuzz`, CI 2026-12-07).
    let slow = b"YUV4MPEG2 W8 H4 F1:11111111111111111111\nFRAME\n".to_vec();
    let err = Y4mSource::new(Cursor::new(slow), Pacing::AsFastAsPossible).unwrap_err();
    assert!(
        matches!(&err, Error::Y4m { what } if what.contains("F1:11111111111111111111")),
        "{err}"
    );
    let fast = b"YUV4MPEG2 W8 H4 F4294967295:1\n".to_vec();
    assert!(Y4mSource::new(Cursor::new(fast), Pacing::AsFastAsPossible).is_err());
}

/// The fuzzer's crash input (CI 2026-12-07), byte for byte: it panicked at its second frame's
/// timestamp; its header is now refused by name.
#[test]
fn y4m_fuzz_reproducer_is_handled() {
    let crash: &[u8] =
        b"YUV4MPEG2 W8 H4 F1:11111111111111111111\nFRAME \x06\x00\x00\x00\npegBRAME\x00\n\x01\
      \x02\x00\x00\x00\x00\x00\x00\x00\x00F30:1 Ipeg\x02FRAME \n+\x00\x01\x00\x00\x00peg\n\
      FRAME\npRAME\n$\x01\x02\x00\x00 F\x00@\x00\x003 &pIUV4MPEG2 W8 H4 F30:1 Ipeg\nFRAME \
      \x00\npe F000000000000000003978RM\x00\x00\x00F30:1\xeaIpeg\x02FR\x00\x01\x00\x00\x00";
    assert!(matches!(
        Y4mSource::new(Cursor::new(crash.to_vec()), Pacing::AsFastAsPossible),
        Err(Error::Y4m { .. })
    ));
}

#[test]
fn frame_rates_outside_the_supported_range_are_refused() {
    for rate in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-30, 1e30] {
        let err = PatternSource::new(
            8,
            4,
            PixelFormat::I420,
            rate,
            Pacing::AsFastAsPossible,
            None,
        )
        .err()
        .unwrap_or_else(|| panic!("rate {rate} was accepted"));
        assert!(matches!(err, Error::BadFrame { .. }), "{err}");
    }
    for rate in [
        *isp_v4l2::FRAME_RATES.start(),
        30.0,
        *isp_v4l2::FRAME_RATES.end(),
    ] {
        PatternSource::new(
            8,
            4,
            PixelFormat::I420,
            rate,
            Pacing::AsFastAsPossible,
            None,
        )
        .unwrap();
    }
}

#[test]
fn fused_pass_matches_rgb_then_resize() {
    let d = FrameDesc::new(64, 48, PixelFormat::Nv12).unwrap();
    let mut src = PatternSource::new(
        64,
        48,
        PixelFormat::Nv12,
        30.0,
        Pacing::AsFastAsPossible,
        None,
    )
    .unwrap();
    let f = src.next_frame().unwrap().unwrap();
    let bytes = f
        .buffer
        .cpu_access(0..d.byte_len(), Access::Read)
        .unwrap()
        .bytes()
        .to_vec();
    // Same size, identity normalisation: the fused pass equals the RGB conversion. (On 4:4:4:
    // subsampled chroma is interpolated at centre siting by the pass, as swscale does, where
    // `to_rgb8` takes the chroma of the block.)
    let d444 = FrameDesc::new(64, 48, PixelFormat::Yuv444p).unwrap();
    let mut src444 = PatternSource::new(
        64,
        48,
        PixelFormat::Yuv444p,
        30.0,
        Pacing::AsFastAsPossible,
        None,
    )
    .unwrap();
    let f444 = src444.next_frame().unwrap().unwrap();
    let bytes444 = f444
        .buffer
        .cpu_access(0..d444.byte_len(), Access::Read)
        .unwrap()
        .bytes()
        .to_vec();
    let p = Preprocess {
        width: 64,
        height: 48,
        mean: [0.0; 3],
        std: [1.0; 3],
        layout: Layout::Hwc,
        ..Default::default()
    };
    let mut out = vec![0f32; 64 * 48 * 3];
    preprocess(&d444, &bytes444, &p, &mut out).unwrap();
    let rgb = to_rgb8(&d444, &bytes444, Matrix::Bt601, Range::Limited).unwrap();
    for (o, r) in out.iter().zip(&rgb) {
        assert!((o * 255.0 - f32::from(*r)).abs() <= 0.5 + 1e-3);
    }
    // A 2x area downscale of a crop (even offsets) averages each 2x2 luma block and takes the
    // block's own chroma (the chroma plane is unscaled), then converts, normalised to -1..1
    // (CHW).
    let p = Preprocess {
        crop: Some(Crop {
            x: 8,
            y: 8,
            width: 32,
            height: 16,
        }),
        width: 16,
        height: 8,
        resize: Resize::Area,
        ..Default::default()
    };
    let mut out = vec![0f32; 3 * 16 * 8];
    preprocess(&d, &bytes, &p, &mut out).unwrap();
    let c = Coefficients::new(Matrix::Bt601, Range::Limited);
    for (oy, ox) in [(0, 0), (3, 7), (7, 15)] {
        let (x, y) = (8 + 2 * ox, 8 + 2 * oy);
        let luma: f32 = [(0, 0), (1, 0), (0, 1), (1, 1)]
            .iter()
            .map(|(dx, dy)| f32::from(d.yuv_at(&bytes, x + dx, y + dy).unwrap().0))
            .sum::<f32>()
            / 4.0;
        let (_, u, v) = d.yuv_at(&bytes, x, y).unwrap();
        let rgb = c.rgb_f32([luma, f32::from(u), f32::from(v)]);
        for ch in 0..3 {
            let mean = rgb[ch].clamp(0.0, 255.0);
            let want = (mean / 255.0 - 0.5) / 0.5;
            let got = out[ch * 128 + oy * 16 + ox];
            assert!(
                (got - want).abs() < 1e-4,
                "({ox},{oy}) ch {ch}: {got} vs {want}"
            );
        }
    }
    // Errors: crop outside, wrong output length, RGB input.
    let bad = Preprocess {
        crop: Some(Crop {
            x: 60,
            y: 0,
            width: 8,
            height: 8,
        }),
        ..p
    };
    assert!(matches!(
        preprocess(&d, &bytes, &bad, &mut out),
        Err(Error::BadFrame { .. })
    ));
    assert!(matches!(
        preprocess(&d, &bytes, &p, &mut out[1..]),
        Err(Error::BadFrame { .. })
    ));
    // RGB24 input skips the colour conversion: a flat grey stays grey.
    let rgb_desc = FrameDesc::new(4, 4, PixelFormat::Rgb24).unwrap();
    let mut grey = [0f32; 12];
    let small = Preprocess {
        width: 2,
        height: 2,
        crop: None,
        ..p
    };
    preprocess(&rgb_desc, &[51; 48], &small, &mut grey).unwrap();
    assert!(
        grey.iter().all(|v| (v - (0.2 - 0.5) / 0.5).abs() < 1e-6),
        "{grey:?}"
    );
    // f16 output agrees with f32 to f16 precision.
    let mut out16 = vec![half::f16::ZERO; out.len()];
    preprocess(&d, &bytes, &p, &mut out16).unwrap();
    assert!(
        out.iter()
            .zip(&out16)
            .all(|(a, b)| (a - b.to_f32()).abs() < 2e-3)
    );
}

#[test]
fn specialised_layouts_agree_with_each_other() {
    // The pattern writes the same samples in NV12 and I420, so their fused passes (each with its
    // own specialised sampler) must agree bit for bit. (NV12's path is checked against the
    // generic reference conversion in `fused_pass_matches_rgb_then_resize`.)
    let p = Preprocess {
        width: 96,
        height: 40,
        ..Default::default()
    };
    let mut outs = Vec::new();
    for format in [PixelFormat::Nv12, PixelFormat::I420] {
        let mut src =
            PatternSource::new(192, 80, format, 30.0, Pacing::AsFastAsPossible, None).unwrap();
        let f = src.next_frame().unwrap().unwrap();
        let bytes = f
            .buffer
            .cpu_access(0..f.desc.byte_len(), Access::Read)
            .unwrap()
            .bytes()
            .to_vec();
        let mut out = vec![0f32; 3 * 96 * 40];
        preprocess(&f.desc, &bytes, &p, &mut out).unwrap();
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1]);
}

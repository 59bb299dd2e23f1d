//! The CPU ISP: YUV to RGB with BT.601 or BT.709 in limited or full range, crop, resize
//! (bilinear or area) and mean/std normalisation, fused into one pass from the camera frame to
//! the model's input tensor (f32 or f16, CHW or HWC). No full-resolution RGB image is ever made:
//! each output pixel converts only the source pixels it samples.
//!
//! This is the scalar reference; SIMD and WGSL variants are to be tested against it.

use crate::Error;
use crate::format::{FrameDesc, Sampler};

/// YUV -> RGB matrix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Matrix {
    /// ITU-R BT.601 (SD video, most webcams' JPEG/MJPEG).
    #[default]
    Bt601,
    /// ITU-R BT.709 (HD video).
    Bt709,
}

/// YUV quantisation range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Range {
    /// Y in 16..=235, chroma in 16..=240 ("TV", the video default).
    #[default]
    Limited,
    /// Every code 0..=255 ("PC", JPEG).
    Full,
}

/// The coefficients of one matrix and range: `rgb = m * (yuv - offset)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Coefficients {
    pub y_offset: f32,
    pub y_scale: f32,
    pub c_scale: f32,
    pub r_cr: f32,
    pub g_cb: f32,
    pub g_cr: f32,
    pub b_cb: f32,
}

impl Coefficients {
    /// Derived from the matrix's luma weights Kr and Kb.
    pub fn new(matrix: Matrix, range: Range) -> Coefficients {
        let (kr, kb) = match matrix {
            Matrix::Bt601 => (0.299f32, 0.114f32),
            Matrix::Bt709 => (0.2126, 0.0722),
        };
        let kg = 1.0 - kr - kb;
        let (y_offset, y_scale, c_scale) = match range {
            Range::Limited => (16.0, 255.0 / 219.0, 255.0 / 224.0),
            Range::Full => (0.0, 1.0, 1.0),
        };
        Coefficients {
            y_offset,
            y_scale,
            c_scale,
            r_cr: 2.0 * (1.0 - kr),
            g_cb: -2.0 * kb * (1.0 - kb) / kg,
            g_cr: -2.0 * kr * (1.0 - kr) / kg,
            b_cb: 2.0 * (1.0 - kb),
        }
    }

    /// RGB in 0..=255 (unclamped) of one YUV sample.
    #[inline]
    pub fn rgb(&self, y: u8, u: u8, v: u8) -> [f32; 3] {
        self.rgb_f32([f32::from(y), f32::from(u), f32::from(v)])
    }

    /// [`Coefficients::rgb`] of an interpolated (fractional) YUV sample.
    #[inline]
    pub fn rgb_f32(&self, [y, u, v]: [f32; 3]) -> [f32; 3] {
        let y = (y - self.y_offset) * self.y_scale;
        let cb = (u - 128.0) * self.c_scale;
        let cr = (v - 128.0) * self.c_scale;
        [
            y + self.r_cr * cr,
            y + self.g_cb * cb + self.g_cr * cr,
            y + self.b_cb * cb,
        ]
    }
}

/// How the image is scaled to the output size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Resize {
    /// Bilinear between the four nearest source pixels (pixel centres aligned).
    #[default]
    Bilinear,
    /// Mean of the source pixels each output pixel covers (for downscaling).
    Area,
}

/// Output tensor layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Planar: all R, then all G, then all B (PyTorch's NCHW without N).
    #[default]
    Chw,
    /// Interleaved RGB per pixel.
    Hwc,
}

/// A crop rectangle in source pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crop {
    pub x: usize,
    pub y: usize,
    pub width: usize,
    pub height: usize,
}

/// One fused preprocessing pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preprocess {
    pub matrix: Matrix,
    pub range: Range,
    /// Source rectangle; `None` is the whole frame.
    pub crop: Option<Crop>,
    pub width: usize,
    pub height: usize,
    pub resize: Resize,
    /// Per channel, applied to RGB scaled to 0..1: `(rgb / 255 - mean) / std`.
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub layout: Layout,
}

impl Preprocess {
    /// The crop rectangle in `desc`'s frame (the whole frame when none is set), checked: inside
    /// the frame, non-empty, and a non-empty output size. The CPU pass and the GPU pass's
    /// parameters both start here.
    pub fn checked_crop(&self, desc: &FrameDesc) -> Result<Crop, Error> {
        let crop = self.crop.unwrap_or(Crop {
            x: 0,
            y: 0,
            width: desc.width,
            height: desc.height,
        });
        let inside = crop
            .x
            .checked_add(crop.width)
            .is_some_and(|r| r <= desc.width)
            && crop
                .y
                .checked_add(crop.height)
                .is_some_and(|b| b <= desc.height);
        if crop.width == 0 || crop.height == 0 || !inside {
            return Err(Error::BadFrame {
                what: format!(
                    "crop {crop:?} outside the {}x{} frame",
                    desc.width, desc.height
                ),
            });
        }
        if self.width == 0 || self.height == 0 {
            return Err(Error::BadFrame {
                what: "zero-sized output".into(),
            });
        }
        Ok(crop)
    }
}

impl Default for Preprocess {
    /// SmolVLM/SigLIP's input: 512x512, mean 0.5, std 0.5 (values in -1..1), CHW.
    fn default() -> Preprocess {
        Preprocess {
            matrix: Matrix::Bt601,
            range: Range::Limited,
            crop: None,
            width: 512,
            height: 512,
            resize: Resize::Bilinear,
            mean: [0.5; 3],
            std: [0.5; 3],
            layout: Layout::Chw,
        }
    }
}

/// Converts a whole YUV frame to 8-bit RGB at its own size (what the model sees, before
/// scaling), rounding to nearest and clamping; chroma is taken from the block that holds each
/// pixel.
pub fn to_rgb8(
    desc: &FrameDesc,
    bytes: &[u8],
    matrix: Matrix,
    range: Range,
) -> Result<Vec<u8>, Error> {
    check_bytes(desc, bytes)?;
    let c = Coefficients::new(matrix, range);
    let mut out = Vec::with_capacity(desc.width * desc.height * 3);
    for y in 0..desc.height {
        for x in 0..desc.width {
            let (yy, u, v) = desc.yuv_at(bytes, x, y).ok_or(Error::Unsupported {
                what: "RGB input to a YUV conversion",
            })?;
            for ch in c.rgb(yy, u, v) {
                out.push(ch.round().clamp(0.0, 255.0) as u8);
            }
        }
    }
    Ok(out)
}

fn check_bytes(desc: &FrameDesc, bytes: &[u8]) -> Result<(), Error> {
    if bytes.len() < desc.byte_len() {
        return Err(Error::BadFrame {
            what: format!(
                "{:?} {}x{} needs {} bytes, got {}",
                desc.format,
                desc.width,
                desc.height,
                desc.byte_len(),
                bytes.len()
            ),
        });
    }
    Ok(())
}

/// The fused pass: `out` receives `3 * width * height` values in `p.layout`. RGB24 input skips
/// the colour conversion (the matrix and range are then unused).
pub fn preprocess<T: OutElem>(
    desc: &FrameDesc,
    bytes: &[u8],
    p: &Preprocess,
    out: &mut [T],
) -> Result<(), Error> {
    check_bytes(desc, bytes)?;
    let crop = p.checked_crop(desc)?;
    let n = p.width * p.height;
    if out.len() != 3 * n {
        return Err(Error::BadFrame {
            what: format!("output holds {} values, needs {}", out.len(), 3 * n),
        });
    }
    let c = Coefficients::new(p.matrix, p.range);
    let sampler = Sampler::new(desc);
    let is_rgb = desc.format == crate::PixelFormat::Rgb24;
    // Samples in the frame's own space (YUV, or RGB for RGB24 input); `to_rgb` maps them.
    let yuv_at = |x: usize, y: usize| match sampler.yuv(bytes, crop.x + x, crop.y + y) {
        Some((yy, u, v)) => [f32::from(yy), f32::from(u), f32::from(v)],
        None => sampler
            .rgb(bytes, crop.x + x, crop.y + y)
            .expect("RGB24 when not YUV")
            .map(f32::from),
    };
    let to_rgb = |s: [f32; 3]| if is_rgb { s } else { c.rgb_f32(s) };
    // The loop is monomorphised per sampler, so the common camera layouts (NV12, I420) read
    // their planes without a per-sample format dispatch.
    let (w0, planes) = (sampler.luma_stride(), desc.planes());
    match desc.format {
        crate::PixelFormat::Nv12 => {
            let c0 = planes[1].offset;
            fused(p, crop, n, out, to_rgb, |x, y| {
                let (x, y) = (crop.x + x, crop.y + y);
                let c = c0 + (y / 2) * w0 + (x / 2) * 2;
                [
                    f32::from(bytes[y * w0 + x]),
                    f32::from(bytes[c]),
                    f32::from(bytes[c + 1]),
                ]
            })
        }
        crate::PixelFormat::I420 => {
            let (u0, v0, cw) = (planes[1].offset, planes[2].offset, planes[1].stride);
            fused(p, crop, n, out, to_rgb, |x, y| {
                let (x, y) = (crop.x + x, crop.y + y);
                let c = (y / 2) * cw + x / 2;
                [
                    f32::from(bytes[y * w0 + x]),
                    f32::from(bytes[u0 + c]),
                    f32::from(bytes[v0 + c]),
                ]
            })
        }
        _ => fused(p, crop, n, out, to_rgb, yuv_at),
    }
    Ok(())
}

/// The fused loop over output pixels, for one sampler (`sample(x, y)` in crop coordinates).
#[inline(always)]
fn fused<T: OutElem>(
    p: &Preprocess,
    crop: Crop,
    n: usize,
    out: &mut [T],
    to_rgb: impl Fn([f32; 3]) -> [f32; 3],
    yuv_at: impl Fn(usize, usize) -> [f32; 3],
) {
    let (sx, sy) = (
        crop.width as f32 / p.width as f32,
        crop.height as f32 / p.height as f32,
    );
    let scale: [f32; 3] = std::array::from_fn(|i| 1.0 / (255.0 * p.std[i]));
    let bias: [f32; 3] = std::array::from_fn(|i| -p.mean[i] / p.std[i]);
    // Bilinear taps per output column and row, computed once.
    let taps = |o: usize, s: f32, len: usize| {
        let f = ((o as f32 + 0.5) * s - 0.5).clamp(0.0, (len - 1) as f32);
        let i0 = f as usize;
        (i0, (i0 + 1).min(len - 1), f - i0 as f32)
    };
    let cols: Vec<(usize, usize, f32)> = (0..p.width).map(|o| taps(o, sx, crop.width)).collect();
    for oy in 0..p.height {
        let (y0, y1, ay) = taps(oy, sy, crop.height);
        for (ox, &(x0, x1, ax)) in cols.iter().enumerate() {
            let rgb = match p.resize {
                // YUV -> RGB is affine, so interpolating YUV and converting once equals converting
                // the four taps and interpolating RGB (up to float rounding), at a quarter of the
                // work.
                Resize::Bilinear => {
                    let (a, b, cc, d) = (
                        yuv_at(x0, y0),
                        yuv_at(x1, y0),
                        yuv_at(x0, y1),
                        yuv_at(x1, y1),
                    );
                    let mix: [f32; 3] = std::array::from_fn(|i| {
                        let top = a[i] + (b[i] - a[i]) * ax;
                        let bottom = cc[i] + (d[i] - cc[i]) * ax;
                        top + (bottom - top) * ay
                    });
                    to_rgb(mix)
                }
                Resize::Area => {
                    let (x0, x1) = (
                        (ox as f32 * sx) as usize,
                        (((ox + 1) as f32 * sx).ceil() as usize).min(crop.width),
                    );
                    let (y0, y1) = (
                        (oy as f32 * sy) as usize,
                        (((oy + 1) as f32 * sy).ceil() as usize).min(crop.height),
                    );
                    let mut sum = [0f32; 3];
                    for y in y0..y1.max(y0 + 1) {
                        for x in x0..x1.max(x0 + 1) {
                            let v = to_rgb(yuv_at(x, y)).map(|v| v.clamp(0.0, 255.0));
                            for i in 0..3 {
                                sum[i] += v[i];
                            }
                        }
                    }
                    let count = ((x1.max(x0 + 1) - x0) * (y1.max(y0 + 1) - y0)) as f32;
                    sum.map(|s| s / count)
                }
            };
            let o = oy * p.width + ox;
            for i in 0..3 {
                let v = rgb[i].clamp(0.0, 255.0) * scale[i] + bias[i];
                let index = match p.layout {
                    Layout::Chw => i * n + o,
                    Layout::Hwc => 3 * o + i,
                };
                out[index] = T::from_f32(v);
            }
        }
    }
}

/// An output element type of [`preprocess`].
pub trait OutElem: Copy {
    fn from_f32(v: f32) -> Self;
}

impl OutElem for f32 {
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl OutElem for half::f16 {
    fn from_f32(v: f32) -> half::f16 {
        half::f16::from_f32(v)
    }
}

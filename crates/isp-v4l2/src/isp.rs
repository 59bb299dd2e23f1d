//! The CPU ISP: YUV to RGB with BT.601 or BT.709 in limited or full range, crop, resize
//! (swscale's bilinear or area filters) and mean/std normalisation, fused into one pass from the
//! camera frame to the model's input tensor (f32 or f16, CHW or HWC). No full-resolution RGB
//! image is ever made: each channel is filtered on its own plane, separably (the source rows an
//! output row needs, vertically, into one row per channel; then horizontally per output pixel),
//! and converted once per output pixel.
//!
//! Resizes follow ffmpeg's swscale (`libswscale/utils.c`, `initFilter`, FFmpeg 5.1) so the
//! output agrees with `scale=flags=bilinear|area+accurate_rnd+full_chroma_int` within 1 LSB on
//! 8-bit output (`tests/ffmpeg_agreement.rs`): the same 16.16 step and window placement, the same
//! weights, taps past the edge folded onto the edge sample, weights normalised per output (in
//! float where swscale uses 14-bit integers with error diffusion, and without swscale's
//! trimming of windows' near-zero ends, both well under 1 LSB), chroma at its own resolution
//! with swscale's default centre siting (chroma sample `j` at luma position `2j + 0.5`).
//!
//! This is the reference the WGSL pass ([`crate::gpu`]) is tested against.

use crate::Error;
use crate::PixelFormat;
use crate::format::FrameDesc;

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

/// How the image is scaled to the output size: swscale's filters of the same names (pixel
/// centres aligned, each channel filtered at its own plane's resolution, edges clamped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Resize {
    /// swscale's `SWS_BILINEAR`: a tent filter. Enlarging, it is textbook bilinear (two source
    /// pixels per axis). Shrinking, it is area-aware like swscale's and PIL's: the tent spans one
    /// *output* pixel each side (weight `1 - d * dst / src` at source distance `d`), so every
    /// source pixel contributes and fine detail does not alias.
    #[default]
    Bilinear,
    /// swscale's `SWS_AREA`: shrinking, each source pixel weighs by how much of it the output
    /// pixel's box covers (`clamp(0.5 + src / dst / 2 - d, 0, 1)`); enlarging, 2-tap linear
    /// interpolation (what swscale does).
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

/// The largest image side SmolVLM's processor resizes to (transformers' `MAX_IMAGE_SIZE`);
/// [`TileGrid::idefics3`] refuses a longer edge.
pub const MAX_SPLIT_EDGE: usize = 4096;

/// How SmolVLM's image processor (transformers' `Idefics3ImageProcessor`, image splitting on)
/// cuts an image into square tiles for the vision encoder: `rows x cols` tiles in row-major
/// order, then the whole image as a global view. `rows == cols == 0` when the image is not
/// split (one global view only).
///
/// The processor resizes the image twice and then crops; here each tile is the region of the
/// source those steps map to it ([`TileGrid::crops`]), resampled once from the frame by the
/// ISP, so no resized copy of the frame is ever made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileGrid {
    pub rows: usize,
    pub cols: usize,
}

impl TileGrid {
    /// The grid the processor gives a `width x height` image with `size.longest_edge =
    /// longest_edge` and `max_image_size.longest_edge = tile` (SmolVLM: 2048 and 512, so up to
    /// 4 x 4 tiles), step by step as `Idefics3ImageProcessor` computes it:
    /// 1. the longest side is resized to `longest_edge` (up or down), the other side
    ///    `int(longest_edge / aspect)`, rounded up to even (`_resize_output_size_rescale_to_max_len`);
    /// 2. both sides are rounded up to whole tiles, the shorter one from the aspect ratio of
    ///    step 1 (`resize_for_vision_encoder`);
    /// 3. a result larger than one tile is split into `ceil(h / tile) x ceil(w / tile)` tiles
    ///    (`split_image`).
    ///
    /// # Errors
    /// [`Error::BadFrame`] for an empty image, a zero tile or a `longest_edge` over
    /// [`MAX_SPLIT_EDGE`].
    pub fn idefics3(
        width: usize,
        height: usize,
        longest_edge: usize,
        tile: usize,
    ) -> Result<TileGrid, Error> {
        if width == 0 || height == 0 || tile == 0 || longest_edge == 0 {
            return Err(Error::BadFrame {
                what: format!(
                    "splitting a {width}x{height} image into {tile}-pixel tiles at longest edge \
                     {longest_edge}: every size must be non-zero"
                ),
            });
        }
        if longest_edge > MAX_SPLIT_EDGE {
            return Err(Error::BadFrame {
                what: format!(
                    "longest edge {longest_edge} for image splitting: SmolVLM's processor takes \
                     at most {MAX_SPLIT_EDGE}"
                ),
            });
        }
        // Python's `int(a / b)` on positive floats truncates, as `as usize` does.
        let (w, h) = (width as f64, height as f64);
        let aspect = w / h;
        let (w1, h1) = if width >= height {
            let h1 = ((longest_edge as f64 / aspect) as usize).max(1);
            (longest_edge, h1 + h1 % 2)
        } else {
            let w1 = ((longest_edge as f64 * aspect) as usize).max(1);
            (w1 + w1 % 2, longest_edge)
        };
        let aspect = w1 as f64 / h1 as f64;
        let up = |v: usize| v.div_ceil(tile) * tile;
        let (w2, h2) = if w1 >= h1 {
            let w2 = up(w1);
            (w2, up((w2 as f64 / aspect) as usize))
        } else {
            let h2 = up(h1);
            (up((h2 as f64 * aspect) as usize), h2)
        };
        Ok(if w2 > tile || h2 > tile {
            TileGrid {
                rows: h2 / tile,
                cols: w2 / tile,
            }
        } else {
            TileGrid { rows: 0, cols: 0 }
        })
    }

    /// Tiles, not counting the global view.
    pub fn tiles(&self) -> usize {
        self.rows * self.cols
    }

    /// Images the encoder takes: the tiles, then the global view.
    pub fn images(&self) -> usize {
        self.tiles() + 1
    }

    /// The source rectangles of the tiles (row-major) and last the global view (`whole`), for
    /// an image that covers `whole` of its frame. Tile `(r, c)` covers columns
    /// `x + c * width / cols .. x + (c + 1) * width / cols` and the rows likewise, the source
    /// region the processor's resized tile shows, to the source pixel. Empty tiles (a grid
    /// finer than the frame) are refused by [`Preprocess::checked_crop`] when a pass uses
    /// them.
    pub fn crops(&self, whole: Crop) -> Vec<Crop> {
        let edge = |start: usize, len: usize, i: usize, n: usize| start + i * len / n;
        let mut out = Vec::with_capacity(self.images());
        for r in 0..self.rows {
            let (y0, y1) = (
                edge(whole.y, whole.height, r, self.rows),
                edge(whole.y, whole.height, r + 1, self.rows),
            );
            for c in 0..self.cols {
                let (x0, x1) = (
                    edge(whole.x, whole.width, c, self.cols),
                    edge(whole.x, whole.width, c + 1, self.cols),
                );
                out.push(Crop {
                    x: x0,
                    y: y0,
                    width: x1 - x0,
                    height: y1 - y0,
                });
            }
        }
        out.push(whole);
        out
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

/// Converts a whole YUV frame to 8-bit RGB at its own size, rounding to nearest and clamping;
/// chroma is taken from the block that holds each pixel (swscale's `neighbor` path, checked in
/// `tests/ffmpeg_agreement.rs`). A quick look at the frame, not the model's input: [`preprocess`]
/// interpolates subsampled chroma (centre-sited, as swscale's bilinear and area filters do), so
/// on 4:2:0 and 4:2:2 frames the two differ slightly at chroma edges; on 4:4:4 and at the same
/// size they agree within rounding.
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

/// How swscale's `initFilter` shapes one axis's filter (`libswscale/utils.c`, FFmpeg 5.1), for
/// [`Resize::Bilinear`] or [`Resize::Area`] from `src` samples to `dst`. The CPU pass turns it
/// into tap lists ([`Taps`]); the WGSL pass gets the same numbers in its uniform block and
/// recomputes each output's window in the shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Axis {
    resize: Resize,
    src: usize,
    dst: usize,
    /// Source samples per output sample in 16.16 fixed point, rounded as swscale rounds it:
    /// `((src << 16) + dst / 2) / dst`.
    pub(crate) inc: i64,
    /// Taps in each output's window (swscale's `filterSize`, before its trimming).
    pub(crate) size: usize,
    pub(crate) mode: AxisMode,
}

/// Which of `initFilter`'s three constructions an axis uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum AxisMode {
    /// The windowed filter: `size` taps from `trunc(centre - (size - 2) / 2)`, weights from the
    /// tap's distance to the output's centre (in output pixels when shrinking).
    General = 0,
    /// Area when enlarging: 2-tap linear interpolation (swscale's "bilinear upscale" branch,
    /// with its own 16.16 position arithmetic).
    Linear = 1,
    /// Same size: output `i` is source `i`.
    Unscaled = 2,
}

impl Axis {
    pub(crate) fn new(resize: Resize, src: usize, dst: usize) -> Axis {
        // Sizes are checked against the frame (usize -> i64 cannot overflow for real frames).
        let (s, d) = (src as i64, dst as i64);
        let inc = ((s << 16) + d / 2) / d;
        let (mode, size) = if (inc - 0x10000).abs() < 10 {
            (AxisMode::Unscaled, 1)
        } else if resize == Resize::Area && inc <= 1 << 16 {
            (AxisMode::Linear, 2)
        } else {
            let factor = match resize {
                Resize::Bilinear => 2,
                Resize::Area => 1,
            };
            let size = if inc <= 1 << 16 {
                1 + factor
            } else {
                1 + (factor * src).div_ceil(dst)
            };
            (AxisMode::General, size.min(src.saturating_sub(2)).max(1))
        };
        Axis {
            resize,
            src,
            dst,
            inc,
            size,
            mode,
        }
    }

    /// Output `i`'s window: its first source index (possibly outside `0..src`) and its `size`
    /// unnormalised weights, as `initFilter` computes them before folding the edges.
    fn window(&self, i: usize, w: &mut [f64]) -> i64 {
        let i = i as i64;
        match self.mode {
            AxisMode::Unscaled => {
                w[0] = 1.0;
                i
            }
            AxisMode::Linear => {
                // Centre in 16.16: `((128 * inc) >> 8) - ((128 * 0x8000) >> 7) + i * inc`.
                let pos = (self.inc >> 1) - 0x8000 + i * self.inc;
                let first = pos >> 16;
                for (j, w) in w.iter_mut().enumerate() {
                    let d = ((first + j as i64) * 0x10000 - pos).abs() as f64 / 65536.0;
                    *w = (1.0 - d).max(0.0);
                }
                first
            }
            AxisMode::General => {
                // Centre in 2^-17 source pixels: `(2i + 1) * inc - 0x10000`; C's truncating
                // division (Rust's too) places the window.
                let pos = (2 * i + 1) * self.inc - 0x10000;
                let first = (pos - (self.size as i64 - 2) * 0x10000) / 0x20000;
                let shrink = self.inc > 1 << 16;
                for (j, w) in w.iter_mut().enumerate() {
                    let mut d = ((first + j as i64) * 0x20000 - pos).abs() as f64 / 131072.0;
                    if shrink {
                        d = d * self.dst as f64 / self.src as f64;
                    }
                    *w = match self.resize {
                        Resize::Bilinear => (1.0 - d).max(0.0),
                        Resize::Area => {
                            (0.5 - (d - 0.5) * self.inc as f64 / 65536.0).clamp(0.0, 1.0)
                        }
                    };
                }
                first
            }
        }
    }
}

/// One axis's filter as tap lists: output `i` reads `len` consecutive source samples from
/// `start[i]` with `weights[i * len..][..len]`. Taps outside the source are folded onto the edge
/// sample (swscale's border fix, i.e. a clamped index) and the weights are normalised to sum to
/// one. `len` is padded with zero weights to a multiple of 4 so the dot products vectorise;
/// rows read through it carry `len` samples of padding.
#[derive(Clone, Debug)]
pub(crate) struct Taps {
    start: Vec<usize>,
    weights: Vec<f32>,
    len: usize,
}

impl Taps {
    fn new(axis: &Axis) -> Taps {
        let last = axis.src as i64 - 1;
        let mut raw = vec![0f64; axis.size];
        let mut windows = Vec::with_capacity(axis.dst);
        let mut len = 1;
        for i in 0..axis.dst {
            let first = axis.window(i, &mut raw);
            let lo = first.clamp(0, last);
            let hi = (first + axis.size as i64 - 1).clamp(0, last);
            let mut folded = vec![0f64; (hi - lo + 1) as usize];
            for (j, &w) in raw.iter().enumerate() {
                folded[((first + j as i64).clamp(lo, hi) - lo) as usize] += w;
            }
            // swscale warns on an all-zero window and keeps it (a black sample); so do we.
            let sum: f64 = folded.iter().sum();
            let norm = if sum > 0.0 { 1.0 / sum } else { 1.0 };
            // Zero taps at the window's ends (the tent's feet) would cost a multiply each.
            let lead = folded.iter().take_while(|w| **w == 0.0).count();
            let lead = lead.min(folded.len() - 1);
            let trail = folded[lead..]
                .iter()
                .rev()
                .take_while(|w| **w == 0.0)
                .count();
            let kept = folded.len() - lead - trail.min(folded.len() - lead - 1);
            len = len.max(kept);
            let ws = folded
                .into_iter()
                .skip(lead)
                .take(kept)
                .map(move |w| w * norm);
            windows.push((lo as usize + lead, ws));
        }
        let len = len.next_multiple_of(4);
        let mut start = Vec::with_capacity(axis.dst);
        let mut weights = vec![0f32; axis.dst * len];
        for (i, (lo, ws)) in windows.into_iter().enumerate() {
            start.push(lo);
            for (slot, w) in weights[i * len..].iter_mut().zip(ws) {
                *slot = w as f32;
            }
        }
        Taps {
            start,
            weights,
            len,
        }
    }

    #[inline(always)]
    fn get(&self, i: usize) -> (usize, &[f32]) {
        (self.start[i], &self.weights[i * self.len..][..self.len])
    }
}

/// Chroma subsampling of a format: (horizontal, vertical). RGB24 and 4:4:4 have none.
pub(crate) fn subsampling(format: PixelFormat) -> (bool, bool) {
    match format {
        PixelFormat::Nv12 | PixelFormat::I420 => (true, true),
        PixelFormat::Yuyv | PixelFormat::Yuv422p => (true, false),
        PixelFormat::Yuv444p | PixelFormat::Rgb24 => (false, false),
    }
}

/// The crop rectangle in the chroma plane's own samples: it starts at `floor(x / 2)` and spans
/// `ceil(width / 2)` where chroma is halved (what ffmpeg's `crop` filter does on 4:2:0 input);
/// an odd crop offset therefore keeps the chroma grid of the even offset before it.
pub(crate) fn chroma_crop(format: PixelFormat, crop: Crop) -> Crop {
    let (h, v) = subsampling(format);
    Crop {
        x: if h { crop.x / 2 } else { crop.x },
        y: if v { crop.y / 2 } else { crop.y },
        width: if h {
            crop.width.div_ceil(2)
        } else {
            crop.width
        },
        height: if v {
            crop.height.div_ceil(2)
        } else {
            crop.height
        },
    }
}

/// Where one channel's samples live: sample `(x, y)` of the channel's plane is
/// `bytes[base + y * stride + x * step]`.
#[derive(Clone, Copy, Debug)]
struct Channel {
    base: usize,
    stride: usize,
    step: usize,
}

/// The fused pass: `out` receives `3 * width * height` values in `p.layout`. RGB24 input skips
/// the colour conversion (the matrix and range are then unused).
///
/// Resizing is swscale's (see [`Resize`]): each channel is filtered on its own plane at its own
/// resolution, luma with the luma filters and chroma with filters built for the chroma plane's
/// size (chroma centre-sited, swscale's default), then converted once per output pixel. The
/// filters are separable, so each output row is made by filtering the source rows it needs
/// vertically into one row per channel (contiguous, vectorised), then each output pixel
/// horizontally from those rows: no full-resolution RGB image, no per-pixel 2D window.
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
    let is_rgb = desc.format == PixelFormat::Rgb24;
    let planes = desc.planes();
    let chan = |base, stride, step| Channel { base, stride, step };
    let (s0, w2) = (planes[0].stride, 2 * desc.width);
    let channels = match desc.format {
        PixelFormat::Nv12 => [
            chan(0, s0, 1),
            chan(planes[1].offset, planes[1].stride, 2),
            chan(planes[1].offset + 1, planes[1].stride, 2),
        ],
        PixelFormat::I420 | PixelFormat::Yuv422p | PixelFormat::Yuv444p => [
            chan(0, s0, 1),
            chan(planes[1].offset, planes[1].stride, 1),
            chan(planes[2].offset, planes[2].stride, 1),
        ],
        PixelFormat::Yuyv => [chan(0, w2, 2), chan(1, w2, 4), chan(3, w2, 4)],
        PixelFormat::Rgb24 => [chan(0, s0, 3), chan(1, s0, 3), chan(2, s0, 3)],
    };
    let cc = chroma_crop(desc.format, crop);
    let luma = (
        Taps::new(&Axis::new(p.resize, crop.width, p.width)),
        Taps::new(&Axis::new(p.resize, crop.height, p.height)),
    );
    let chroma = (
        Taps::new(&Axis::new(p.resize, cc.width, p.width)),
        Taps::new(&Axis::new(p.resize, cc.height, p.height)),
    );
    let scale: [f32; 3] = std::array::from_fn(|i| 1.0 / (255.0 * p.std[i]));
    let bias: [f32; 3] = std::array::from_fn(|i| -p.mean[i] / p.std[i]);
    let rect = |i: usize| if i == 0 { crop } else { cc };
    let taps_x = |i: usize| if i == 0 { &luma.0 } else { &chroma.0 };
    let taps_y = |i: usize| if i == 0 { &luma.1 } else { &chroma.1 };
    // Each channel's vertically filtered row, padded by its horizontal tap count so every dot
    // product reads whole windows; then its horizontally filtered output row.
    let mut rows: [Vec<f32>; 3] =
        std::array::from_fn(|i| vec![0f32; rect(i).width + taps_x(i).len]);
    let mut filtered: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; p.width]);
    // NV12's chroma is filtered as one interleaved U/V row (contiguous, so it vectorises like
    // luma) and split afterwards.
    let nv12 = desc.format == PixelFormat::Nv12;
    let mut pair = vec![0f32; if nv12 { 2 * cc.width } else { 0 }];
    for oy in 0..p.height {
        for (i, row) in rows.iter_mut().enumerate() {
            if nv12 && i > 0 {
                continue;
            }
            let (ch, r) = (&channels[i], rect(i));
            let (y0, wy) = taps_y(i).get(oy);
            let base = ch.base + (r.y + y0) * ch.stride + r.x * ch.step;
            vertical(bytes, base, ch.stride, ch.step, wy, &mut row[..r.width]);
        }
        if nv12 {
            let ch = &channels[1];
            let (y0, wy) = chroma.1.get(oy);
            let base = ch.base + (cc.y + y0) * ch.stride + cc.x * 2;
            vertical(bytes, base, ch.stride, 1, wy, &mut pair);
            let [_, u, v] = &mut rows;
            for ((uv, u), v) in pair.chunks_exact(2).zip(u.iter_mut()).zip(v.iter_mut()) {
                (*u, *v) = (uv[0], uv[1]);
            }
        }
        for (i, out) in filtered.iter_mut().enumerate() {
            horizontal(&rows[i], taps_x(i), out);
        }
        let [s0, s1, s2] = &filtered;
        for (ox, ((&a, &b), &d)) in s0.iter().zip(s1).zip(s2).enumerate() {
            let rgb = if is_rgb {
                [a, b, d]
            } else {
                c.rgb_f32([a, b, d])
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
    Ok(())
}

/// Filters source rows vertically into `row`: `row[x] = sum_k wy[k] * bytes[base + k * stride +
/// x * step]`. Zero weights (the padding past a window, whose rows may lie past the plane) are
/// skipped.
#[inline(always)]
fn vertical(bytes: &[u8], base: usize, stride: usize, step: usize, wy: &[f32], row: &mut [f32]) {
    // Monomorphised per sample step so the planar case (step 1) vectorises.
    match step {
        1 => vertical_step::<1>(bytes, base, stride, wy, row),
        2 => vertical_step::<2>(bytes, base, stride, wy, row),
        3 => vertical_step::<3>(bytes, base, stride, wy, row),
        _ => vertical_step::<4>(bytes, base, stride, wy, row),
    }
}

#[inline(always)]
fn vertical_step<const STEP: usize>(
    bytes: &[u8],
    base: usize,
    stride: usize,
    wy: &[f32],
    row: &mut [f32],
) {
    let w = row.len();
    let span = (w - 1) * STEP + 1;
    let mut first = true;
    // Zero weights are skipped; the others are taken two rows at a time, halving the passes
    // over `row`.
    let mut taps = wy.iter().enumerate().filter(|(_, w)| **w != 0.0);
    while let Some((k, &w0)) = taps.next() {
        let a = &bytes[base + k * stride..][..span];
        match taps.next() {
            Some((k1, &w1)) => {
                let b = &bytes[base + k1 * stride..][..span];
                if STEP == 1 {
                    let (a, b) = (&a[..w], &b[..w]);
                    for ((acc, s), t) in row.iter_mut().zip(a).zip(b) {
                        let v = w0 * f32::from(*s) + w1 * f32::from(*t);
                        *acc = if first { v } else { *acc + v };
                    }
                } else {
                    for (x, acc) in row.iter_mut().enumerate() {
                        let v = w0 * f32::from(a[x * STEP]) + w1 * f32::from(b[x * STEP]);
                        *acc = if first { v } else { *acc + v };
                    }
                }
            }
            None => {
                if STEP == 1 {
                    for (acc, s) in row.iter_mut().zip(&a[..w]) {
                        let v = w0 * f32::from(*s);
                        *acc = if first { v } else { *acc + v };
                    }
                } else {
                    for (x, acc) in row.iter_mut().enumerate() {
                        let v = w0 * f32::from(a[x * STEP]);
                        *acc = if first { v } else { *acc + v };
                    }
                }
            }
        }
        first = false;
    }
    if first {
        row.fill(0.0);
    }
}

/// Filters one vertically filtered row horizontally: `out[i] = row[start_i..] . weights_i`.
#[inline(always)]
fn horizontal(row: &[f32], taps: &Taps, out: &mut [f32]) {
    // The tap count is fixed per call; specialising on it unrolls the dot product.
    match taps.len {
        4 => horizontal_n::<4>(row, taps, out),
        8 => horizontal_n::<8>(row, taps, out),
        12 => horizontal_n::<12>(row, taps, out),
        16 => horizontal_n::<16>(row, taps, out),
        _ => {
            for (i, o) in out.iter_mut().enumerate() {
                let (x0, wx) = taps.get(i);
                *o = dot(&row[x0..x0 + wx.len()], wx);
            }
        }
    }
}

#[inline(always)]
fn horizontal_n<const L: usize>(row: &[f32], taps: &Taps, out: &mut [f32]) {
    for ((o, &x0), wx) in out
        .iter_mut()
        .zip(&taps.start)
        .zip(taps.weights.chunks_exact(L))
    {
        *o = dot(&row[x0..x0 + L], wx);
    }
}

/// `a . b` over a multiple of 4 values, four lanes at a time.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 4];
    for (x, y) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
        for k in 0..4 {
            acc[k] += x[k] * y[k];
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The grids transformers 4.57.6's `Idefics3ImageProcessor` (image splitting on) returns
    /// as `rows` and `cols`, for images of these sizes at these `size.longest_edge` and
    /// `max_image_size.longest_edge` (run on zero images of each shape).
    #[test]
    fn the_tile_grid_is_the_idefics3_processors() {
        let cases = [
            (2048, 512, 1920, 1080, 3, 4),
            (2048, 512, 640, 480, 3, 4),
            (2048, 512, 256, 144, 3, 4),
            (2048, 512, 480, 640, 4, 3),
            (2048, 512, 512, 512, 4, 4),
            (2048, 512, 100, 1000, 4, 1),
            (2048, 512, 3000, 20, 1, 4),
            (2048, 512, 1281, 721, 3, 4),
            (512, 128, 1920, 1080, 3, 4),
            (512, 128, 480, 640, 4, 3),
            (512, 128, 100, 1000, 4, 1),
            (1536, 512, 1920, 1080, 2, 3),
            (1536, 512, 640, 480, 3, 3),
            (1536, 512, 512, 512, 3, 3),
            (1536, 512, 100, 1000, 3, 1),
            (1536, 512, 1281, 721, 2, 3),
            (4096, 512, 1920, 1080, 5, 8),
            (4096, 512, 640, 480, 6, 8),
            (4096, 512, 480, 640, 8, 6),
            (4096, 512, 3000, 20, 1, 8),
        ];
        for (longest, tile, w, h, rows, cols) in cases {
            assert_eq!(
                TileGrid::idefics3(w, h, longest, tile).unwrap(),
                TileGrid { rows, cols },
                "{w}x{h} at longest edge {longest}, tiles of {tile}"
            );
        }
        // At most one tile: the global view alone.
        let single = TileGrid::idefics3(1920, 1080, 512, 512).unwrap();
        assert_eq!(single, TileGrid { rows: 0, cols: 0 });
        assert_eq!(single.images(), 1);
        for (w, h, longest, tile) in [(0, 1, 512, 512), (1, 1, 0, 512), (1, 1, 512, 0)] {
            assert!(TileGrid::idefics3(w, h, longest, tile).is_err());
        }
        assert!(TileGrid::idefics3(1920, 1080, MAX_SPLIT_EDGE + 1, 512).is_err());
    }

    /// The tiles cover the image exactly, without overlap, row-major, and the global view
    /// comes last.
    #[test]
    fn tile_crops_partition_the_image() {
        let grid = TileGrid { rows: 3, cols: 4 };
        let whole = Crop {
            x: 10,
            y: 7,
            width: 1901,
            height: 1063,
        };
        let crops = grid.crops(whole);
        assert_eq!(crops.len(), 13);
        assert_eq!(crops[12], whole);
        let mut covered = 0;
        for (i, c) in crops[..12].iter().enumerate() {
            let (r, col) = (i / 4, i % 4);
            if col > 0 {
                let left = crops[i - 1];
                assert_eq!(
                    left.x + left.width,
                    c.x,
                    "tile {i} starts where its left ends"
                );
                assert_eq!(left.y, c.y);
            } else {
                assert_eq!(c.x, whole.x);
            }
            if r > 0 {
                let up = crops[i - 4];
                assert_eq!(
                    up.y + up.height,
                    c.y,
                    "tile {i} starts where the one above ends"
                );
            } else {
                assert_eq!(c.y, whole.y);
            }
            covered += c.width * c.height;
        }
        assert_eq!(covered, whole.width * whole.height);
        assert_eq!(TileGrid { rows: 0, cols: 0 }.crops(whole), [whole]);
    }
}

//! Pixel formats and frame layouts, validated before any byte is read.

use crate::Error;

/// A frame's pixel format. YUV formats are 8-bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PixelFormat {
    /// Y plane, then interleaved UV at half width and height (4:2:0).
    Nv12,
    /// Y, U, V planes; U and V at half width and height (4:2:0, "YU12").
    I420,
    /// Packed Y0 U Y1 V (4:2:2).
    Yuyv,
    /// Y, U, V planes; U and V at half width (4:2:2).
    Yuv422p,
    /// Y, U, V planes at full resolution (4:4:4).
    Yuv444p,
    /// Packed 8-bit R, G, B.
    Rgb24,
}

/// Where a plane lives in a frame buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plane {
    pub offset: usize,
    /// Bytes per row.
    pub stride: usize,
    pub width: usize,
    pub height: usize,
}

/// The largest width or height a frame may have (16K video is 15360 wide).
pub const MAX_DIMENSION: usize = 16384;

/// Size and format of a frame, with its tightly packed plane layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameDesc {
    pub width: usize,
    pub height: usize,
    pub format: PixelFormat,
}

impl FrameDesc {
    /// A validated description: non-zero size within [`MAX_DIMENSION`] on each side, even
    /// dimensions where chroma is subsampled, and a byte size that fits in `usize`.
    pub fn new(width: usize, height: usize, format: PixelFormat) -> Result<FrameDesc, Error> {
        if width == 0 || height == 0 {
            return Err(Error::BadFrame {
                what: format!("zero-sized frame {width}x{height}"),
            });
        }
        if width > MAX_DIMENSION || height > MAX_DIMENSION {
            return Err(Error::BadFrame {
                what: format!(
                    "frame {width}x{height} is larger than {MAX_DIMENSION} pixels on a side \
                     (no camera or clip this crate reads is; the header is corrupt or hostile)"
                ),
            });
        }
        let (even_w, even_h) = match format {
            PixelFormat::Nv12 | PixelFormat::I420 => (true, true),
            PixelFormat::Yuyv | PixelFormat::Yuv422p => (true, false),
            PixelFormat::Yuv444p | PixelFormat::Rgb24 => (false, false),
        };
        if (even_w && !width.is_multiple_of(2)) || (even_h && !height.is_multiple_of(2)) {
            return Err(Error::BadFrame {
                what: format!("{format:?} needs even dimensions, got {width}x{height}"),
            });
        }
        let d = FrameDesc {
            width,
            height,
            format,
        };
        width
            .checked_mul(height)
            .and_then(|n| n.checked_mul(3))
            .ok_or(Error::BadFrame {
                what: format!("frame {width}x{height} is too large"),
            })?;
        let _ = d.byte_len();
        Ok(d)
    }

    /// The planes, in order (one for packed formats).
    pub fn planes(&self) -> Vec<Plane> {
        let (w, h) = (self.width, self.height);
        let plane = |offset, stride, width, height| Plane {
            offset,
            stride,
            width,
            height,
        };
        match self.format {
            PixelFormat::Nv12 => vec![plane(0, w, w, h), plane(w * h, w, w / 2, h / 2)],
            PixelFormat::I420 => {
                let c = (w / 2) * (h / 2);
                vec![
                    plane(0, w, w, h),
                    plane(w * h, w / 2, w / 2, h / 2),
                    plane(w * h + c, w / 2, w / 2, h / 2),
                ]
            }
            PixelFormat::Yuyv => vec![plane(0, 2 * w, w, h)],
            PixelFormat::Yuv422p => {
                let c = (w / 2) * h;
                vec![
                    plane(0, w, w, h),
                    plane(w * h, w / 2, w / 2, h),
                    plane(w * h + c, w / 2, w / 2, h),
                ]
            }
            PixelFormat::Yuv444p => vec![
                plane(0, w, w, h),
                plane(w * h, w, w, h),
                plane(2 * w * h, w, w, h),
            ],
            PixelFormat::Rgb24 => vec![plane(0, 3 * w, w, h)],
        }
    }

    /// Bytes of one frame.
    pub fn byte_len(&self) -> usize {
        let (w, h) = (self.width, self.height);
        match self.format {
            PixelFormat::Nv12 | PixelFormat::I420 => w * h + 2 * (w / 2) * (h / 2),
            PixelFormat::Yuyv | PixelFormat::Yuv422p => 2 * w * h,
            PixelFormat::Yuv444p | PixelFormat::Rgb24 => 3 * w * h,
        }
    }

    /// The Y, U and V samples at pixel `(x, y)` (chroma of the 2x2 or 2x1 block that holds it).
    /// `bytes` must be [`FrameDesc::byte_len`] long; RGB frames are not YUV and return `None`.
    pub fn yuv_at(&self, bytes: &[u8], x: usize, y: usize) -> Option<(u8, u8, u8)> {
        Sampler::new(self).yuv(bytes, x, y)
    }
}

/// Reads YUV samples of one frame layout without recomputing the plane layout per pixel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sampler {
    format: PixelFormat,
    p: [Plane; 3],
}

impl Sampler {
    pub(crate) fn new(desc: &FrameDesc) -> Sampler {
        let planes = desc.planes();
        let empty = Plane {
            offset: 0,
            stride: 0,
            width: 0,
            height: 0,
        };
        Sampler {
            format: desc.format,
            p: std::array::from_fn(|i| planes.get(i).copied().unwrap_or(empty)),
        }
    }

    /// See [`FrameDesc::yuv_at`].
    #[inline(always)]
    pub(crate) fn yuv(&self, bytes: &[u8], x: usize, y: usize) -> Option<(u8, u8, u8)> {
        let p = &self.p;
        Some(match self.format {
            PixelFormat::Nv12 => {
                let c = p[1].offset + (y / 2) * p[1].stride + (x / 2) * 2;
                (bytes[y * p[0].stride + x], bytes[c], bytes[c + 1])
            }
            PixelFormat::I420 | PixelFormat::Yuv422p | PixelFormat::Yuv444p => {
                let (cx, cy) = match self.format {
                    PixelFormat::I420 => (x / 2, y / 2),
                    PixelFormat::Yuv422p => (x / 2, y),
                    _ => (x, y),
                };
                (
                    bytes[y * p[0].stride + x],
                    bytes[p[1].offset + cy * p[1].stride + cx],
                    bytes[p[2].offset + cy * p[2].stride + cx],
                )
            }
            PixelFormat::Yuyv => {
                let row = y * p[0].stride + (x / 2) * 4;
                (bytes[row + (x % 2) * 2], bytes[row + 1], bytes[row + 3])
            }
            PixelFormat::Rgb24 => return None,
        })
    }
}

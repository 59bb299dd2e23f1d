//! Frame sources: one object-safe trait, a synthetic moving test pattern and Y4M files.
//!
//! Every frame lives in a uvm-alloc buffer and carries its format, timestamp, sequence number
//! and the value its source's timeline reaches when the frame is ready, so a consumer waits on
//! the timeline instead of a lock.

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sync_timeline::{CpuTimeline, Timeline};
use uvm_alloc::{Access, Allocator, AllocatorDesc, CopyLedger, StageCopies, UnifiedBuffer};

use crate::Error;
use crate::format::{FrameDesc, PixelFormat};
use crate::pool::{DEFAULT_POOL_FRAMES, FramePool, Lease};

/// One captured or decoded frame.
#[derive(Clone, Debug)]
pub struct Frame {
    pub buffer: Arc<UnifiedBuffer>,
    pub desc: FrameDesc,
    /// Presentation time from the start of the stream.
    pub timestamp: Duration,
    /// 0, 1, 2, ... in source order; a gap means dropped frames.
    pub sequence: u64,
    /// The source timeline's value once this frame is ready (`sequence + 1`).
    pub ready: u64,
    /// The frame's claim on `buffer`: the source refills the buffer only once every clone of
    /// the frame is gone and the device work registered here has finished.
    pub lease: Lease,
}

/// How fast a file or pattern source delivers frames.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pacing {
    /// At the stream's frame rate, in real time.
    RealTime,
    /// As fast as the consumer takes them.
    #[default]
    AsFastAsPossible,
}

/// A source of frames. Object-safe: the pipeline holds `Box<dyn FrameSource>`.
pub trait FrameSource: Send {
    /// The format and size of every frame.
    fn desc(&self) -> FrameDesc;
    /// Frames per second, if the source has a rate.
    fn rate(&self) -> Option<f64>;
    /// The timeline signalled with each frame's `ready` value.
    fn timeline(&self) -> Arc<dyn Timeline>;
    /// The next frame, or `None` at the end of the stream.
    fn next_frame(&mut self) -> Result<Option<Frame>, Error>;
    /// Frames lost before they were delivered (a camera's sequence gaps and error frames); 0
    /// for sources that deliver every frame.
    fn dropped(&self) -> u64 {
        0
    }
    /// Repeats every signal of the source's timeline on `mirror` too (a Vulkan timeline, so
    /// GPU work can wait for a frame in the queue); `false` if the source cannot. Call before
    /// the first frame.
    fn mirror_timeline(&mut self, mirror: Arc<dyn Timeline>) -> bool {
        let _ = mirror;
        false
    }
    /// The next frame before it is written: its buffer, its sequence number and the `ready`
    /// value its timeline reaches once the frame is in the buffer. The next
    /// [`FrameSource::next_frame`] delivers exactly this frame: the same buffer and `ready`
    /// (a camera predicts the sequence number and timestamp, and delivers the driver's). A
    /// consumer may submit device work that reads the buffer and waits for `ready` on the
    /// device (ahead-of-time submission); it must not read the buffer on the CPU before
    /// `ready`. `Ok(None)` when the source cannot say (a camera with every buffer held
    /// downstream) or the stream ends.
    fn announce_next(&mut self) -> Result<Option<Frame>, Error> {
        Ok(None)
    }
}

/// The frame rates a source accepts, in frames per second: from one frame a day to a million
/// a second. Outside it, pacing and timestamps stop meaning anything (a frame due after the end
/// of `Instant`'s range), so a rate from a file or a flag is refused here rather than trusted.
pub const FRAME_RATES: std::ops::RangeInclusive<f64> =
    (1.0 / SLOWEST_FRAME_INTERVAL_S as f64)..=FASTEST_FRAME_RATE as f64;
/// [`FRAME_RATES`]' ends: one frame a day, a million frames a second.
const SLOWEST_FRAME_INTERVAL_S: u32 = 86_400;
const FASTEST_FRAME_RATE: u32 = 1_000_000;

/// [`FRAME_RATES`] in words, for errors.
fn frame_rates_text() -> String {
    format!(
        "the supported frame rates, one frame in {SLOWEST_FRAME_INTERVAL_S} s to \
         {FASTEST_FRAME_RATE} frames per second"
    )
}

fn check_frame_rate(rate: f64) -> Result<(), Error> {
    if FRAME_RATES.contains(&rate) {
        Ok(())
    } else {
        Err(Error::BadFrame {
            what: format!("frame rate {rate} is outside {}", frame_rates_text()),
        })
    }
}

/// A pool of [`DEFAULT_POOL_FRAMES`] buffers of `bytes` from the default allocator.
fn default_pool(bytes: usize) -> Result<FramePool, Error> {
    let allocator = Allocator::new(AllocatorDesc::default()).map_err(Error::Memory)?;
    Ok(FramePool::new(allocator, bytes, DEFAULT_POOL_FRAMES))
}

/// Shared bookkeeping of paced, timeline-signalling sources.
#[derive(Debug)]
struct Clock {
    pacing: Pacing,
    rate: f64,
    start: Option<Instant>,
    cpu: Arc<CpuTimeline>,
    /// The source's timeline: `cpu`, or once mirrored ([`FrameSource::mirror_timeline`]) a
    /// fan-out that signals the mirrors first and `cpu` last.
    timeline: Arc<dyn Timeline>,
    mirrors: Vec<Arc<dyn Timeline>>,
    /// The sequence number of the next frame.
    next: u64,
    /// The buffer of the frame announced and not yet delivered.
    announced: Option<(Arc<UnifiedBuffer>, Lease)>,
}

impl Clock {
    fn new(pacing: Pacing, rate: f64) -> Clock {
        let cpu = Arc::new(CpuTimeline::new(0));
        Clock {
            pacing,
            rate,
            start: None,
            cpu: Arc::clone(&cpu),
            timeline: cpu,
            mirrors: Vec::new(),
            next: 0,
            announced: None,
        }
    }

    /// When frame `sequence` is due after the first. The rate is within [`FRAME_RATES`], so this
    /// only saturates for sequence numbers no stream reaches; it never panics.
    fn timestamp(&self, sequence: u64) -> Duration {
        Duration::try_from_secs_f64(sequence as f64 / self.rate).unwrap_or(Duration::MAX)
    }

    /// Waits until frame `sequence` is due (real-time pacing).
    fn pace(&mut self, sequence: u64) {
        let start = *self.start.get_or_insert_with(Instant::now);
        if self.pacing == Pacing::RealTime {
            let due = start.checked_add(self.timestamp(sequence));
            if let Some(wait) = due.and_then(|due| due.checked_duration_since(Instant::now())) {
                std::thread::sleep(wait);
            }
        }
    }

    /// Waits until frame `sequence` is due (real-time pacing), then publishes it.
    fn publish(&mut self, sequence: u64) -> Result<u64, Error> {
        self.pace(sequence);
        self.timeline
            .signal(sequence + 1)
            .map_err(Error::Timeline)?;
        Ok(sequence + 1)
    }

    /// Repeats every later signal on `mirror` too.
    fn mirror(&mut self, mirror: Arc<dyn Timeline>) {
        self.mirrors.push(mirror);
        self.timeline = Arc::new(sync_timeline::bridge::Fanout {
            primary: Arc::clone(&self.cpu) as Arc<dyn Timeline>,
            mirrors: self.mirrors.clone(),
        });
    }

    /// The buffer for the next frame: the announced one, or a fresh one from `pool`.
    fn buffer(&mut self, pool: &mut FramePool) -> Result<(Arc<UnifiedBuffer>, Lease), Error> {
        match self.announced.take() {
            Some(b) => Ok(b),
            None => pool.take(),
        }
    }

    /// Takes the next frame's buffer from `pool` now and describes the frame it will hold.
    fn announce(&mut self, pool: &mut FramePool, desc: FrameDesc) -> Result<Frame, Error> {
        if self.announced.is_none() {
            self.announced = Some(pool.take()?);
        }
        Ok(self.announced_frame(desc))
    }

    /// The frame `announced` holds (or will), as [`FrameSource::announce_next`] gives it.
    fn announced_frame(&self, desc: FrameDesc) -> Frame {
        let (buffer, lease) = self.announced.clone().expect("a frame is announced");
        Frame {
            buffer,
            desc,
            timestamp: self.timestamp(self.next),
            sequence: self.next,
            ready: self.next + 1,
            lease,
        }
    }

    /// Numbers, paces and announces a filled frame: the one way every source emits a frame.
    fn deliver(
        &mut self,
        (buffer, lease): (Arc<UnifiedBuffer>, Lease),
        desc: FrameDesc,
    ) -> Result<Frame, Error> {
        let sequence = self.next;
        self.next += 1;
        let ready = self.publish(sequence)?;
        Ok(Frame {
            buffer,
            desc,
            timestamp: self.timestamp(sequence),
            sequence,
            ready,
            lease,
        })
    }
}

/// Sources whose next frame exists before it is due (files): `announce_next` reads it into its
/// buffer at once, and `next_frame` delivers (signals) it when it is due, as a camera's capture
/// would land.
trait ReadAhead {
    fn clock(&mut self) -> &mut Clock;
    fn frame_desc(&self) -> FrameDesc;
    /// The next frame, filled into a pool buffer; `None` at the end of the stream.
    fn read_frame(&mut self) -> Result<Option<(Arc<UnifiedBuffer>, Lease)>, Error>;

    fn announce_read_ahead(&mut self) -> Result<Option<Frame>, Error> {
        if self.clock().announced.is_none() {
            let Some(filled) = self.read_frame()? else {
                return Ok(None);
            };
            self.clock().announced = Some(filled);
        }
        let desc = self.frame_desc();
        Ok(Some(self.clock().announced_frame(desc)))
    }

    fn next_read_ahead(&mut self) -> Result<Option<Frame>, Error> {
        let filled = match self.clock().announced.take() {
            Some(filled) => filled,
            None => match self.read_frame()? {
                Some(filled) => filled,
                None => return Ok(None),
            },
        };
        let desc = self.frame_desc();
        Ok(Some(self.clock().deliver(filled, desc)?))
    }
}

/// A synthetic moving test pattern (colour bars sliding over a luma ramp) at any size and rate.
#[derive(Debug)]
pub struct PatternSource {
    desc: FrameDesc,
    pool: FramePool,
    clock: Clock,
    frames: Option<u64>,
}

impl PatternSource {
    /// Allocates frames with `allocator` instead of the default preference (for example only
    /// the backends a GPU stage can import).
    pub fn with_allocator(mut self, allocator: Allocator) -> Self {
        self.pool = FramePool::new(allocator, self.desc.byte_len(), DEFAULT_POOL_FRAMES);
        self
    }

    /// A pattern of `width x height` in `format` at `rate` frames per second; `frames` limits the
    /// stream (`None`: endless).
    pub fn new(
        width: usize,
        height: usize,
        format: PixelFormat,
        rate: f64,
        pacing: Pacing,
        frames: Option<u64>,
    ) -> Result<PatternSource, Error> {
        if format == PixelFormat::Rgb24 {
            return Err(Error::Unsupported {
                what: "RGB24 patterns (the pattern source makes YUV)",
            });
        }
        check_frame_rate(rate)?;
        let desc = FrameDesc::new(width, height, format)?;
        Ok(PatternSource {
            desc,
            pool: default_pool(desc.byte_len())?,
            clock: Clock::new(pacing, rate),
            frames,
        })
    }

    /// The pattern's YUV at pixel `(x, y)` of frame `n`: eight colour bars moving right by
    /// 4 pixels per frame, over a vertical luma ramp.
    pub fn sample(width: usize, height: usize, n: u64, x: usize, y: usize) -> (u8, u8, u8) {
        // BT.601 limited-range bars: white, yellow, cyan, green, magenta, red, blue, black.
        const BARS: [(u8, u8, u8); 8] = [
            (235, 128, 128),
            (210, 16, 146),
            (170, 166, 16),
            (145, 54, 34),
            (106, 202, 222),
            (81, 90, 240),
            (41, 240, 110),
            (16, 128, 128),
        ];
        let shifted = (x + 4 * n as usize) % width;
        let (by, u, v) = BARS[shifted * 8 / width];
        let ramp = (y * 64 / height) as i32 - 32;
        ((i32::from(by) + ramp).clamp(16, 235) as u8, u, v)
    }
}

impl FrameSource for PatternSource {
    fn desc(&self) -> FrameDesc {
        self.desc
    }

    fn rate(&self) -> Option<f64> {
        Some(self.clock.rate)
    }

    fn timeline(&self) -> Arc<dyn Timeline> {
        Arc::clone(&self.clock.timeline)
    }

    fn mirror_timeline(&mut self, mirror: Arc<dyn Timeline>) -> bool {
        self.clock.mirror(mirror);
        true
    }

    fn announce_next(&mut self) -> Result<Option<Frame>, Error> {
        if self.frames.is_some_and(|f| self.clock.next >= f) {
            return Ok(None);
        }
        self.clock.announce(&mut self.pool, self.desc).map(Some)
    }

    fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        if self.frames.is_some_and(|f| self.clock.next >= f) {
            return Ok(None);
        }
        let d = self.desc;
        let (buffer, lease) = self.clock.buffer(&mut self.pool)?;
        // Like a camera, the frame is written when it is due, not before: work queued ahead
        // of it really waits for it.
        self.clock.pace(self.clock.next);
        {
            let mut w = buffer
                .cpu_access(0..d.byte_len(), Access::Write)
                .map_err(Error::Memory)?;
            let bytes = w.bytes_mut().map_err(Error::Memory)?;
            write_pattern(&d, bytes, self.clock.next);
        }
        Ok(Some(self.clock.deliver((buffer, lease), d)?))
    }
}

/// Writes frame `n` of the pattern into `bytes` (laid out per `d`): the same values as
/// [`PatternSource::sample`] at every pixel, built a row at a time (the bars are the same on
/// every row and the ramp changes 64 times down the frame), so a 1080p frame costs a few
/// hundred microseconds instead of a per-pixel evaluation.
fn write_pattern(d: &FrameDesc, bytes: &mut [u8], n: u64) {
    let planes = d.planes();
    let s = |x, y| PatternSource::sample(d.width, d.height, n, x, y);
    match d.format {
        PixelFormat::Yuyv => {
            let mut row = vec![0u8; d.width * 2];
            let mut row_for = None;
            for y in 0..d.height {
                let ramp = y * 64 / d.height;
                if row_for != Some(ramp) {
                    for x in (0..d.width).step_by(2) {
                        let (y0, u, v) = s(x, y);
                        let (y1, _, _) = s(x + 1, y);
                        row[x * 2..x * 2 + 4].copy_from_slice(&[y0, u, y1, v]);
                    }
                    row_for = Some(ramp);
                }
                let o = y * planes[0].stride;
                bytes[o..o + d.width * 2].copy_from_slice(&row);
            }
        }
        _ => {
            let mut row = vec![0u8; d.width];
            let mut row_for = None;
            for y in 0..d.height {
                let ramp = y * 64 / d.height;
                if row_for != Some(ramp) {
                    for (x, b) in row.iter_mut().enumerate() {
                        *b = s(x, y).0;
                    }
                    row_for = Some(ramp);
                }
                let o = y * planes[0].stride;
                bytes[o..o + d.width].copy_from_slice(&row);
            }
            // Chroma depends on x only.
            let (cw, ch) = (planes[1].width, planes[1].height);
            let fx = d.width / cw;
            let chroma: Vec<(u8, u8)> = (0..cw)
                .map(|cx| {
                    let (_, u, v) = s(cx * fx, 0);
                    (u, v)
                })
                .collect();
            for cy in 0..ch {
                if d.format == PixelFormat::Nv12 {
                    let o = planes[1].offset + cy * planes[1].stride;
                    for (cx, &(u, v)) in chroma.iter().enumerate() {
                        bytes[o + cx * 2] = u;
                        bytes[o + cx * 2 + 1] = v;
                    }
                } else {
                    let (ou, ov) = (
                        planes[1].offset + cy * planes[1].stride,
                        planes[2].offset + cy * planes[2].stride,
                    );
                    for (cx, &(u, v)) in chroma.iter().enumerate() {
                        bytes[ou + cx] = u;
                        bytes[ov + cx] = v;
                    }
                }
            }
        }
    }
}

/// Counts the bytes a reader delivers, so a stream that ends inside a frame is told apart from
/// one that ends between frames (the y4m crate reports both as end of file).
struct Counted<R> {
    inner: R,
    count: Arc<std::sync::atomic::AtomicU64>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

/// Frames from a YUV4MPEG2 file (8-bit 4:2:0, 4:2:2 or 4:4:4).
pub struct Y4mSource<R: BufRead + Send> {
    decoder: y4m::Decoder<Counted<R>>,
    consumed: Arc<std::sync::atomic::AtomicU64>,
    /// Bytes consumed when the last whole frame ended.
    frame_end: u64,
    desc: FrameDesc,
    pool: FramePool,
    clock: Clock,
    ledger: Arc<StageCopies>,
}

impl Y4mSource<std::io::BufReader<std::fs::File>> {
    /// Allocates frames with `allocator` instead of the default preference (for example only
    /// the backends a GPU stage can import).
    pub fn with_allocator(mut self, allocator: Allocator) -> Self {
        self.pool = FramePool::new(allocator, self.desc.byte_len(), DEFAULT_POOL_FRAMES);
        self
    }

    /// Opens a Y4M file.
    pub fn open(path: &Path, pacing: Pacing) -> Result<Self, Error> {
        let file = std::fs::File::open(path).map_err(|e| Error::Io {
            what: path.display().to_string(),
            error: e.to_string(),
        })?;
        Y4mSource::new(std::io::BufReader::new(file), pacing)
    }
}

impl<R: BufRead + Send> Y4mSource<R> {
    /// Reads the stream header from `reader`; an unsupported or malformed header is an error.
    pub fn new(reader: R, pacing: Pacing) -> Result<Self, Error> {
        // Frames over the limit are refused before any allocation.
        let limits = y4m::Limits {
            bytes: Y4M_FRAME_LIMIT,
        };
        let consumed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = Counted {
            inner: reader,
            count: Arc::clone(&consumed),
        };
        let decoder = y4m::Decoder::new_with_limits(counted, limits).map_err(y4m_error)?;
        let frame_end = consumed.load(std::sync::atomic::Ordering::Relaxed);
        let format = match decoder.get_colorspace() {
            y4m::Colorspace::C420
            | y4m::Colorspace::C420jpeg
            | y4m::Colorspace::C420paldv
            | y4m::Colorspace::C420mpeg2 => PixelFormat::I420,
            y4m::Colorspace::C422 => PixelFormat::Yuv422p,
            y4m::Colorspace::C444 => PixelFormat::Yuv444p,
            other => {
                return Err(Error::Unsupported {
                    what: unsupported_colorspace(other),
                });
            }
        };
        let desc = FrameDesc::new(decoder.get_width(), decoder.get_height(), format)?;
        let r = decoder.get_framerate();
        // `F0:0` (or any zero term) is the format's "rate unknown".
        let rate = if r.num > 0 && r.den > 0 {
            r.num as f64 / r.den as f64
        } else {
            30.0
        };
        check_frame_rate(rate).map_err(|_| Error::Y4m {
            what: format!(
                "frame rate F{}:{} is outside {}",
                r.num,
                r.den,
                frame_rates_text()
            ),
        })?;
        Ok(Y4mSource {
            decoder,
            consumed,
            frame_end,
            desc,
            pool: default_pool(desc.byte_len())?,
            clock: Clock::new(pacing, rate),
            ledger: CopyLedger::global().stage("y4m-read"),
        })
    }
}

fn unsupported_colorspace(c: y4m::Colorspace) -> &'static str {
    match c {
        y4m::Colorspace::Cmono | y4m::Colorspace::Cmono12 => "Y4M monochrome (no chroma planes)",
        _ => "Y4M with more than 8 bits per sample",
    }
}

/// The largest Y4M frame read (a 16K 4:4:4 frame is 805 MB; 8K 4:2:0 is 50 MB).
const Y4M_FRAME_LIMIT: usize = 256 << 20;

fn y4m_error(e: y4m::Error) -> Error {
    Error::Y4m {
        what: match e {
            // The y4m crate's name for a frame over `Limits::bytes`, refused before allocation.
            y4m::Error::OutOfMemory => format!(
                "the header declares frames larger than the {} MiB limit (a corrupt or hostile \
                 header)",
                Y4M_FRAME_LIMIT >> 20
            ),
            other => format!("{other:?}"),
        },
    }
}

impl<R: BufRead + Send> std::fmt::Debug for Y4mSource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Y4mSource")
            .field("desc", &self.desc)
            .field("sequence", &self.clock.next)
            .finish_non_exhaustive()
    }
}

impl<R: BufRead + Send> FrameSource for Y4mSource<R> {
    fn desc(&self) -> FrameDesc {
        self.desc
    }

    fn rate(&self) -> Option<f64> {
        Some(self.clock.rate)
    }

    fn timeline(&self) -> Arc<dyn Timeline> {
        Arc::clone(&self.clock.timeline)
    }

    fn mirror_timeline(&mut self, mirror: Arc<dyn Timeline>) -> bool {
        self.clock.mirror(mirror);
        true
    }

    fn announce_next(&mut self) -> Result<Option<Frame>, Error> {
        self.announce_read_ahead()
    }

    fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        self.next_read_ahead()
    }
}

impl<R: BufRead + Send> ReadAhead for Y4mSource<R> {
    fn clock(&mut self) -> &mut Clock {
        &mut self.clock
    }

    fn frame_desc(&self) -> FrameDesc {
        self.desc
    }

    /// Reads the next frame of the file into a pool buffer; `None` at the end of the stream.
    fn read_frame(&mut self) -> Result<Option<(Arc<UnifiedBuffer>, Lease)>, Error> {
        let frame = match self.decoder.read_frame() {
            Ok(f) => f,
            Err(y4m::Error::EOF) => {
                let now = self.consumed.load(std::sync::atomic::Ordering::Relaxed);
                if now > self.frame_end {
                    return Err(Error::Y4m {
                        what: format!(
                            "stream truncated inside frame {}: {} bytes after the last whole frame",
                            self.clock.next,
                            now - self.frame_end
                        ),
                    });
                }
                return Ok(None);
            }
            Err(e) => return Err(y4m_error(e)),
        };
        self.frame_end = self.consumed.load(std::sync::atomic::Ordering::Relaxed);
        let d = self.desc;
        let (buffer, lease) = self.pool.take()?;
        {
            let mut w = buffer
                .cpu_access(0..d.byte_len(), Access::Write)
                .map_err(Error::Memory)?;
            let bytes = w.bytes_mut().map_err(Error::Memory)?;
            let planes = d.planes();
            for (plane, src) in planes.iter().zip([
                frame.get_y_plane(),
                frame.get_u_plane(),
                frame.get_v_plane(),
            ]) {
                let len = plane.stride * plane.height;
                if src.len() != len {
                    return Err(Error::BadFrame {
                        what: format!("Y4M plane of {} bytes, expected {len}", src.len()),
                    });
                }
                // The y4m crate decodes into its own buffer: moving the planes into the unified
                // buffer is a copy, and it is counted.
                self.ledger
                    .copy(&mut bytes[plane.offset..plane.offset + len], src)
                    .map_err(Error::Memory)?;
            }
        }
        Ok(Some((buffer, lease)))
    }
}

/// Still images as frames: one file, or every PNG/JPEG in a folder (sorted by name), decoded by
/// the `image` crate to RGB24.
#[derive(Debug)]
pub struct ImageSource {
    paths: Vec<std::path::PathBuf>,
    desc: Option<FrameDesc>,
    pool: FramePool,
    clock: Clock,
    ledger: Arc<StageCopies>,
}

impl ImageSource {
    /// Allocates frames with `allocator` instead of the default preference (for example only
    /// the backends a GPU stage can import).
    pub fn with_allocator(mut self, allocator: Allocator) -> Self {
        self.pool = FramePool::new(allocator, self.desc().byte_len(), DEFAULT_POOL_FRAMES);
        self
    }

    /// A file or a folder of images, delivered at `rate` frames per second.
    pub fn open(path: &Path, rate: f64, pacing: Pacing) -> Result<ImageSource, Error> {
        let io = |e: std::io::Error| Error::Io {
            what: path.display().to_string(),
            error: e.to_string(),
        };
        let paths = if path.is_dir() {
            let mut p: Vec<_> = std::fs::read_dir(path)
                .map_err(io)?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                        matches!(e.to_ascii_lowercase().as_str(), "png" | "jpg" | "jpeg")
                    })
                })
                .collect();
            p.sort();
            if p.is_empty() {
                return Err(Error::Io {
                    what: path.display().to_string(),
                    error: "no PNG or JPEG files".into(),
                });
            }
            p
        } else {
            std::fs::metadata(path).map_err(io)?;
            vec![path.to_owned()]
        };
        check_frame_rate(rate)?;
        let mut source = ImageSource {
            paths,
            desc: None,
            pool: default_pool(0)?,
            clock: Clock::new(pacing, rate),
            ledger: CopyLedger::global().stage("image-decode"),
        };
        // The first image fixes the frame size; later images of another size are an error.
        let first = source.decode(0)?;
        source.desc = Some(FrameDesc::new(
            first.width() as usize,
            first.height() as usize,
            PixelFormat::Rgb24,
        )?);
        source.pool = default_pool(source.desc().byte_len())?;
        Ok(source)
    }

    fn decode(&self, index: usize) -> Result<image::RgbImage, Error> {
        let path = &self.paths[index];
        let io = |e: &dyn std::fmt::Display| Error::Io {
            what: path.display().to_string(),
            error: e.to_string(),
        };
        // The header's size is checked before the decoder allocates: a 1 KB PNG may claim
        // 100000x100000 pixels.
        let mut reader = image::ImageReader::open(path)
            .map_err(|e| io(&e))?
            .with_guessed_format()
            .map_err(|e| io(&e))?;
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(crate::format::MAX_DIMENSION as u32);
        limits.max_image_height = Some(crate::format::MAX_DIMENSION as u32);
        // An RGB8 image at the largest size is 768 MiB; 1 GiB of decoder allocations in all.
        limits.max_alloc = Some(1 << 30);
        reader.limits(limits);
        let img = reader.decode().map_err(|e| match e {
            image::ImageError::Limits(l) => Error::BadFrame {
                what: format!(
                    "{}: the image is larger than this source reads ({l}; at most \
                     {max}x{max} pixels)",
                    path.display(),
                    max = crate::format::MAX_DIMENSION
                ),
            },
            other => io(&other),
        })?;
        Ok(img.into_rgb8())
    }
}

impl FrameSource for ImageSource {
    fn desc(&self) -> FrameDesc {
        self.desc.expect("set in open")
    }

    fn rate(&self) -> Option<f64> {
        Some(self.clock.rate)
    }

    fn timeline(&self) -> Arc<dyn Timeline> {
        Arc::clone(&self.clock.timeline)
    }

    fn mirror_timeline(&mut self, mirror: Arc<dyn Timeline>) -> bool {
        self.clock.mirror(mirror);
        true
    }

    fn announce_next(&mut self) -> Result<Option<Frame>, Error> {
        self.announce_read_ahead()
    }

    fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        self.next_read_ahead()
    }
}

impl ReadAhead for ImageSource {
    fn clock(&mut self) -> &mut Clock {
        &mut self.clock
    }

    fn frame_desc(&self) -> FrameDesc {
        self.desc()
    }

    /// Decodes the next image into a pool buffer; `None` after the last.
    fn read_frame(&mut self) -> Result<Option<(Arc<UnifiedBuffer>, Lease)>, Error> {
        let index = self.clock.next as usize;
        if index >= self.paths.len() {
            return Ok(None);
        }
        let d = self.desc();
        let img = self.decode(index)?;
        if (img.width() as usize, img.height() as usize) != (d.width, d.height) {
            return Err(Error::BadFrame {
                what: format!(
                    "{} is {}x{}, the stream is {}x{}",
                    self.paths[index].display(),
                    img.width(),
                    img.height(),
                    d.width,
                    d.height
                ),
            });
        }
        let (buffer, lease) = self.pool.take()?;
        {
            let mut w = buffer
                .cpu_access(0..d.byte_len(), Access::Write)
                .map_err(Error::Memory)?;
            // The decoder writes its own buffer: moving it into the unified buffer is counted.
            self.ledger
                .copy(w.bytes_mut().map_err(Error::Memory)?, img.as_raw())
                .map_err(Error::Memory)?;
        }
        Ok(Some((buffer, lease)))
    }
}

/// How [`open_source`] opens a source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceOptions {
    /// Pacing for files and patterns (a camera delivers in real time whatever this says).
    pub pacing: Pacing,
    /// The backends file and pattern frames may be allocated from, in order (`None`: every
    /// backend, best first). A chain whose GPU ISP imports only host memory passes memfd and
    /// host here. Camera frames are the driver's dma-bufs whatever this says.
    pub frame_backends: Option<Vec<uvm_alloc::BackendKind>>,
    /// Capture buffers for a camera (2 to [`crate::v4l2::MAX_BUFFERS`]); `None` for the
    /// default.
    pub camera_buffers: Option<u32>,
}

/// Opens a source from a command-line spec:
/// - `pattern:WIDTHxHEIGHT@FPS[:nv12|i420|yuyv]` (NV12 by default),
/// - `file:PATH` for a `.y4m` file, a PNG/JPEG image or a folder of them (images at 1 frame/s),
/// - `camera:/dev/videoN[:WIDTHxHEIGHT[@FPS]]` (V4L2, 1920x1080@30 by default, with
///   `options.camera_buffers` capture buffers, [`crate::v4l2::DEFAULT_BUFFERS`] if unset).
pub fn open_source(spec: &str, options: &SourceOptions) -> Result<Box<dyn FrameSource>, Error> {
    let pacing = options.pacing;
    let allocator = || {
        let mut desc = AllocatorDesc::default();
        if let Some(backends) = &options.frame_backends {
            desc.backends = backends.clone();
        }
        Allocator::new(desc).map_err(Error::Memory)
    };
    let bad = |why: &str| Error::BadFrame {
        what: format!("source `{spec}`: {why}"),
    };
    let (kind, rest) = spec
        .split_once(':')
        .ok_or_else(|| bad("expected pattern:..., file:... or camera:..."))?;
    match kind {
        "pattern" => {
            let (size_rate, format) = match rest.rsplit_once(':') {
                Some((a, f)) => (a, f),
                None => (rest, "nv12"),
            };
            let format = match format {
                "nv12" => PixelFormat::Nv12,
                "i420" => PixelFormat::I420,
                "yuyv" => PixelFormat::Yuyv,
                other => return Err(bad(&format!("unknown pattern format {other}"))),
            };
            let (size, rate) = size_rate.split_once('@').unwrap_or((size_rate, "30"));
            let (w, h) = size
                .split_once('x')
                .ok_or_else(|| bad("size must be WIDTHxHEIGHT"))?;
            let parse = |s: &str| {
                s.parse::<usize>()
                    .map_err(|_| bad("size must be WIDTHxHEIGHT"))
            };
            let rate: f64 = rate.parse().map_err(|_| bad("rate must be a number"))?;
            Ok(Box::new(
                PatternSource::new(parse(w)?, parse(h)?, format, rate, pacing, None)?
                    .with_allocator(allocator()?),
            ))
        }
        "file" => {
            let path = Path::new(rest);
            let ext = path
                .extension()
                .and_then(|e| e.to_str())
                .map(str::to_ascii_lowercase);
            if ext.as_deref() == Some("y4m") {
                Ok(Box::new(
                    Y4mSource::open(path, pacing)?.with_allocator(allocator()?),
                ))
            } else {
                Ok(Box::new(
                    ImageSource::open(path, 1.0, pacing)?.with_allocator(allocator()?),
                ))
            }
        }
        "camera" => {
            let (path, mode) = match rest.split_once(':') {
                Some((p, m)) => (p, Some(m)),
                None => (rest, None),
            };
            let mut config = crate::v4l2::V4l2Config::default();
            if let Some(n) = options.camera_buffers {
                if !(2..=crate::v4l2::MAX_BUFFERS).contains(&n) {
                    return Err(bad(&format!(
                        "{n} capture buffers asked for; a camera takes 2 to {}",
                        crate::v4l2::MAX_BUFFERS
                    )));
                }
                config.buffers = n;
            }
            if let Some(mode) = mode {
                let (size, fps) = mode.split_once('@').unwrap_or((mode, ""));
                let (w, h) = size
                    .split_once('x')
                    .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
                    .ok_or_else(|| bad("camera mode must be WIDTHxHEIGHT[@FPS]"))?;
                (config.width, config.height) = (w, h);
                if !fps.is_empty() {
                    config.fps = Some(fps.parse().map_err(|_| bad("fps must be an integer"))?);
                }
            }
            let _ = pacing; // a camera delivers in real time whatever the pacing asks
            Ok(Box::new(crate::v4l2::V4l2Source::open(
                Path::new(path),
                &config,
            )?))
        }
        other => Err(bad(&format!(
            "unknown source kind {other:?}: use pattern:WxH@FPS, file:PATH or camera:/dev/videoN"
        ))),
    }
}

//! The converted-weight cache: MX matrices saved after their first conversion, so the next load
//! of the same model under the same policy maps them instead of converting again (converting
//! SmolLM2-135M with MSE-searched scales takes seconds; reading the cache, milliseconds).
//!
//! The file is safetensors: each matrix is two `U8` tensors, `NAME.scales` and `NAME.codes`, in
//! mx-quant's tiled layout ([`MxMatrix::tiled_parts`]); `__metadata__` holds the format version,
//! a key naming the source file (path, length, modification time) and the policy, and each
//! matrix's format and shape. A cache whose key differs is stale and ignored (and rewritten); a
//! corrupt one is an error that names the file, never a panic: everything in it is validated
//! like any other untrusted model file.
//!
//! Writing streams: the header is computed from the plan (names, formats, shapes) before any
//! matrix is converted, each matrix is appended as it is converted, and the file is renamed into
//! place only when complete, so an interrupted conversion leaves no half-written cache behind.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use mx_quant::ElemFormat;
use mx_quant::gemv::MxMatrix;

/// Bumped when the layout of the cache changes.
const FORMAT_VERSION: &str = "1";

/// Why the cache could not be used or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    #[error("weight cache {path}: {what}")]
    Io {
        path: PathBuf,
        what: String,
        source: std::io::Error,
    },
    #[error("weight cache {path} is corrupt: {what}; delete it to convert again")]
    Corrupt { path: PathBuf, what: String },
}

/// Identifies what a cache holds: the source file and the policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey(pub String);

impl CacheKey {
    /// The key for `source` converted under `policy` (its full description, not just its name).
    pub fn new(source: &Path, policy: &str) -> std::io::Result<CacheKey> {
        let meta = std::fs::metadata(source)?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let canonical = std::fs::canonicalize(source).unwrap_or_else(|_| source.to_path_buf());
        Ok(CacheKey(format!(
            "{}|{}|{}|{policy}",
            canonical.display(),
            meta.len(),
            mtime
        )))
    }
}

/// Where the cache for a model and policy lives inside `dir`.
pub fn cache_path(dir: &Path, source: &Path, policy_name: &str) -> PathBuf {
    let stem = source
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    let slug: String = policy_name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    dir.join(format!("{stem}.{slug}.mxcache.safetensors"))
}

/// One planned matrix: canonical name, format and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub name: String,
    pub format: ElemFormat,
    pub rows: usize,
    pub cols: usize,
}

/// A cache opened for reading.
#[derive(Debug)]
pub struct MxCache {
    path: PathBuf,
    file: std::fs::File,
    entries: HashMap<String, (ElemFormat, usize, usize)>,
    /// Absolute byte range of every `NAME.scales` / `NAME.codes` tensor.
    ranges: HashMap<String, std::ops::Range<u64>>,
}

impl MxCache {
    /// Opens the cache at `path` if it exists and was made for `key`; `Ok(None)` when it is
    /// missing or stale.
    pub fn open(path: &Path, key: &CacheKey) -> Result<Option<MxCache>, CacheError> {
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(CacheError::Io {
                    path: path.into(),
                    what: "open".into(),
                    source: e,
                });
            }
        };
        let map = map_read_only(&file).map_err(|e| CacheError::Io {
            path: path.into(),
            what: "mmap".into(),
            source: e,
        })?;
        let corrupt = |what: String| CacheError::Corrupt {
            path: path.into(),
            what,
        };
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&map[..])
            .map_err(|e| corrupt(format!("header: {e}")))?;
        let meta = metadata.metadata().clone().unwrap_or_default();
        if meta.get("format_version").map(String::as_str) != Some(FORMAT_VERSION)
            || meta.get("key") != Some(&key.0)
        {
            return Ok(None);
        }
        let listed = meta
            .get("matrices")
            .ok_or_else(|| corrupt("no `matrices` entry in the metadata".into()))?;
        let plan: Vec<(String, String, usize, usize)> =
            serde_json::from_str(listed).map_err(|e| {
                corrupt(format!(
                    "`matrices` is not a list of [name, format, rows, cols]: {e}"
                ))
            })?;
        let mut entries = HashMap::new();
        for (name, format, rows, cols) in plan {
            let format = ElemFormat::from_name(&format)
                .ok_or_else(|| corrupt(format!("{name}: unknown format {format:?}")))?;
            entries.insert(name, (format, rows, cols));
        }
        // Validate the whole layout once (offsets inside the file, no overlap), then keep each
        // tensor's absolute byte range; the mapping is not needed after this.
        safetensors::SafeTensors::deserialize(&map[..])
            .map_err(|e| corrupt(format!("tensor table: {e}")))?;
        let header_len = u64::from_le_bytes(
            map[..8]
                .try_into()
                .map_err(|_| corrupt("shorter than its header length".into()))?,
        );
        let data_start = 8 + header_len;
        let mut ranges = HashMap::new();
        for name in entries.keys() {
            for suffix in ["scales", "codes"] {
                let tensor = format!("{name}.{suffix}");
                let info = metadata
                    .info(&tensor)
                    .ok_or_else(|| corrupt(format!("{tensor} is listed but absent")))?;
                let (begin, end) = info.data_offsets;
                ranges.insert(tensor, data_start + begin as u64..data_start + end as u64);
            }
        }
        Ok(Some(MxCache {
            path: path.into(),
            file,
            entries,
            ranges,
        }))
    }

    /// The matrix `name` if the cache has it with this format and shape.
    pub fn get(
        &self,
        name: &str,
        format: ElemFormat,
        rows: usize,
        cols: usize,
    ) -> Result<Option<MxMatrix>, CacheError> {
        if self.entries.get(name) != Some(&(format, rows, cols)) {
            return Ok(None);
        }
        let corrupt = |what: String| CacheError::Corrupt {
            path: self.path.clone(),
            what,
        };
        // Ranges come from the header, validated at open; the bytes are read with pread straight
        // into the matrix, so they are resident once (not in a mapping and the heap).
        let mut m =
            MxMatrix::zeros(format, rows, cols).map_err(|e| corrupt(format!("{name}: {e}")))?;
        let (scales, codes) = m.tiled_parts_mut();
        for (suffix, dst) in [("scales", scales), ("codes", codes)] {
            let tensor = format!("{name}.{suffix}");
            let range = self
                .ranges
                .get(&tensor)
                .ok_or_else(|| corrupt(format!("{tensor} is listed but absent")))?;
            if range.end - range.start != dst.len() as u64 {
                return Err(corrupt(format!(
                    "{tensor} holds {} bytes, its shape needs {}",
                    range.end - range.start,
                    dst.len()
                )));
            }
            std::os::unix::fs::FileExt::read_exact_at(&self.file, dst, range.start).map_err(
                |source| CacheError::Io {
                    path: self.path.clone(),
                    what: format!("reading {tensor}"),
                    source,
                },
            )?;
        }
        Ok(Some(m))
    }
}

#[allow(unsafe_code)]
fn map_read_only(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the file is opened read-only and its bytes are treated as untrusted (every length
    // and offset is validated before use). Like every file mapping, the contents could change if
    // another process rewrote the file while mapped; the cache is only ever replaced by rename,
    // which leaves this mapping on the old inode.
    unsafe { memmap2::Mmap::map(file) }
}

/// A cache being written, matrix by matrix, in plan order.
#[derive(Debug)]
pub struct CacheWriter {
    path: PathBuf,
    part: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    plan: Vec<Planned>,
    next: usize,
}

impl CacheWriter {
    /// Creates `path.part` and writes the header for `plan`.
    pub fn create(
        path: &Path,
        key: &CacheKey,
        plan: Vec<Planned>,
    ) -> Result<CacheWriter, CacheError> {
        let io = |what: &str| {
            let what = what.to_string();
            let path = path.to_path_buf();
            move |source| CacheError::Io { path, what, source }
        };
        let mut offset = 0usize;
        let mut tensors = serde_json::Map::new();
        let mut listed = Vec::new();
        for p in &plan {
            let (s, c) = MxMatrix::tiled_lengths(p.format, p.rows, p.cols).map_err(|e| {
                CacheError::Corrupt {
                    path: path.into(),
                    what: format!("{}: {e}", p.name),
                }
            })?;
            for (suffix, len) in [("scales", s), ("codes", c)] {
                tensors.insert(
                    format!("{}.{suffix}", p.name),
                    serde_json::json!({"dtype": "U8", "shape": [len], "data_offsets": [offset, offset + len]}),
                );
                offset += len;
            }
            listed.push(serde_json::json!([p.name, p.format.name(), p.rows, p.cols]));
        }
        tensors.insert(
            "__metadata__".into(),
            serde_json::json!({
                "format_version": FORMAT_VERSION,
                "key": key.0,
                "matrices": serde_json::Value::Array(listed).to_string(),
            }),
        );
        let mut header = serde_json::Value::Object(tensors).to_string().into_bytes();
        while !header.len().is_multiple_of(8) {
            header.push(b' ');
        }
        let part = path.with_extension("part");
        let file = std::fs::File::create(&part).map_err(io("create"))?;
        let mut file = std::io::BufWriter::with_capacity(1 << 20, file);
        file.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&header))
            .map_err(io("write header"))?;
        Ok(CacheWriter {
            path: path.into(),
            part,
            file,
            plan,
            next: 0,
        })
    }

    /// Appends the next planned matrix (which must be `name`, in plan order).
    pub fn write(&mut self, name: &str, m: &MxMatrix) -> Result<(), CacheError> {
        let Some(p) = self.plan.get(self.next) else {
            return Err(self.out_of_plan(name));
        };
        if p.name != name || m.format() != p.format || m.shape() != (p.rows, p.cols) {
            return Err(self.out_of_plan(name));
        }
        let (scales, codes) = m.tiled_parts();
        self.file
            .write_all(scales)
            .and_then(|()| self.file.write_all(codes))
            .map_err(|source| CacheError::Io {
                path: self.part.clone(),
                what: "write".into(),
                source,
            })?;
        self.next += 1;
        Ok(())
    }

    fn out_of_plan(&self, name: &str) -> CacheError {
        CacheError::Corrupt {
            path: self.part.clone(),
            what: format!("matrix {name} written out of plan order"),
        }
    }

    /// Flushes and renames the file into place; fails if the plan was not completed.
    pub fn finish(mut self) -> Result<PathBuf, CacheError> {
        if self.next != self.plan.len() {
            let _ = std::fs::remove_file(&self.part);
            return Err(CacheError::Corrupt {
                path: self.part.clone(),
                what: format!(
                    "{} of {} planned matrices written",
                    self.next,
                    self.plan.len()
                ),
            });
        }
        let io = |what: &str, source| CacheError::Io {
            path: self.path.clone(),
            what: what.into(),
            source,
        };
        self.file.flush().map_err(|e| io("flush", e))?;
        std::fs::rename(&self.part, &self.path).map_err(|e| io("rename", e))?;
        Ok(self.path.clone())
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        // An unfinished writer leaves nothing behind (`finish` has renamed the file away).
        let _ = std::fs::remove_file(&self.part);
    }
}

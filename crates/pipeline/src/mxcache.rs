//! The converted-weight cache: MX matrices saved after their first conversion, so the next load
//! of the same model under the same policy maps them instead of converting again (converting
//! SmolLM2-135M with MSE-searched scales takes seconds; reading the cache, milliseconds).
//!
//! The file is safetensors: each matrix is two `U8` tensors, `NAME.scales` and `NAME.codes`, in
//! mx-quant's tiled layout ([`MxMatrix::tiled_parts`]); `__metadata__` holds the format version,
//! a key (the SHA-256 of the source's bytes, and the policy) and each matrix's format and shape.
//! The key is the content, not the path or the modification time: a model rewritten in place
//! with its old mtime, or copied elsewhere, keys correctly. A cache whose key differs is stale
//! and ignored (and rewritten); a corrupt one is an error that names the file, never a panic:
//! everything in it is validated like any other untrusted model file.
//!
//! Writing streams: the header is computed from the plan (names, formats, shapes) before any
//! matrix is converted, each matrix is appended as it is converted, into a temporary file unique
//! to the writer (process id and a counter), which is fsynced and only then renamed into place
//! (the directory fsynced after): an interrupted conversion leaves no half-written cache behind,
//! a crash leaves no renamed-but-empty one, and two processes converting the same model each
//! write their own file, the last rename winning with a complete one.

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

/// Identifies what a cache holds: the source's content and the policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey(pub String);

impl CacheKey {
    /// The key for `source` (a file, or a directory of `*.safetensors` and `config.json`)
    /// converted under `policy` (its full description, not just its name): SHA-256 over the
    /// source's files in name order, each with its name and length.
    pub fn new(source: &Path, policy: &str) -> std::io::Result<CacheKey> {
        use sha2::{Digest, Sha256};
        let files: Vec<PathBuf> = if source.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(source)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.is_file()
                        && (p.extension().is_some_and(|e| e == "safetensors")
                            || p.file_name().is_some_and(|n| n == "config.json"))
                })
                .collect();
            files.sort();
            files
        } else {
            vec![source.to_path_buf()]
        };
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        for path in &files {
            use std::io::Read;
            let mut file = std::fs::File::open(path)?;
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            hash.update(name.unwrap_or_default().as_bytes());
            hash.update(file.metadata()?.len().to_le_bytes());
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                hash.update(&buf[..n]);
            }
        }
        let digest: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(CacheKey(format!("sha256:{digest}|{policy}")))
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
    // and offset is validated before use). The mapping is MAP_SHARED (memmap2's `Mmap::map`), so
    // another process rewriting the file in place would show through it; the cache is only ever
    // replaced by rename, which leaves this mapping on the old inode.
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
        // A name no other writer uses: two processes converting the same model never share a
        // temporary file.
        static WRITERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let part = path.with_extension(format!("part.{}.{n}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&part)
            .map_err(io("create"))?;
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
        // The bytes reach the disk before the name does, so a crash never leaves a complete
        // name over incomplete contents.
        self.file.get_ref().sync_all().map_err(|e| io("fsync", e))?;
        std::fs::rename(&self.part, &self.path).map_err(|e| io("rename", e))?;
        if let Some(dir) = self.path.parent() {
            // Best effort: the rename itself is durable once the directory is.
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.path.clone())
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        // An unfinished writer leaves nothing behind (`finish` has renamed the file away).
        let _ = std::fs::remove_file(&self.part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mxcache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The key follows the bytes: same length and the same mtime but other contents is another
    /// key; the same contents under another name in another place is the same key.
    #[test]
    fn the_key_is_the_content() {
        let dir = temp("key");
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, b"weights-1").unwrap();
        let key_a = CacheKey::new(&a, "p").unwrap();
        let mtime = std::fs::metadata(&a).unwrap().modified().unwrap();
        std::fs::write(&a, b"weights-2").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&a)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_ne!(CacheKey::new(&a, "p").unwrap(), key_a);
        std::fs::create_dir_all(dir.join("elsewhere")).unwrap();
        let c = dir.join("elsewhere").join("a");
        std::fs::write(&c, b"weights-1").unwrap();
        assert_eq!(CacheKey::new(&c, "p").unwrap(), key_a);
        assert_ne!(CacheKey::new(&c, "q").unwrap(), key_a);
        let _ = std::fs::remove_file(b);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writers of the same cache each have their own temporary file.
    #[test]
    fn concurrent_writers_never_share_a_temporary_file() {
        let dir = temp("writers");
        let path = dir.join("m.mxcache.safetensors");
        let key = CacheKey("k".into());
        let first = CacheWriter::create(&path, &key, Vec::new()).unwrap();
        let second = CacheWriter::create(&path, &key, Vec::new()).unwrap();
        assert_ne!(first.part, second.part);
        assert_eq!(first.finish().unwrap(), path);
        assert_eq!(second.finish().unwrap(), path);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! GGUF v2/v3 reader over a memory map, the ggml dequantizers the decoder needs, and a GGUF v3
//! writer ([`write`], for `pipeline quantize`).
//!
//! Besides ggml's tensor types the reader knows `pipeline quantize`'s OCP MX blocks
//! ([`MX_TYPE_BASE`]) and its list of block-rotated tensors ([`BLOCK_ROTATION_KEY`]), whose rows
//! [`TensorSource::read_rows`] returns with the rotation undone.
//!
//! # Format
//! Little-endian throughout: magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata
//! count; then the metadata (`string` key, `u32` value type, value), the tensor infos (`string`
//! name, `u32` n_dims, `u64 ne[n_dims]` innermost first, `u32` ggml type, `u64` offset), padding
//! to `general.alignment` (default 32), and the tensor data, each tensor at its offset from the
//! start of that data section. Strings are a `u64` byte length and UTF-8 bytes.
//!
//! # Invariants
//! - The file is untrusted. [`GgufFile::open`] validates everything before anything is used:
//!   magic, version, every count against the bytes left (so no allocation is sized by a count the
//!   file cannot back), string and array lengths, UTF-8, value types, array nesting (at most
//!   [`MAX_ARRAY_DEPTH`]), dimension count (1 to 4) and values (non-zero, product and byte size in
//!   checked arithmetic), tensor types (known ggml ids, whole blocks per row), alignment (a power
//!   of two), offsets (aligned, data inside the file), duplicate keys and tensor names. A bad
//!   file is a [`LoadError`], never a panic.
//! - After `open`, every [`TensorInfo`]'s byte range lies inside the file, so reading rows only
//!   slices already-validated ranges.
//! - Dequantization is bit-exact with ggml's reference (`dequantize_row_*` in `ggml-quants.c`):
//!   the same f32 operations in the same order, no fused multiply-add.
//!
//! The tensors are [`TensorSource`] under the canonical names of [`super`] (GGUF's names without
//! `.weight`); the metadata builds a [`ModelConfig`] ([`GgufFile::model_config`]) and, in
//! [`super::tokenizer`], the tokenizer.

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, Range};
use std::path::{Path, PathBuf};

use half::{bf16, f16};

use super::{Corruption, LoadError, ModelConfig, RopeStyle, SourceDtype, TensorSource};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array-of-array nesting the reader accepts; deeper is corrupt (and would otherwise let
/// a file drive the parser's recursion).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Weights per block of every 32-weight ggml type.
const QK: usize = 32;
/// `sizeof(block_q8_0)`: f16 d, 32 × i8.
pub(crate) const Q8_0_BYTES: usize = 2 + QK;
/// `sizeof(block_q4_0)`: f16 d, 16 bytes of nibbles.
pub(crate) const Q4_0_BYTES: usize = 2 + QK / 2;
/// `sizeof(block_q4_1)`: f16 d, f16 m, 16 bytes of nibbles.
pub(crate) const Q4_1_BYTES: usize = 4 + QK / 2;
/// `sizeof(block_mxfp4)`: u8 e8m0 exponent, 16 bytes of nibbles.
pub(crate) const MXFP4_BYTES: usize = 1 + QK / 2;
const _: () =
    assert!(Q8_0_BYTES == 34 && Q4_0_BYTES == 18 && Q4_1_BYTES == 20 && MXFP4_BYTES == 17);

/// Initial capacity cap for arrays, so a large-but-backed count grows the vector as elements
/// actually parse rather than reserving it all up front.
const PREALLOC_MAX: usize = 1 << 16;
/// The most metadata array elements a file may hold in all: a one-byte element costs a 32-byte
/// [`Value`] in memory, so without a cap a file of one large array could ask for 32x its size.
/// Real vocabularies (tokens, scores, types, merges of 256k tokens) hold about 1M.
pub const MAX_METADATA_ELEMENTS: u64 = 8 << 20;

/// A metadata value type (`gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValueType {
    /// `GGUF_TYPE_UINT8`.
    U8,
    /// `GGUF_TYPE_INT8`.
    I8,
    /// `GGUF_TYPE_UINT16`.
    U16,
    /// `GGUF_TYPE_INT16`.
    I16,
    /// `GGUF_TYPE_UINT32`.
    U32,
    /// `GGUF_TYPE_INT32`.
    I32,
    /// `GGUF_TYPE_FLOAT32`.
    F32,
    /// `GGUF_TYPE_BOOL`.
    Bool,
    /// `GGUF_TYPE_STRING`.
    String,
    /// `GGUF_TYPE_ARRAY`.
    Array,
    /// `GGUF_TYPE_UINT64`.
    U64,
    /// `GGUF_TYPE_INT64`.
    I64,
    /// `GGUF_TYPE_FLOAT64`.
    F64,
}

impl ValueType {
    /// The type for a `gguf_type` id.
    pub const fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The `gguf_type` id.
    pub const fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// Lower-case name, as in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }

    /// Fewest bytes one value of this type occupies (a string or an array can be empty).
    const fn min_size(self) -> u64 {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f32`.
    F32(f32),
    /// `f64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of one element type (arrays may nest).
    Array(ValueType, Vec<Value>),
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F32(_) => ValueType::F32,
            Self::F64(_) => ValueType::F64,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(..) => ValueType::Array,
        }
    }

    /// Any integer type, as `i128` (which holds every one of them).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// `f32`, or `f64` rounded to `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            // Rounding to nearest is what a converter writing f32 would have done.
            Self::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// An array's elements.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// Type (and, for integers, value) for error messages.
    fn describe(&self) -> String {
        match self {
            Self::Array(t, v) => format!("an array of {} {}", v.len(), t.name()),
            Self::String(_) => "a string".into(),
            Self::F32(v) => format!("f32 {v}"),
            Self::F64(v) => format!("f64 {v}"),
            Self::Bool(v) => format!("bool {v}"),
            other => match other.as_int() {
                Some(i) => format!("{} {i}", other.value_type().name()),
                None => other.value_type().name().into(),
            },
        }
    }
}

/// A ggml tensor type: its id, name, and block geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType {
    id: u32,
    name: &'static str,
    block_size: u64,
    type_size: u64,
}

/// Every ggml type id a GGUF file may hold: (id, name, weights per block, bytes per block), from
/// ggml's `type_traits` (ids 4, 5, 31–33 and 36–38 were removed from ggml and are unknown here).
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
    // `pipeline quantize`'s OCP MX blocks (not ggml types; see MX_TYPE_BASE), in the order of
    // mx_quant::ElemFormat::ALL: the scale byte, then the codes.
    (MX_TYPE_BASE, "MX_FP8_E5M2", 32, 33),
    (MX_TYPE_BASE + 1, "MX_FP8_E4M3", 32, 33),
    (MX_TYPE_BASE + 2, "MX_FP6_E3M2", 32, 25),
    (MX_TYPE_BASE + 3, "MX_FP6_E2M3", 32, 25),
    (MX_TYPE_BASE + 4, "MX_FP4_E2M1", 32, 17),
    (MX_TYPE_BASE + 5, "MX_INT8", 32, 33),
];

/// The first tensor type id of the OCP MX blocks `pipeline quantize` writes: `MX_TYPE_BASE + i`
/// is `mx_quant::ElemFormat::ALL[i]`. ggml's ids are small integers, so these ("MX" in the top
/// bytes) can never collide with one; ggml readers refuse such a file by its type id. Each block
/// is the E8M0 scale byte followed by 32 codes in mx-quant's linear packing (little-endian bit
/// stream), rows of whole blocks back to back. Tensors named in [`BLOCK_ROTATION_KEY`] hold
/// block-rotated rows.
pub const MX_TYPE_BASE: u32 = 0x4D58_0000;

/// Metadata key: an array of the tensor names (GGUF names, `blk.0.attn_q.weight`) whose rows
/// are block-rotated (`mx_quant::hadamard::rotate_weights`).
pub const BLOCK_ROTATION_KEY: &str = "pipeline.quantize.block_rotation";

/// Metadata key: the weight policy a `pipeline quantize` file was made with, the one it loads
/// under when no policy is asked for.
pub const POLICY_KEY: &str = "pipeline.quantize.policy";

/// The GGUF tensor type id of an MX format (see [`MX_TYPE_BASE`]).
pub fn mx_type_id(format: mx_quant::ElemFormat) -> u32 {
    let i = mx_quant::ElemFormat::ALL
        .iter()
        .position(|&f| f == format)
        .expect("ALL lists every format");
    MX_TYPE_BASE + i as u32
}

const _: () = {
    // The table's block sizes are 1 + packed_len(format, 32).
    assert!(mx_quant::layout::packed_len(mx_quant::ElemFormat::Fp8E5M2, 32) + 1 == 33);
    assert!(mx_quant::layout::packed_len(mx_quant::ElemFormat::Fp6E3M2, 32) + 1 == 25);
    assert!(mx_quant::layout::packed_len(mx_quant::ElemFormat::Fp4E2M1, 32) + 1 == 17);
    assert!(mx_quant::layout::packed_len(mx_quant::ElemFormat::Int8, 32) + 1 == 33);
};

impl GgmlType {
    /// `GGML_TYPE_F32`.
    pub const F32: Self = Self::known(0, "F32", 1, 4);
    /// `GGML_TYPE_F16`.
    pub const F16: Self = Self::known(1, "F16", 1, 2);
    /// `GGML_TYPE_Q4_0`.
    pub const Q4_0: Self = Self::known(2, "Q4_0", 32, Q4_0_BYTES as u64);
    /// `GGML_TYPE_Q4_1`.
    pub const Q4_1: Self = Self::known(3, "Q4_1", 32, Q4_1_BYTES as u64);
    /// `GGML_TYPE_Q8_0`.
    pub const Q8_0: Self = Self::known(8, "Q8_0", 32, Q8_0_BYTES as u64);
    /// `GGML_TYPE_BF16`.
    pub const BF16: Self = Self::known(30, "BF16", 1, 2);
    /// `GGML_TYPE_MXFP4`.
    pub const MXFP4: Self = Self::known(39, "MXFP4", 32, MXFP4_BYTES as u64);

    const fn known(id: u32, name: &'static str, block_size: u64, type_size: u64) -> Self {
        Self {
            id,
            name,
            block_size,
            type_size,
        }
    }

    /// The type for a ggml id, if ggml defines it.
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES
            .iter()
            .find(|t| t.0 == id)
            .map(|&(id, name, block_size, type_size)| Self {
                id,
                name,
                block_size,
                type_size,
            })
    }

    /// The ggml id.
    pub const fn id(self) -> u32 {
        self.id
    }

    /// ggml's name (`Q4_1`).
    pub const fn name(self) -> &'static str {
        self.name
    }

    /// Weights per block.
    pub const fn block_size(self) -> u64 {
        self.block_size
    }

    /// Bytes per block.
    pub const fn type_size(self) -> u64 {
        self.type_size
    }

    /// The [`SourceDtype`] this reader dequantizes the type as; `None` for types it cannot read.
    pub const fn source_dtype(self) -> Option<SourceDtype> {
        Some(match self.id {
            0 => SourceDtype::F32,
            1 => SourceDtype::F16,
            2 => SourceDtype::Q4_0,
            3 => SourceDtype::Q4_1,
            8 => SourceDtype::Q8_0,
            30 => SourceDtype::BF16,
            39 => SourceDtype::Mxfp4,
            id if id >= MX_TYPE_BASE && id < MX_TYPE_BASE + 6 => {
                SourceDtype::Mx(mx_quant::ElemFormat::ALL[(id - MX_TYPE_BASE) as usize])
            }
            _ => return None,
        })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// One tensor's description, validated against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name in the file (`blk.0.attn_q.weight`).
    pub name: String,
    /// `ne[]`, innermost (contiguous) dimension first, 1 to 4 entries, each non-zero.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section, as stored.
    pub offset: u64,
    /// Bytes of data.
    pub n_bytes: u64,
    rows: usize,
    cols: usize,
    /// Absolute byte range in the file; inside the file by construction.
    data: Range<usize>,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        // Cannot overflow: checked when the file was opened.
        self.dims.iter().product()
    }

    /// `(rows, cols)`: cols = `ne[0]`, rows = the product of the other dimensions.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Absolute byte range of the data in the file.
    pub fn data_range(&self) -> Range<usize> {
        self.data.clone()
    }
}

/// The file's bytes: mapped, or owned (for in-memory files and tests).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Indices of the tensors [`BLOCK_ROTATION_KEY`] names.
    rotated: std::collections::HashSet<usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("len", &self.bytes.len())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Maps `path` and validates its header, metadata and tensor infos.
    ///
    /// # Errors
    /// [`LoadError::Io`] when the file cannot be read; [`LoadError::NotAModel`],
    /// [`LoadError::UnsupportedVersion`], [`LoadError::Truncated`], [`LoadError::Corrupt`] or
    /// [`LoadError::MetadataType`] (for `general.alignment`) when it is not a valid GGUF file.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let map = super::map_file(path)?;
        Self::parse(path.to_owned(), Bytes::Mapped(map))
    }

    /// Parses a GGUF file held in memory; `path` is only used to name it in errors.
    ///
    /// # Errors
    /// As [`GgufFile::open`], less the I/O errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, LoadError> {
        Self::parse(path.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<Self, LoadError> {
        let header = parse_header(&path, &bytes)?;
        let Header {
            version,
            alignment,
            data_start,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        } = header;
        let mut file = Self {
            path,
            bytes,
            version,
            alignment,
            data_start,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            rotated: Default::default(),
        };
        if let Some(names) = file.opt_str_array(BLOCK_ROTATION_KEY)? {
            let mut rotated = std::collections::HashSet::new();
            for name in names {
                let corrupt = || LoadError::Corrupt {
                    path: file.path.clone(),
                    what: format!("metadata key {BLOCK_ROTATION_KEY}"),
                    offset: 0,
                    problem: Corruption::NotRotatable(name.to_owned()),
                };
                let &i = file.tensor_index.get(name).ok_or_else(corrupt)?;
                if !matches!(
                    file.tensors[i].ggml_type.source_dtype(),
                    Some(SourceDtype::Mx(_))
                ) {
                    return Err(corrupt());
                }
                rotated.insert(i);
            }
            file.rotated = rotated;
        }
        Ok(file)
    }

    /// The weight policy the file was quantized with ([`POLICY_KEY`]), if `pipeline quantize`
    /// made it.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the key is not a string.
    pub fn recorded_policy(&self) -> Result<Option<&str>, LoadError> {
        self.opt_str(POLICY_KEY)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the data section from the start of the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index
            .get(key)
            .and_then(|&i| self.metadata.get(i))
            .map(|(_, v)| v)
    }

    fn missing(&self, key: &str) -> LoadError {
        LoadError::MetadataMissing {
            path: self.path.clone(),
            key: key.to_owned(),
        }
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        conv: impl FnOnce(&'s Value) -> Option<T>,
    ) -> Result<Option<T>, LoadError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        conv(value)
            .map(Some)
            .ok_or_else(|| LoadError::MetadataType {
                path: self.path.clone(),
                key: key.to_owned(),
                expected,
                found: value.describe(),
            })
    }

    /// An integer key that fits `u32`, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not an integer or does not fit.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, LoadError> {
        self.typed(key, "an integer in u32 range", |v| {
            v.as_int().and_then(|i| u32::try_from(i).ok())
        })
    }

    /// An integer key that fits `u32`.
    ///
    /// # Errors
    /// [`LoadError::MetadataMissing`], or as [`GgufFile::opt_u32`].
    pub fn get_u32(&self, key: &str) -> Result<u32, LoadError> {
        self.opt_u32(key)?.ok_or_else(|| self.missing(key))
    }

    /// An integer key that fits `u64`, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not an integer or does not fit.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, LoadError> {
        self.typed(key, "an integer in u64 range", |v| {
            v.as_int().and_then(|i| u64::try_from(i).ok())
        })
    }

    /// An `f32` (or `f64`) key, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not a float.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        self.typed(key, "a float", Value::as_f32)
    }

    /// An `f32` (or `f64`) key.
    ///
    /// # Errors
    /// [`LoadError::MetadataMissing`], or as [`GgufFile::opt_f32`].
    pub fn get_f32(&self, key: &str) -> Result<f32, LoadError> {
        self.opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    /// A bool key, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not a bool.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// A string key, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not a string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, LoadError> {
        self.typed(key, "a string", Value::as_str)
    }

    /// A string key.
    ///
    /// # Errors
    /// [`LoadError::MetadataMissing`], or as [`GgufFile::opt_str`].
    pub fn get_str(&self, key: &str) -> Result<&str, LoadError> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// An array of strings, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not an array of strings.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, LoadError> {
        self.typed(key, "an array of strings", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }

    /// An array of strings.
    ///
    /// # Errors
    /// [`LoadError::MetadataMissing`], or as [`GgufFile::opt_str_array`].
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, LoadError> {
        self.opt_str_array(key)?.ok_or_else(|| self.missing(key))
    }

    /// An array of integers that fit `i32`, if present.
    ///
    /// # Errors
    /// [`LoadError::MetadataType`] when the value is not such an array.
    pub fn opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, LoadError> {
        self.typed(key, "an array of integers in i32 range", |v| {
            v.as_array()?
                .iter()
                .map(|e| e.as_int().and_then(|i| i32::try_from(i).ok()))
                .collect()
        })
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor by its name in the file.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index
            .get(name)
            .and_then(|&i| self.tensors.get(i))
    }

    /// A tensor's bytes, straight from the map.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // The range was checked against this file when it was opened; `get` keeps a TensorInfo
        // from another file from panicking.
        self.bytes.get(info.data.clone()).unwrap_or_default()
    }

    /// A canonical name (`blk.0.attn_q`) resolves to `<name>.weight`, or to `<name>` itself.
    fn resolve(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor(&format!("{name}.weight"))
            .or_else(|| self.tensor(name))
    }

    /// Builds the [`ModelConfig`] from the `llama.*` and `tokenizer.ggml.*` keys.
    ///
    /// `general.architecture` must be `llama`. `head_dim` is `llama.attention.key_length`, else
    /// `llama.rope.dimension_count`, else `embedding_length / head_count`; embeddings are tied
    /// when there is no `output.weight`; RoPE is [`RopeStyle::Interleaved`] (llama.cpp's
    /// converter permutes q/k). `add_bos` is `tokenizer.ggml.add_bos_token`, defaulting to
    /// llama.cpp's default: true for SentencePiece (`llama`) vocabularies, false otherwise.
    ///
    /// # Errors
    /// Missing or mistyped keys, an architecture other than llama, features the decoder does not
    /// implement (RoPE scaling, `rope_freqs`, mixture of experts, partial rotary), or a config
    /// that fails [`ModelConfig::validate`].
    pub fn model_config(&self) -> Result<ModelConfig, LoadError> {
        let arch = self.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(LoadError::MetadataValue {
                path: self.path.clone(),
                key: "general.architecture".into(),
                value: format!("\"{arch}\""),
                supported: "\"llama\"".into(),
            });
        }
        let unsupported = |feature: String| LoadError::Unsupported {
            path: self.path.clone(),
            feature,
        };
        if let Some(kind) = self.opt_str("llama.rope.scaling.type")?
            && kind != "none"
        {
            return Err(unsupported(format!(
                "RoPE scaling \"{kind}\" (llama.rope.scaling.type)"
            )));
        }
        if self.tensor("rope_freqs.weight").is_some() {
            return Err(unsupported(
                "per-dimension RoPE frequency factors (tensor rope_freqs.weight)".into(),
            ));
        }
        if self.opt_u32("llama.expert_count")?.is_some_and(|n| n > 0) {
            return Err(unsupported(
                "mixture of experts (llama.expert_count)".into(),
            ));
        }

        let hidden = self.get_u32("llama.embedding_length")? as usize;
        let heads = self.get_u32("llama.attention.head_count")? as usize;
        let kv_heads = self
            .opt_u32("llama.attention.head_count_kv")?
            .map_or(heads, |v| v as usize);
        let key_length = self.opt_u32("llama.attention.key_length")?;
        let value_length = self.opt_u32("llama.attention.value_length")?;
        let rope_dims = self.opt_u32("llama.rope.dimension_count")?;
        let head_dim = match (key_length, rope_dims) {
            (Some(k), _) | (None, Some(k)) => k as usize,
            (None, None) => hidden.checked_div(heads).unwrap_or(0),
        };
        if let Some(v) = value_length
            && v as usize != head_dim
        {
            return Err(unsupported(format!(
                "value heads of {v} dims but key heads of {head_dim} (llama.attention.value_length)"
            )));
        }
        if let Some(r) = rope_dims
            && r as usize != head_dim
        {
            return Err(unsupported(format!(
                "partial rotary embedding: {r} of {head_dim} dims (llama.rope.dimension_count)"
            )));
        }

        let vocab_size = match self.opt_u32("llama.vocab_size")? {
            Some(v) => v as usize,
            None => match self.opt_str_array("tokenizer.ggml.tokens")? {
                Some(tokens) => tokens.len(),
                None => match self.tensor("token_embd.weight") {
                    Some(t) => t.shape().0,
                    None => return Err(self.missing("llama.vocab_size")),
                },
            },
        };
        let add_bos = match self.opt_bool("tokenizer.ggml.add_bos_token")? {
            Some(b) => b,
            None => self.opt_str("tokenizer.ggml.model")? == Some("llama"),
        };
        let config = ModelConfig {
            vocab_size,
            hidden,
            intermediate: self.get_u32("llama.feed_forward_length")? as usize,
            layers: self.get_u32("llama.block_count")? as usize,
            heads,
            kv_heads,
            head_dim,
            rope_theta: self.opt_f32("llama.rope.freq_base")?.unwrap_or(10_000.0),
            rms_eps: self.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            max_positions: self.get_u32("llama.context_length")? as usize,
            tied_embeddings: self.tensor("output.weight").is_none(),
            rope_style: RopeStyle::Interleaved,
            bos_token_id: self.opt_u32("tokenizer.ggml.bos_token_id")?,
            eos_token_id: self.opt_u32("tokenizer.ggml.eos_token_id")?,
            add_bos,
        };
        config.validate()?;
        Ok(config)
    }
}

impl TensorSource for GgufFile {
    fn shape(&self, name: &str) -> Option<(usize, usize)> {
        self.resolve(name).map(TensorInfo::shape)
    }

    fn dtype(&self, name: &str) -> Option<SourceDtype> {
        self.resolve(name)?.ggml_type.source_dtype()
    }

    fn read_rows(&self, name: &str, rows: Range<usize>, out: &mut [f32]) -> Result<(), LoadError> {
        let info = self.resolve(name).ok_or_else(|| LoadError::TensorMissing {
            tensor: name.to_owned(),
        })?;
        let dtype = info
            .ggml_type
            .source_dtype()
            .ok_or_else(|| LoadError::TensorDtype {
                path: self.path.clone(),
                tensor: info.name.clone(),
                dtype: info.ggml_type.name().to_owned(),
            })?;
        let (n_rows, cols) = info.shape();
        let range_error = || LoadError::RowRange {
            tensor: name.to_owned(),
            start: rows.start,
            end: rows.end,
            rows: n_rows,
        };
        if rows.start > rows.end || rows.end > n_rows {
            return Err(range_error());
        }
        // Cannot overflow: at most the tensor's element count, which fits the file.
        let expected = (rows.end - rows.start) * cols;
        if out.len() != expected {
            return Err(LoadError::OutputLength {
                tensor: name.to_owned(),
                expected,
                found: out.len(),
            });
        }
        let row_bytes = cols / dtype.block_size() * dtype.block_bytes();
        let src = self
            .tensor_data(info)
            .get(rows.start * row_bytes..rows.end * row_bytes)
            .ok_or_else(range_error)?;
        dequantize(dtype, src, out);
        if self.block_rotation(name) {
            mx_quant::hadamard::unrotate_weights(out).expect("rows of whole MX blocks");
        }
        Ok(())
    }

    fn raw(&self, name: &str) -> Option<(SourceDtype, &[u8])> {
        let info = self.resolve(name)?;
        Some((info.ggml_type.source_dtype()?, self.tensor_data(info)))
    }

    fn block_rotation(&self, name: &str) -> bool {
        let index = self
            .tensor_index
            .get(&format!("{name}.weight"))
            .or_else(|| self.tensor_index.get(name));
        index.is_some_and(|i| self.rotated.contains(i))
    }
}

/// Everything [`parse_header`] validates.
struct Header {
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Bounds-checked little-endian reads over the untrusted bytes.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
    /// Metadata array elements read so far (each costs a [`Value`] in memory, whatever its
    /// size in the file), against [`MAX_METADATA_ELEMENTS`].
    elements: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn truncated(&self, what: String, offset: usize, needed: u64) -> LoadError {
        LoadError::Truncated {
            path: self.path.to_owned(),
            what,
            offset: offset as u64,
            needed,
            len: self.bytes.len() as u64,
        }
    }

    fn corrupt(&self, what: String, offset: usize, problem: Corruption) -> LoadError {
        LoadError::Corrupt {
            path: self.path.to_owned(),
            what,
            offset: offset as u64,
            problem,
        }
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], LoadError> {
        let start = self.pos;
        let slice = usize::try_from(n)
            .ok()
            .and_then(|n| start.checked_add(n))
            .and_then(|end| self.bytes.get(start..end));
        match slice {
            Some(s) => {
                self.pos += s.len();
                Ok(s)
            }
            None => Err(self.truncated(what(), start, n)),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], LoadError> {
        let start = self.pos;
        let bytes = self.take(N as u64, what)?;
        <[u8; N]>::try_from(bytes).map_err(|_| self.truncated(what(), start, N as u64))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, LoadError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, LoadError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items each at least `min_size` bytes, bounded by the bytes left.
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<usize, LoadError> {
        let start = self.pos;
        let count = self.u64(what)?;
        let max = self.remaining() / min_size.max(1);
        if count > max {
            return Err(self.corrupt(what(), start, Corruption::CountTooLarge { count, max }));
        }
        // `count <= remaining bytes`, which is a usize.
        usize::try_from(count)
            .map_err(|_| self.corrupt(what(), start, Corruption::CountTooLarge { count, max }))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, LoadError> {
        let start = self.pos;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.corrupt(what(), start, Corruption::InvalidUtf8))
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<Value, LoadError> {
        let what = || format!("value of metadata key `{key}`");
        let start = self.pos;
        let ty = ValueType::from_id(type_id)
            .ok_or_else(|| self.corrupt(what(), start, Corruption::UnknownValueType(type_id)))?;
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(&what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => match self.array::<1>(&what)? {
                [0] => Value::Bool(false),
                [1] => Value::Bool(true),
                [b] => return Err(self.corrupt(what(), start, Corruption::InvalidBool(b))),
            },
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                let elem_id = self.u32(&what)?;
                let elem = ValueType::from_id(elem_id).ok_or_else(|| {
                    self.corrupt(what(), start, Corruption::UnknownValueType(elem_id))
                })?;
                if elem == ValueType::Array && depth + 1 >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt(
                        what(),
                        start,
                        Corruption::NestingTooDeep {
                            max: MAX_ARRAY_DEPTH,
                        },
                    ));
                }
                let count = self.count(elem.min_size(), &what)?;
                self.elements = self.elements.saturating_add(count as u64);
                if self.elements > MAX_METADATA_ELEMENTS {
                    return Err(self.corrupt(
                        what(),
                        start,
                        Corruption::TooManyElements {
                            max: MAX_METADATA_ELEMENTS,
                        },
                    ));
                }
                let mut items = Vec::with_capacity(count.min(PREALLOC_MAX));
                for _ in 0..count {
                    items.push(self.value(elem_id, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// Fewest bytes of a metadata entry: empty key, type, one byte of value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Fewest bytes of a tensor info: empty name, n_dims, one dim, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header, LoadError> {
    let mut c = Cursor {
        path,
        bytes,
        pos: 0,
        elements: 0,
    };
    let magic = c.take(4, &|| "the GGUF magic".into())?;
    if magic != MAGIC {
        return Err(LoadError::NotAModel {
            path: path.to_owned(),
            magic: magic.to_vec(),
        });
    }
    let version = c.u32(&|| "the GGUF version".into())?;
    if !(2..=3).contains(&version) {
        return Err(LoadError::UnsupportedVersion {
            path: path.to_owned(),
            version,
        });
    }
    let tensor_count_at = c.pos;
    let tensor_count = c.u64(&|| "the tensor count".into())?;
    let kv_count = c.count(MIN_KV_BYTES, &|| "the metadata count".into())?;

    let mut metadata = Vec::with_capacity(kv_count.min(PREALLOC_MAX));
    let mut meta_index = HashMap::with_capacity(kv_count.min(PREALLOC_MAX));
    for i in 0..kv_count {
        let start = c.pos;
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let type_id = c.u32(&|| format!("type of metadata key `{key}`"))?;
        let value = c.value(type_id, &key, 0)?;
        if meta_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(c.corrupt(
                format!("metadata key `{key}`"),
                start,
                Corruption::DuplicateKey,
            ));
        }
        metadata.push((key, value));
    }

    let alignment = match meta_index
        .get("general.alignment")
        .and_then(|&i| metadata.get(i))
    {
        None => DEFAULT_ALIGNMENT,
        Some((_, value)) => {
            let alignment = value
                .as_int()
                .and_then(|a| u64::try_from(a).ok())
                .ok_or_else(|| LoadError::MetadataType {
                    path: path.to_owned(),
                    key: "general.alignment".into(),
                    expected: "an unsigned integer",
                    found: value.describe(),
                })?;
            if !alignment.is_power_of_two() {
                return Err(c.corrupt(
                    "metadata key `general.alignment`".into(),
                    c.pos,
                    Corruption::BadAlignment(alignment),
                ));
            }
            alignment
        }
    };

    let max = c.remaining() / MIN_TENSOR_INFO_BYTES;
    let tensor_count = usize::try_from(tensor_count)
        .ok()
        .filter(|&n| n as u64 <= max)
        .ok_or_else(|| {
            c.corrupt(
                "the tensor count".into(),
                tensor_count_at,
                Corruption::CountTooLarge {
                    count: tensor_count,
                    max,
                },
            )
        })?;
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let start = c.pos;
        let name = c.string(&|| format!("name of tensor #{i}"))?;
        let what = || format!("tensor `{name}`");
        let corrupt = |c: &Cursor<'_>, problem| c.corrupt(what(), start, problem);
        let n_dims = c.u32(&what)?;
        if !(1..=4).contains(&n_dims) {
            return Err(corrupt(&c, Corruption::DimCount(n_dims)));
        }
        let mut dims = Vec::with_capacity(4);
        for _ in 0..n_dims {
            let d = c.u64(&what)?;
            if d == 0 {
                return Err(corrupt(&c, Corruption::ZeroDim));
            }
            dims.push(d);
        }
        let type_id = c.u32(&what)?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| corrupt(&c, Corruption::UnknownTensorType(type_id)))?;
        let offset = c.u64(&what)?;

        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| corrupt(&c, Corruption::SizeOverflow))?;
        let ne0 = dims.first().copied().unwrap_or(1);
        if !ne0.is_multiple_of(ggml_type.block_size()) {
            return Err(corrupt(
                &c,
                Corruption::PartialBlock {
                    ne0,
                    block: ggml_type.block_size(),
                },
            ));
        }
        let n_bytes = (elements / ggml_type.block_size())
            .checked_mul(ggml_type.type_size())
            .ok_or_else(|| corrupt(&c, Corruption::SizeOverflow))?;
        if !offset.is_multiple_of(alignment) {
            return Err(corrupt(
                &c,
                Corruption::MisalignedOffset { offset, alignment },
            ));
        }
        let cols = usize::try_from(ne0).map_err(|_| corrupt(&c, Corruption::SizeOverflow))?;
        let rows =
            usize::try_from(elements / ne0).map_err(|_| corrupt(&c, Corruption::SizeOverflow))?;
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(corrupt(&c, Corruption::DuplicateTensor));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
            rows,
            cols,
            data: 0..0,
        });
    }

    let len = bytes.len() as u64;
    let data_start = (c.pos as u64).next_multiple_of(alignment);
    for t in &mut tensors {
        let end = data_start
            .checked_add(t.offset)
            .and_then(|s| Some((s, s.checked_add(t.n_bytes)?)));
        match end {
            Some((s, e)) if e <= len => {
                // Both are at most the file length, which is a usize.
                t.data = s as usize..e as usize;
            }
            // Data that starts inside the file and runs past its end is what a cut-off download
            // looks like; data that starts beyond the end is a corrupt offset.
            Some((s, _)) if s <= len => {
                return Err(LoadError::Truncated {
                    path: path.to_owned(),
                    what: format!("data of tensor `{}`", t.name),
                    offset: s,
                    needed: t.n_bytes,
                    len,
                });
            }
            _ => {
                let end = end.map_or(u64::MAX, |(_, e)| e);
                return Err(LoadError::Corrupt {
                    path: path.to_owned(),
                    what: format!("data of tensor `{}`", t.name),
                    offset: data_start.saturating_add(t.offset),
                    problem: Corruption::OutOfBounds { end, len },
                });
            }
        }
    }
    Ok(Header {
        version,
        alignment,
        data_start,
        metadata,
        meta_index,
        tensors,
        tensor_index,
    })
}

/// ggml's `GGML_E8M0_TO_FP32_HALF`: half of 2^(e − 127), as the exact f32 bit pattern (e < 2
/// gives the subnormals 2^−128 and 2^−127).
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (u32::from(e) - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `kvalues_mxfp4`: the E2M1 values doubled, so that they are integers; the scale is
/// halved ([`e8m0_to_f32_half`]) to compensate.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

fn f16_at(block: &[u8], at: usize) -> f32 {
    match block.get(at..at + 2) {
        Some(&[a, b]) => f16::from_le_bytes([a, b]).to_f32(),
        _ => 0.0,
    }
}

/// Dequantizes whole blocks of `dtype` from `src` into `out`, as ggml's `dequantize_row_*` and
/// `ggml_*_to_fp32_row` do. Callers pass `out.len()` = blocks × block size and `src` = blocks ×
/// block bytes; a shorter side stops the conversion rather than panicking.
pub(crate) fn dequantize(dtype: SourceDtype, src: &[u8], out: &mut [f32]) {
    debug_assert_eq!(
        src.len() / dtype.block_bytes(),
        out.len() / dtype.block_size(),
        "dequantize: source and output disagree on the number of blocks"
    );
    match dtype {
        SourceDtype::F32 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        SourceDtype::F16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        SourceDtype::BF16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        SourceDtype::Q8_0 => {
            for (y, block) in out.chunks_exact_mut(QK).zip(src.chunks_exact(Q8_0_BYTES)) {
                let d = f16_at(block, 0);
                for (y, &q) in y.iter_mut().zip(&block[2..]) {
                    *y = f32::from(q.cast_signed()) * d;
                }
            }
        }
        SourceDtype::Q4_0 => {
            for (y, block) in out.chunks_exact_mut(QK).zip(src.chunks_exact(Q4_0_BYTES)) {
                let d = f16_at(block, 0);
                let (lo, hi) = y.split_at_mut(QK / 2);
                for ((lo, hi), &q) in lo.iter_mut().zip(hi).zip(&block[2..]) {
                    *lo = f32::from(i16::from(q & 0x0F) - 8) * d;
                    *hi = f32::from(i16::from(q >> 4) - 8) * d;
                }
            }
        }
        SourceDtype::Q4_1 => {
            for (y, block) in out.chunks_exact_mut(QK).zip(src.chunks_exact(Q4_1_BYTES)) {
                let d = f16_at(block, 0);
                let m = f16_at(block, 2);
                let (lo, hi) = y.split_at_mut(QK / 2);
                for ((lo, hi), &q) in lo.iter_mut().zip(hi).zip(&block[4..]) {
                    // Two roundings (product, then sum), never fused, as ggml's C does.
                    *lo = f32::from(q & 0x0F) * d + m;
                    *hi = f32::from(q >> 4) * d + m;
                }
            }
        }
        SourceDtype::Mx(format) => {
            let mut codes = [0u8; QK];
            for (y, block) in out
                .chunks_exact_mut(QK)
                .zip(src.chunks_exact(dtype.block_bytes()))
            {
                mx_quant::layout::unpack_codes(format, &block[1..], &mut codes)
                    .expect("a block's packed length");
                y.copy_from_slice(&mx_quant::reference::dequantize_block(
                    format, block[0], &codes,
                ));
            }
        }
        SourceDtype::Mxfp4 => {
            for (y, block) in out.chunks_exact_mut(QK).zip(src.chunks_exact(MXFP4_BYTES)) {
                let d = e8m0_to_f32_half(block[0]);
                let (lo, hi) = y.split_at_mut(QK / 2);
                for ((lo, hi), &q) in lo.iter_mut().zip(hi).zip(&block[1..]) {
                    *lo = f32::from(KVALUES_MXFP4[usize::from(q & 0x0F)]) * d;
                    *hi = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
                }
            }
        }
    }
}

/// A tensor for [`write`]: its GGUF name, `ne[]` (innermost first), type id and data.
#[derive(Clone, Debug)]
pub struct OutTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
}

/// Writes a GGUF v3 file: `metadata` in order (a `general.alignment` entry is dropped: the file
/// uses the default alignment of 32), then `tensors`, each at the next 32-byte boundary. The
/// file appears under `path` only once complete (written beside it, then renamed).
///
/// # Errors
/// I/O errors, named with the path.
pub fn write(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[OutTensor],
) -> Result<(), LoadError> {
    use std::io::Write;
    const ALIGN: u64 = 32;
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(u8::from(*x)),
            Value::String(x) => string(out, x),
            Value::Array(t, items) => {
                out.extend_from_slice(&t.id().to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    value(out, item);
                }
            }
        }
    }
    let metadata: Vec<_> = metadata
        .iter()
        .filter(|(k, _)| k != "general.alignment")
        .collect();
    let mut head = b"GGUF".to_vec();
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, v) in &metadata {
        string(&mut head, key);
        head.extend_from_slice(&v.value_type().id().to_le_bytes());
        value(&mut head, v);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors {
        string(&mut head, &t.name);
        head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&t.type_id.to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len() as u64).next_multiple_of(ALIGN);
    }
    head.resize((head.len() as u64).next_multiple_of(ALIGN) as usize, 0);
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let partial = path.with_extension("gguf.partial");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&partial).map_err(io)?);
    f.write_all(&head).map_err(io)?;
    let mut written = 0u64;
    for (t, off) in tensors.iter().zip(offsets) {
        f.write_all(&vec![0u8; (off - written) as usize])
            .map_err(io)?;
        f.write_all(&t.data).map_err(io)?;
        written = off + t.data.len() as u64;
    }
    f.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    std::fs::rename(&partial, path).map_err(io)
}

/// Builds GGUF files byte by byte, for tests here and in [`super::tokenizer`].
#[cfg(test)]
pub(crate) mod test_writer {
    /// A GGUF file under construction. Tensors are laid out in order, each at the next aligned
    /// offset, and the file ends with the last tensor's last byte.
    pub(crate) struct GgufWriter {
        pub(crate) version: u32,
        alignment: u64,
        kv: Vec<u8>,
        n_kv: u64,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    pub(crate) fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    impl GgufWriter {
        pub(crate) fn new() -> Self {
            Self {
                version: 3,
                alignment: 32,
                kv: Vec::new(),
                n_kv: 0,
                tensors: Vec::new(),
            }
        }

        /// A metadata entry with a raw, already encoded value.
        pub(crate) fn kv_raw(&mut self, key: &str, type_id: u32, value: &[u8]) -> &mut Self {
            string(&mut self.kv, key);
            self.kv.extend_from_slice(&type_id.to_le_bytes());
            self.kv.extend_from_slice(value);
            self.n_kv += 1;
            self
        }

        pub(crate) fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv_raw(key, 4, &v.to_le_bytes())
        }

        pub(crate) fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.kv_raw(key, 6, &v.to_le_bytes())
        }

        pub(crate) fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.kv_raw(key, 7, &[u8::from(v)])
        }

        pub(crate) fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut value = Vec::new();
            string(&mut value, v);
            self.kv_raw(key, 8, &value)
        }

        pub(crate) fn kv_str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut value = 8u32.to_le_bytes().to_vec();
            value.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                string(&mut value, s);
            }
            self.kv_raw(key, 9, &value)
        }

        pub(crate) fn kv_i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let mut value = 5u32.to_le_bytes().to_vec();
            value.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                value.extend_from_slice(&x.to_le_bytes());
            }
            self.kv_raw(key, 9, &value)
        }

        pub(crate) fn alignment(&mut self, a: u32) -> &mut Self {
            self.alignment = u64::from(a);
            self.kv_u32("general.alignment", a)
        }

        pub(crate) fn tensor(
            &mut self,
            name: &str,
            dims: &[u64],
            type_id: u32,
            data: Vec<u8>,
        ) -> &mut Self {
            self.tensors
                .push((name.to_owned(), dims.to_vec(), type_id, data));
            self
        }

        pub(crate) fn finish(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&self.version.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            let mut offset = 0u64;
            let mut offsets = Vec::new();
            for (name, dims, type_id, data) in &self.tensors {
                string(&mut out, name);
                out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&type_id.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                offsets.push(offset);
                offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
            }
            if !self.tensors.is_empty() {
                out.resize(
                    (out.len() as u64).next_multiple_of(self.alignment) as usize,
                    0,
                );
            }
            let data_start = out.len();
            for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
                out.resize(data_start + off as usize, 0);
                out.extend_from_slice(data);
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_writer::GgufWriter;
    use super::*;

    /// xorshift64*: deterministic test data without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn byte(&mut self) -> u8 {
            self.next().to_le_bytes()[0]
        }

        /// A finite f16 in about ±4, as little-endian bytes.
        fn f16_bytes(&mut self) -> [u8; 2] {
            let v = (self.next() % 20_000) as f32 / 2_500.0 - 4.0;
            f16::from_f32(v).to_le_bytes()
        }
    }

    fn parse(bytes: Vec<u8>) -> Result<GgufFile, LoadError> {
        GgufFile::from_bytes("test.gguf", bytes)
    }

    fn corruption(result: Result<GgufFile, LoadError>) -> Corruption {
        match result {
            Err(LoadError::Corrupt { problem, .. }) => problem,
            other => panic!("expected a corrupt-file error, got {other:?}"),
        }
    }

    /// A small valid file with one tensor of each readable type and metadata of every type.
    fn sample() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.kv_str("general.architecture", "llama")
            .kv_raw("u8", 0, &[200])
            .kv_raw("i8", 1, &[0xFF])
            .kv_raw("u16", 2, &500u16.to_le_bytes())
            .kv_raw("i16", 3, &(-500i16).to_le_bytes())
            .kv_u32("u32", 70_000)
            .kv_raw("i32", 5, &(-70_000i32).to_le_bytes())
            .kv_f32("f32", 1.5)
            .kv_bool("bool", true)
            .kv_raw("u64", 10, &(1u64 << 40).to_le_bytes())
            .kv_raw("i64", 11, &(-1i64).to_le_bytes())
            .kv_raw("f64", 12, &0.25f64.to_le_bytes())
            .kv_str_array("strings", &["a", "bc", ""])
            .kv_i32_array("ints", &[1, -2, 3]);
        // An array of two arrays of u8: [[1, 2], []].
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend_from_slice(&2u64.to_le_bytes());
        nested.extend_from_slice(&0u32.to_le_bytes());
        nested.extend_from_slice(&2u64.to_le_bytes());
        nested.extend_from_slice(&[1, 2]);
        nested.extend_from_slice(&0u32.to_le_bytes());
        nested.extend_from_slice(&0u64.to_le_bytes());
        w.kv_raw("nested", 9, &nested);
        let f32s: Vec<u8> = [1.0f32, -2.5, 3.25, 0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        w.tensor("norm.weight", &[4], 0, f32s);
        let mut rng = Rng(7);
        let q8: Vec<u8> = (0..2 * Q8_0_BYTES).map(|_| rng.byte()).collect();
        w.tensor("q8.weight", &[32, 2], 8, q8);
        w
    }

    #[test]
    fn metadata_round_trips_every_type() {
        let file = parse(sample().finish()).expect("valid file");
        assert_eq!(file.version(), 3);
        assert_eq!(file.get("u8"), Some(&Value::U8(200)));
        assert_eq!(file.get("i8"), Some(&Value::I8(-1)));
        assert_eq!(file.get("u16"), Some(&Value::U16(500)));
        assert_eq!(file.get("i16"), Some(&Value::I16(-500)));
        assert_eq!(file.get_u32("u32").expect("u32"), 70_000);
        assert_eq!(file.get("i32"), Some(&Value::I32(-70_000)));
        assert_eq!(file.get_f32("f32").expect("f32"), 1.5);
        assert_eq!(file.opt_bool("bool").expect("bool"), Some(true));
        assert_eq!(file.opt_u64("u64").expect("u64"), Some(1 << 40));
        assert_eq!(file.get("i64"), Some(&Value::I64(-1)));
        assert_eq!(file.get_f32("f64").expect("f64 as f32"), 0.25);
        assert_eq!(
            file.get_str_array("strings").expect("strings"),
            ["a", "bc", ""]
        );
        assert_eq!(
            file.opt_i32_array("ints").expect("ints"),
            Some(vec![1, -2, 3])
        );
        let nested = Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
                Value::Array(ValueType::U8, vec![]),
            ],
        );
        assert_eq!(file.get("nested"), Some(&nested));
        assert_eq!(file.metadata().count(), 15);
        assert_eq!(
            file.metadata().next().map(|(k, _)| k),
            Some("general.architecture")
        );
    }

    #[test]
    fn typed_accessors_reject_wrong_types() {
        let file = parse(sample().finish()).expect("valid file");
        assert!(
            matches!(file.get_u32("u64"), Err(LoadError::MetadataType { .. })),
            "2^40 does not fit u32"
        );
        assert!(
            matches!(file.get_u32("i8"), Err(LoadError::MetadataType { .. })),
            "-1 does not fit u32"
        );
        assert!(matches!(
            file.get_str("u32"),
            Err(LoadError::MetadataType { .. })
        ));
        assert!(matches!(
            file.get_str_array("ints"),
            Err(LoadError::MetadataType { .. })
        ));
        assert!(matches!(
            file.get_f32("u32"),
            Err(LoadError::MetadataType { .. })
        ));
        assert!(matches!(
            file.get_u32("absent"),
            Err(LoadError::MetadataMissing { .. })
        ));
        assert_eq!(file.opt_u32("absent").expect("absent is fine"), None);
        let msg = file.get_u32("u64").expect_err("type").to_string();
        assert!(
            msg.contains("test.gguf") && msg.contains("`u64`") && msg.contains("1099511627776"),
            "{msg}"
        );
    }

    #[test]
    fn tensors_are_described_and_aligned() {
        let file = parse(sample().finish()).expect("valid file");
        let norm = file.tensor("norm.weight").expect("norm");
        assert_eq!(
            (norm.shape(), norm.n_bytes, norm.ggml_type),
            ((1, 4), 16, GgmlType::F32)
        );
        let q8 = file.tensor("q8.weight").expect("q8");
        assert_eq!((q8.shape(), q8.n_bytes, q8.offset), ((2, 32), 68, 32));
        assert_eq!(q8.data_range().start % 32, 0);
        assert_eq!(
            file.shape("norm"),
            Some((1, 4)),
            "canonical name resolves to <name>.weight"
        );
        assert_eq!(
            file.shape("norm.weight"),
            Some((1, 4)),
            "file names resolve too"
        );
        assert_eq!(file.dtype("q8"), Some(SourceDtype::Q8_0));
        let mut row = [0f32; 4];
        file.read_rows("norm", 0..1, &mut row).expect("read");
        assert_eq!(row, [1.0, -2.5, 3.25, 0.0]);
        let (dtype, raw) = file.raw("q8").expect("raw");
        assert_eq!((dtype, raw.len()), (SourceDtype::Q8_0, 68));
    }

    #[test]
    fn read_rows_checks_its_arguments() {
        let file = parse(sample().finish()).expect("valid file");
        let mut out = [0f32; 32];
        assert!(matches!(
            file.read_rows("missing", 0..1, &mut out),
            Err(LoadError::TensorMissing { .. })
        ));
        assert!(matches!(
            file.read_rows("q8", 1..3, &mut out),
            Err(LoadError::RowRange { .. })
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 2..1;
        assert!(matches!(
            file.read_rows("q8", backwards, &mut out),
            Err(LoadError::RowRange { .. })
        ));
        assert!(matches!(
            file.read_rows("q8", 0..2, &mut out),
            Err(LoadError::OutputLength { .. })
        ));
        file.read_rows("q8", 1..2, &mut out).expect("second row");
        file.read_rows("q8", 1..1, &mut []).expect("empty range");
    }

    /// Builds one tensor of `rows` × 64 weights of `dtype` from random blocks, reads it back
    /// through the file, and compares every weight bit-for-bit with `reference`, an f64
    /// computation of the format's definition. The f64 results are exact products (at most 19
    /// significant bits) or exact sums rounded once, so converting them to f32 rounds exactly
    /// as ggml's f32 arithmetic does: the error budget is zero.
    fn check_dequant(
        type_id: u32,
        block_bytes: usize,
        mut block: impl FnMut(&mut Rng) -> Vec<u8>,
        reference: fn(&[u8], usize) -> f64,
    ) {
        let rows = 3;
        let block_size = GgmlType::from_id(type_id).expect("known type").block_size() as usize;
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ u64::from(type_id));
        let data: Vec<u8> = (0..rows * 64 / block_size)
            .flat_map(|_| block(&mut rng))
            .collect();
        let mut w = GgufWriter::new();
        w.tensor("t.weight", &[64, rows as u64], type_id, data.clone());
        let file = parse(w.finish()).expect("valid file");
        let mut out = vec![0f32; rows * 64];
        file.read_rows("t", 0..rows, &mut out).expect("read");
        for (i, y) in out.iter().enumerate() {
            let b = &data[i / block_size * block_bytes..][..block_bytes];
            let want = reference(b, i % block_size) as f32;
            assert_eq!(
                y.to_bits(),
                want.to_bits(),
                "type {type_id} weight {i}: {y} != {want}"
            );
        }
        let mut second = vec![0f32; 64];
        file.read_rows("t", 1..2, &mut second).expect("one row");
        assert_eq!(second, out[64..128]);
    }

    fn f16_of(b: &[u8], at: usize) -> f64 {
        f64::from(f16::from_le_bytes([b[at], b[at + 1]]).to_f32())
    }

    /// The nibble for element `j` of a 32-weight block whose nibbles start at `b[0]`.
    fn nibble(b: &[u8], j: usize) -> u8 {
        if j < 16 { b[j] & 0x0F } else { b[j - 16] >> 4 }
    }

    #[test]
    fn q8_0_matches_its_definition() {
        check_dequant(
            8,
            Q8_0_BYTES,
            |r| {
                r.f16_bytes()
                    .into_iter()
                    .chain((0..32).map(|_| r.byte()))
                    .collect()
            },
            |b, j| f64::from(b[2 + j].cast_signed()) * f16_of(b, 0),
        );
    }

    #[test]
    fn q4_0_matches_its_definition() {
        check_dequant(
            2,
            Q4_0_BYTES,
            |r| {
                r.f16_bytes()
                    .into_iter()
                    .chain((0..16).map(|_| r.byte()))
                    .collect()
            },
            |b, j| (f64::from(nibble(&b[2..], j)) - 8.0) * f16_of(b, 0),
        );
    }

    #[test]
    fn q4_1_matches_its_definition() {
        check_dequant(
            3,
            Q4_1_BYTES,
            |r| {
                let mut b = r.f16_bytes().to_vec();
                b.extend(r.f16_bytes());
                b.extend((0..16).map(|_| r.byte()));
                b
            },
            // q·d is exact in f32; the f64 sum rounded to f32 is ggml's single rounding.
            |b, j| f64::from((f64::from(nibble(&b[4..], j)) * f16_of(b, 0)) as f32) + f16_of(b, 2),
        );
    }

    #[test]
    fn mxfp4_matches_the_ocp_definition() {
        // The OCP MX E2M1 values (not ggml's doubled table): an independent reference.
        const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        check_dequant(
            39,
            MXFP4_BYTES,
            // Exponents 0..=254: 255 is NaN in the MX spec, which ggml does not model.
            |r| {
                std::iter::once(r.byte() % 255)
                    .chain((0..16).map(|_| r.byte()))
                    .collect()
            },
            |b, j| {
                let n = nibble(&b[1..], j);
                let v = E2M1[usize::from(n & 7)] * 2f64.powi(i32::from(b[0]) - 127);
                // ggml's table maps the negative zero (nibble 8) to +0.
                if n & 8 != 0 && v != 0.0 { -v } else { v }
            },
        );
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(254), 2f32.powi(126));
    }

    #[test]
    fn f16_and_bf16_convert_exactly() {
        check_dequant(1, 2, |r| r.f16_bytes().to_vec(), |b, _| f16_of(b, 0));
        check_dequant(
            30,
            2,
            |r| [r.byte(), r.byte() & 0x3F].to_vec(),
            |b, _| {
                f64::from(f32::from_bits(
                    u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
                ))
            },
        );
    }

    #[test]
    fn unreadable_types_are_described_but_not_read() {
        let mut w = GgufWriter::new();
        w.tensor("k.weight", &[256], 12, vec![0; 144]);
        let file = parse(w.finish()).expect("Q4_K parses");
        assert_eq!(
            file.tensor("k.weight").map(|t| t.ggml_type.name()),
            Some("Q4_K")
        );
        assert_eq!(file.dtype("k"), None);
        assert!(file.raw("k").is_none());
        let err = file
            .read_rows("k", 0..1, &mut [0f32; 256])
            .expect_err("Q4_K is not read");
        assert!(matches!(err, LoadError::TensorDtype { .. }), "{err:?}");
        assert!(err.to_string().contains("Q4_K"), "{err}");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().finish();
        parse(bytes.clone()).expect("the whole file is valid");
        for len in 0..bytes.len() {
            let result = parse(bytes[..len].to_vec());
            assert!(result.is_err(), "prefix of {len} bytes parsed");
        }
    }

    #[test]
    fn flipped_bytes_never_panic() {
        let bytes = sample().finish();
        for at in 0..bytes.len() {
            for mask in [0x01, 0x80, 0xFF] {
                let mut corrupt = bytes.clone();
                corrupt[at] ^= mask;
                if let Ok(file) = parse(corrupt) {
                    // Whatever parses must read back without panicking.
                    for t in file.tensors().to_vec() {
                        let (rows, cols) = t.shape();
                        if rows * cols <= 1 << 16 {
                            let mut out = vec![0f32; rows * cols];
                            let _ = file.read_rows(&t.name, 0..rows, &mut out);
                        }
                    }
                }
            }
        }
    }

    /// Overwrites 8 bytes at `at` with `v`.
    fn patch_u64(mut bytes: Vec<u8>, at: usize, v: u64) -> Vec<u8> {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
        bytes
    }

    #[test]
    fn huge_counts_are_rejected_before_allocating() {
        let bytes = sample().finish();
        let tensor_count = corruption(parse(patch_u64(bytes.clone(), 8, u64::MAX)));
        assert!(
            matches!(
                tensor_count,
                Corruption::CountTooLarge {
                    count: u64::MAX,
                    ..
                }
            ),
            "{tensor_count:?}"
        );
        let kv_count = corruption(parse(patch_u64(bytes.clone(), 16, 1 << 60)));
        assert!(
            matches!(kv_count, Corruption::CountTooLarge { .. }),
            "{kv_count:?}"
        );
        // The first key's length.
        let key_len = parse(patch_u64(bytes, 24, u64::MAX - 3));
        assert!(
            matches!(key_len, Err(LoadError::Truncated { .. })),
            "{key_len:?}"
        );

        let mut w = GgufWriter::new();
        let mut huge_array = 8u32.to_le_bytes().to_vec();
        huge_array.extend_from_slice(&(1u64 << 62).to_le_bytes());
        w.kv_raw("tokens", 9, &huge_array);
        assert!(matches!(
            corruption(parse(w.finish())),
            Corruption::CountTooLarge { .. }
        ));
    }

    #[test]
    fn bad_headers_are_named() {
        let bytes = sample().finish();
        let mut magic = bytes.clone();
        magic[0] = b'X';
        assert!(matches!(parse(magic), Err(LoadError::NotAModel { .. })));
        for version in [1, 4, 0x0300_0000] {
            let mut w = sample();
            w.version = version;
            let err = parse(w.finish());
            assert!(
                matches!(err, Err(LoadError::UnsupportedVersion { version: v, .. }) if v == version),
                "{err:?}"
            );
        }
        let mut w = sample();
        w.version = 2;
        parse(w.finish()).expect("version 2 has the same layout");
    }

    #[test]
    fn bad_metadata_is_corrupt() {
        let mut w = GgufWriter::new();
        w.kv_raw("k", 13, &[]);
        assert_eq!(
            corruption(parse(w.finish())),
            Corruption::UnknownValueType(13)
        );

        let mut w = GgufWriter::new();
        w.kv_raw("k", 7, &[2]);
        assert_eq!(corruption(parse(w.finish())), Corruption::InvalidBool(2));

        let mut w = GgufWriter::new();
        w.kv_raw("k", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xFF]);
        assert_eq!(corruption(parse(w.finish())), Corruption::InvalidUtf8);

        let mut w = GgufWriter::new();
        w.kv_u32("k", 1).kv_u32("k", 2);
        assert_eq!(corruption(parse(w.finish())), Corruption::DuplicateKey);

        // Arrays nested past the limit: each level is (type = array, count = 1).
        let mut deep = Vec::new();
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            deep.extend_from_slice(&9u32.to_le_bytes());
            deep.extend_from_slice(&1u64.to_le_bytes());
        }
        let mut w = GgufWriter::new();
        w.kv_raw("k", 9, &deep);
        assert_eq!(
            corruption(parse(w.finish())),
            Corruption::NestingTooDeep {
                max: MAX_ARRAY_DEPTH
            }
        );

        for a in [0, 3, 48] {
            let mut w = GgufWriter::new();
            w.alignment(a);
            assert_eq!(
                corruption(parse(w.finish())),
                Corruption::BadAlignment(a.into())
            );
        }
        let mut w = GgufWriter::new();
        w.kv_str("general.alignment", "32");
        assert!(matches!(
            parse(w.finish()),
            Err(LoadError::MetadataType { .. })
        ));
    }

    #[test]
    fn bad_tensor_infos_are_corrupt() {
        let one = |name: &str, dims: &[u64], type_id: u32, data: Vec<u8>| {
            let mut w = GgufWriter::new();
            w.tensor(name, dims, type_id, data);
            parse(w.finish())
        };
        assert_eq!(
            corruption(one("t", &[], 0, vec![])),
            Corruption::DimCount(0)
        );
        assert_eq!(
            corruption(one("t", &[1, 1, 1, 1, 1], 0, vec![0; 4])),
            Corruption::DimCount(5)
        );
        assert_eq!(
            corruption(one("t", &[4, 0], 0, vec![])),
            Corruption::ZeroDim
        );
        assert_eq!(
            corruption(one("t", &[1 << 32, 1 << 32], 0, vec![])),
            Corruption::SizeOverflow
        );
        assert_eq!(
            corruption(one("t", &[1 << 62], 0, vec![])),
            Corruption::SizeOverflow,
            "bytes overflow"
        );
        assert_eq!(
            corruption(one("t", &[4], 4, vec![])),
            Corruption::UnknownTensorType(4)
        );
        assert_eq!(
            corruption(one("t", &[48], 8, vec![0; 51])),
            Corruption::PartialBlock { ne0: 48, block: 32 }
        );
        let short = one("t", &[1 << 20], 0, vec![0; 4]);
        assert!(
            matches!(
                short,
                Err(LoadError::Truncated {
                    needed: 0x40_0000,
                    ..
                })
            ),
            "{short:?}"
        );

        let mut w = GgufWriter::new();
        w.tensor("t", &[4], 0, vec![0; 16])
            .tensor("t", &[4], 0, vec![0; 16]);
        assert_eq!(corruption(parse(w.finish())), Corruption::DuplicateTensor);

        // The offset field ends the tensor info: header, name "t", n_dims, one dim, type, offset.
        let mut w = GgufWriter::new();
        w.tensor("t", &[4], 0, vec![0; 16]);
        let bytes = w.finish();
        let offset_at = 24 + (8 + 1) + 4 + 8 + 4;
        let problem = corruption(parse(patch_u64(bytes.clone(), offset_at, 8)));
        assert!(
            matches!(
                problem,
                Corruption::MisalignedOffset {
                    offset: 8,
                    alignment: 32
                }
            ),
            "{problem:?}"
        );
        let far = corruption(parse(patch_u64(bytes.clone(), offset_at, 1 << 40)));
        assert!(matches!(far, Corruption::OutOfBounds { .. }), "{far:?}");
        let wrapping = corruption(parse(patch_u64(bytes, offset_at, u64::MAX - 31)));
        assert!(
            matches!(wrapping, Corruption::OutOfBounds { end: u64::MAX, .. }),
            "{wrapping:?}"
        );
    }

    #[test]
    fn errors_name_file_what_and_remedy() {
        let mut w = GgufWriter::new();
        w.tensor("blk.0.attn_q.weight", &[48], 8, vec![0; 51]);
        let msg = parse(w.finish()).expect_err("partial block").to_string();
        assert!(
            msg.contains("test.gguf") && msg.contains("`blk.0.attn_q.weight`"),
            "{msg}"
        );
        assert!(
            msg.contains("block size 32") && msg.contains("converter"),
            "{msg}"
        );
        let bytes = sample().finish();
        let msg = parse(bytes[..bytes.len() - 1].to_vec())
            .expect_err("truncated")
            .to_string();
        assert!(
            msg.contains("q8.weight") && msg.contains("download"),
            "{msg}"
        );
    }

    /// The llama metadata of a tiny model: hidden 8, 2 heads of 4, `kv_heads` KV heads, FFN 16,
    /// 2 layers, vocab 4.
    fn tiny_llama_kv(w: &mut GgufWriter, kv_heads: u32) -> &mut GgufWriter {
        w.kv_str("general.architecture", "llama")
            .kv_u32("llama.embedding_length", 8)
            .kv_u32("llama.attention.head_count", 2)
            .kv_u32("llama.attention.head_count_kv", kv_heads)
            .kv_u32("llama.feed_forward_length", 16)
            .kv_u32("llama.block_count", 2)
            .kv_u32("llama.context_length", 128)
            .kv_f32("llama.rope.freq_base", 100_000.0)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .kv_u32("llama.vocab_size", 4)
            .kv_u32("tokenizer.ggml.eos_token_id", 2)
    }

    fn tiny_llama(w: &mut GgufWriter) -> &mut GgufWriter {
        tiny_llama_kv(w, 1)
    }

    #[test]
    fn model_config_reads_llama_keys() {
        let mut w = GgufWriter::new();
        tiny_llama(&mut w);
        let config = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect("config");
        assert_eq!(
            config,
            ModelConfig {
                vocab_size: 4,
                hidden: 8,
                intermediate: 16,
                layers: 2,
                heads: 2,
                kv_heads: 1,
                head_dim: 4,
                rope_theta: 100_000.0,
                rms_eps: 1e-5,
                max_positions: 128,
                tied_embeddings: true,
                rope_style: RopeStyle::Interleaved,
                bos_token_id: None,
                eos_token_id: Some(2),
                add_bos: false,
            }
        );

        let mut w = GgufWriter::new();
        tiny_llama(&mut w)
            .kv_u32("llama.attention.key_length", 4)
            .kv_u32("llama.rope.dimension_count", 2);
        let err = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect_err("partial rotary");
        assert!(matches!(err, LoadError::Unsupported { .. }), "{err:?}");

        // Without key_length, the rotary dims are the head size, which must tile the width.
        let mut w = GgufWriter::new();
        tiny_llama(&mut w).kv_u32("llama.rope.dimension_count", 2);
        let err = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect_err("head_dim 2");
        assert!(
            matches!(
                err,
                LoadError::InvalidConfig {
                    field: "hidden",
                    ..
                }
            ),
            "{err:?}"
        );

        let mut w = GgufWriter::new();
        tiny_llama(&mut w).kv_str("llama.rope.scaling.type", "yarn");
        let err = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect_err("yarn");
        assert!(err.to_string().contains("yarn"), "{err}");

        let mut w = GgufWriter::new();
        w.kv_str("general.architecture", "qwen2");
        let err = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect_err("qwen2");
        assert!(err.to_string().contains("\"qwen2\""), "{err}");

        let mut w = GgufWriter::new();
        tiny_llama_kv(&mut w, 3);
        let err = parse(w.finish())
            .expect("valid")
            .model_config()
            .expect_err("kv heads");
        assert!(
            matches!(
                err,
                LoadError::InvalidConfig {
                    field: "kv_heads",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    /// Checks the dequantizers against the `gguf` Python package on the real SmolLM2 file. The
    /// expected values are bit patterns printed by
    /// `gguf.quants.dequantize(t.data, t.tensor_type)` (gguf 0.19, numpy f32) for the first
    /// eight weights of each tensor's row 1.
    #[test]
    #[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m (or SMOLLM2_GGUF)"]
    fn smollm2_matches_gguf_py() {
        let Some(path) = crate::model::test_util::smollm2_gguf() else {
            return;
        };
        let file = GgufFile::open(Path::new(&path)).expect("open");
        let config = file.model_config().expect("config");
        assert_eq!(
            (config.hidden, config.layers, config.heads, config.kv_heads),
            (576, 30, 9, 3)
        );
        assert!(config.tied_embeddings);
        super::super::check_llama_tensors(&config, &file).expect("all tensors");
        for (name, row, want) in SMOLLM2_ROWS {
            let (_, cols) = file.shape(name).expect("tensor");
            let mut out = vec![0f32; cols];
            file.read_rows(name, row..row + 1, &mut out).expect("read");
            let got: Vec<u32> = out[..8].iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{name} row {row}");
        }
    }

    /// See [`smollm2_matches_gguf_py`]: (canonical name, row, first eight weights as f32 bits).
    const SMOLLM2_ROWS: [(&str, usize, [u32; 8]); 6] = [
        (
            "token_embd",
            1,
            [
                0xbcc30000, 0xbc820000, 0xbd228000, 0x3c820000, 0xbde38000, 0xbc020000, 0xbd820000,
                0x3d924000,
            ],
        ),
        (
            "token_embd",
            49151,
            [
                0x3c3c8000, 0x3bbc8000, 0x3dc84800, 0xbdc84800, 0x3db0b800, 0xbd3c8000, 0x3e30b800,
                0x3d541000,
            ],
        ),
        (
            "blk.0.attn_q",
            1,
            [
                0xbdf04000, 0xbdf04000, 0xbe457000, 0x3e853800, 0xbefd5800, 0x3e3d2000, 0xbd2b4000,
                0xbd2b4000,
            ],
        ),
        (
            "blk.29.ffn_down",
            575,
            [
                0xbe6ab000, 0xbd204000, 0xbe8dac00, 0x3e7be000, 0x3c098000, 0xbd204000, 0x3d650000,
                0x3e1a9000,
            ],
        ),
        (
            "blk.0.attn_norm",
            0,
            [
                0x3c650000, 0x3cc30000, 0xbca20000, 0xbcf80000, 0xbca10000, 0xbd100000, 0x3cb90000,
                0xbca40000,
            ],
        ),
        (
            "output_norm",
            0,
            [
                0x3fe10000, 0x3fe90000, 0x3fe40000, 0x3fcd0000, 0x3fdf0000, 0x3fdc0000, 0x3fea0000,
                0x3fe00000,
            ],
        ),
    ];
}

//! Model files: LLaMA-family weights from a GGUF file or a Hugging Face safetensors directory, read
//! through one trait ([`TensorSource`]) under one set of canonical tensor names, plus the
//! tokenizer and chat template that come with them.
//!
//! # What is here
//! - [`open_model`]: the entry point. A `.gguf` file or a directory with `config.json` and
//!   `*.safetensors` becomes a [`LoadedModel`]: a validated [`ModelConfig`], the weights as a
//!   `Box<dyn TensorSource + Send + Sync>`, and the [`tokenizer::Tokenizer`] when the model
//!   carries one.
//! - [`gguf`]: a GGUF v2/v3 reader and the dequantizers (F32, F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4).
//! - [`safetensors`]: the Hugging Face directory loader (F32, F16, BF16).
//! - [`tokenizer`]: byte-level BPE from GGUF metadata or `tokenizer.json`, streaming
//!   detokenization, chat templates.
//!
//! # Canonical tensor names
//! The decoder asks for llama.cpp's names without the `.weight` suffix; each source maps its own
//! names onto them. Shapes are `(rows, cols)` in row-major terms, `y = W x` with rows = output
//! features:
//!
//! | name | shape | Hugging Face name |
//! |---|---|---|
//! | `token_embd` | (vocab, hidden) | `model.embed_tokens.weight` |
//! | `output_norm` | (1, hidden) | `model.norm.weight` |
//! | `output` (absent when tied) | (vocab, hidden) | `lm_head.weight` |
//! | `blk.{i}.attn_norm` | (1, hidden) | `model.layers.{i}.input_layernorm.weight` |
//! | `blk.{i}.attn_q` | (heads·head_dim, hidden) | `model.layers.{i}.self_attn.q_proj.weight` |
//! | `blk.{i}.attn_k` | (kv_heads·head_dim, hidden) | `model.layers.{i}.self_attn.k_proj.weight` |
//! | `blk.{i}.attn_v` | (kv_heads·head_dim, hidden) | `model.layers.{i}.self_attn.v_proj.weight` |
//! | `blk.{i}.attn_output` | (hidden, heads·head_dim) | `model.layers.{i}.self_attn.o_proj.weight` |
//! | `blk.{i}.ffn_norm` | (1, hidden) | `model.layers.{i}.post_attention_layernorm.weight` |
//! | `blk.{i}.ffn_gate` | (intermediate, hidden) | `model.layers.{i}.mlp.gate_proj.weight` |
//! | `blk.{i}.ffn_up` | (intermediate, hidden) | `model.layers.{i}.mlp.up_proj.weight` |
//! | `blk.{i}.ffn_down` | (hidden, intermediate) | `model.layers.{i}.mlp.down_proj.weight` |
//!
//! The two formats store q/k in different rotary layouts; [`ModelConfig::rope_style`] says which
//! one the weights are in, and the decoder must rotate accordingly.
//!
//! # Invariants
//! - Model files are untrusted: every count, length, offset and shape is checked before it is
//!   used, with checked arithmetic, and a bad file is a [`LoadError`] naming the file, the key or
//!   tensor and the problem, never a panic and never an allocation sized by an unchecked count.
//! - Weights are memory-mapped, never copied whole; [`TensorSource::read_rows`] dequantizes only
//!   the rows asked for, bit-exactly as the format (ggml, for GGUF) defines it.
//! - A [`ModelConfig`] that a loader returns has passed [`ModelConfig::validate`], and
//!   [`open_model`] has checked every canonical tensor's presence and shape.
//!
//! # Unsafe
//! One block, in the private `map_file`: `memmap2::Mmap::map`. See its `SAFETY` note for the one known
//! limitation (another process truncating or rewriting the file while it is mapped).

pub mod gguf;
pub mod safetensors;
pub mod tokenizer;

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use self::gguf::GgufFile;
use self::safetensors::SafetensorsDir;
use self::tokenizer::{Tokenizer, TokenizerError};

/// Elements above which one tensor is considered absurd (2^31): no LLaMA-family tensor of a model
/// this pipeline can run comes near it, and staying below it keeps every element index in an
/// `i32` for the GPU and NPU kernels.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 31;

/// Everything that can go wrong while opening or reading a model, its tokenizer or its config.
///
/// Messages name the file, the key or tensor, the problem and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file or directory could not be opened or read.
    #[error("cannot read {path}: {source}; check that the path exists and is readable")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The path is neither a GGUF file nor a model directory.
    #[error(
        "{path} is not a GGUF file (it starts with {magic:02x?}, not \"GGUF\") and not a directory; \
         pass a .gguf file or a directory holding config.json and *.safetensors"
    )]
    NotAModel {
        /// The path given.
        path: PathBuf,
        /// Its first bytes (up to four).
        magic: Vec<u8>,
    },
    /// A GGUF version this reader does not handle.
    #[error(
        "{path}: GGUF version {version} is not supported (this reader handles versions 2 and 3); \
         convert the model again with a current llama.cpp"
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version in the header.
        version: u32,
    },
    /// The file ends before a structure it declares.
    #[error(
        "{path}: {what} needs {needed} bytes at offset {offset} but the file is {len} bytes long; \
         the file is truncated, download or convert it again"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read (header field, key, tensor).
        what: String,
        /// Where it starts (bytes from the start of the file).
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// The file's length.
        len: u64,
    },
    /// A structure in the file is invalid.
    #[error(
        "{path}: {what} at offset {offset} is corrupt: {problem}; the file is damaged or was \
         written by a broken converter"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was being read (header field, key, tensor).
        what: String,
        /// Where it starts (bytes from the start of the file).
        offset: u64,
        /// The problem.
        problem: Corruption,
    },
    /// A required metadata key (GGUF) or config field is absent.
    #[error(
        "{path}: metadata key `{key}` is missing; the file was not converted for the LLaMA \
         architecture or by a converter this loader knows"
    )]
    MetadataMissing {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata value has the wrong type.
    #[error("{path}: metadata key `{key}` holds {found}, expected {expected}")]
    MetadataType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type the reader needs.
        expected: &'static str,
        /// The type (and, for out-of-range integers, the value) found.
        found: String,
    },
    /// A metadata value is well-typed but not one this loader supports.
    #[error("{path}: metadata key `{key}` is {value}, but this loader supports only {supported}")]
    MetadataValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The value found.
        value: String,
        /// What would be accepted.
        supported: String,
    },
    /// The model uses a feature this loader or decoder does not implement.
    #[error("{path}: the model uses {feature}, which this decoder does not implement")]
    Unsupported {
        /// The file or directory.
        path: PathBuf,
        /// The feature, with the key or tensor that announced it.
        feature: String,
    },
    /// A [`ModelConfig`] field is out of range or inconsistent with the others.
    #[error("model config: `{field}` = {value} is invalid: {requirement}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// The rule it breaks.
        requirement: String,
    },
    /// A canonical tensor the decoder needs is absent.
    #[error(
        "tensor `{tensor}` (canonical name) is missing from the model; it does not have the LLaMA \
         layout this decoder needs"
    )]
    TensorMissing {
        /// The canonical name.
        tensor: String,
    },
    /// A tensor's shape disagrees with the model config.
    #[error(
        "tensor `{tensor}` has shape {found:?} (rows, cols) but the config implies {expected:?}; \
         the weights and the config do not belong together"
    )]
    TensorShape {
        /// The canonical name.
        tensor: String,
        /// Shape from the config.
        expected: (usize, usize),
        /// Shape in the file.
        found: (usize, usize),
    },
    /// A tensor's element type cannot be dequantized by this loader.
    #[error(
        "{path}: tensor `{tensor}` has type {dtype}, which this loader cannot read (supported: F32, \
         F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4); quantize the model to one of these"
    )]
    TensorDtype {
        /// The file.
        path: PathBuf,
        /// The name in the file.
        tensor: String,
        /// The type's name.
        dtype: String,
    },
    /// [`TensorSource::read_rows`] was asked for rows the tensor does not have.
    #[error("tensor `{tensor}` has {rows} rows; rows {start}..{end} were asked for")]
    RowRange {
        /// The name asked for.
        tensor: String,
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// The tensor's row count.
        rows: usize,
    },
    /// [`TensorSource::read_rows`] was given an output slice of the wrong length.
    #[error(
        "reading tensor `{tensor}`: output holds {found} f32, the rows asked for need {expected}"
    )]
    OutputLength {
        /// The name asked for.
        tensor: String,
        /// rows × cols.
        expected: usize,
        /// `out.len()`.
        found: usize,
    },
    /// A side file of the model (config.json, tokenizer.json, a chat template) is larger than
    /// any real one, so it is refused before it is read.
    #[error(
        "{path} is {size} bytes, over the {max}-byte limit for {what}; it is not a real {what}"
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// What the file should be.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A JSON file (config.json, tokenizer_config.json) could not be parsed.
    #[error("{path}: {source}; the file is not a valid Hugging Face LLaMA config")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors header is invalid.
    #[error("{path}: invalid safetensors file: {source}; download it again")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The crate's validation error.
        #[source]
        source: ::safetensors::SafeTensorError,
    },
    /// Two safetensors files of one directory hold the same tensor.
    #[error(
        "{path}: tensor `{tensor}` is also in {other}; remove the stale file from the directory"
    )]
    DuplicateTensor {
        /// The second file.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The first file.
        other: PathBuf,
    },
    /// A model directory holds no `*.safetensors`.
    #[error("{path}: no *.safetensors files; download the model weights into this directory")]
    NoWeights {
        /// The directory.
        path: PathBuf,
    },
    /// The tokenizer could not be built.
    #[error("{path}: cannot build the tokenizer: {source}")]
    Tokenizer {
        /// The file the tokenizer came from.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: TokenizerError,
    },
}

/// The problem with a corrupt structure in a model file ([`LoadError::Corrupt`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Corruption {
    /// A count or length is more than the rest of the file could hold.
    CountTooLarge {
        /// The declared count.
        count: u64,
        /// The most that fits in the remaining bytes.
        max: u64,
    },
    /// The metadata arrays hold more elements in all than any real model's.
    TooManyElements {
        /// The limit.
        max: u64,
    },
    /// A string is not UTF-8.
    InvalidUtf8,
    /// A metadata value type id outside the GGUF specification.
    UnknownValueType(u32),
    /// Arrays nested deeper than the reader allows.
    NestingTooDeep {
        /// The limit.
        max: usize,
    },
    /// A bool byte other than 0 or 1.
    InvalidBool(u8),
    /// A metadata key that appears twice.
    DuplicateKey,
    /// A tensor name that appears twice.
    DuplicateTensor,
    /// `general.alignment` is zero or not a power of two.
    BadAlignment(u64),
    /// A tensor with no dimensions or more than four.
    DimCount(u32),
    /// A zero dimension.
    ZeroDim,
    /// The element count or byte size overflows 64 bits.
    SizeOverflow,
    /// A ggml type id this reader does not know.
    UnknownTensorType(u32),
    /// `ne[0]` is not a whole number of blocks.
    PartialBlock {
        /// `ne[0]`.
        ne0: u64,
        /// The type's block size.
        block: u64,
    },
    /// A tensor offset that is not a multiple of `general.alignment`.
    MisalignedOffset {
        /// The offset (relative to the data section).
        offset: u64,
        /// The alignment.
        alignment: u64,
    },
    /// The block-rotation list names a tensor the file lacks, or one not stored in an MX type.
    NotRotatable(String),
    /// A tensor whose bytes run past the end of the file.
    OutOfBounds {
        /// Where its bytes would end (bytes from the start of the file).
        end: u64,
        /// The file's length.
        len: u64,
    },
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CountTooLarge { count, max } => {
                write!(
                    f,
                    "declares {count} entries or bytes but at most {max} fit in the rest of the file"
                )
            }
            Self::TooManyElements { max } => write!(
                f,
                "metadata arrays hold more than {max} elements in all (a 256k-token vocabulary \
                 needs about 1M)"
            ),
            Self::InvalidUtf8 => f.write_str("string is not valid UTF-8"),
            Self::UnknownValueType(t) => write!(f, "unknown metadata value type {t}"),
            Self::NestingTooDeep { max } => write!(f, "arrays nested more than {max} deep"),
            Self::InvalidBool(b) => write!(f, "bool byte is {b}, not 0 or 1"),
            Self::DuplicateKey => f.write_str("key appears twice"),
            Self::DuplicateTensor => f.write_str("tensor name appears twice"),
            Self::BadAlignment(a) => write!(f, "alignment {a} is not a nonzero power of two"),
            Self::DimCount(n) => write!(f, "{n} dimensions (1 to 4 allowed)"),
            Self::ZeroDim => f.write_str("a dimension is zero"),
            Self::SizeOverflow => f.write_str("element count or byte size overflows"),
            Self::UnknownTensorType(t) => write!(f, "unknown ggml tensor type {t}"),
            Self::PartialBlock { ne0, block } => {
                write!(
                    f,
                    "row length {ne0} is not a multiple of the block size {block}"
                )
            }
            Self::MisalignedOffset { offset, alignment } => {
                write!(
                    f,
                    "data offset {offset} is not a multiple of the alignment {alignment}"
                )
            }
            Self::NotRotatable(name) => {
                write!(f, "names {name:?}, which is not an MX tensor of the file")
            }
            Self::OutOfBounds { end, len } => {
                write!(
                    f,
                    "data would end at byte {end} but the file is {len} bytes long"
                )
            }
        }
    }
}

/// Element type of a tensor in its source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of a binary32).
    BF16,
    /// ggml `block_q8_0`: 32 weights as `i8 × d`, `d` f16 (34 bytes).
    Q8_0,
    /// ggml `block_q4_0`: 32 weights as `(nibble − 8) × d`, `d` f16 (18 bytes).
    Q4_0,
    /// ggml `block_q4_1`: 32 weights as `nibble × d + m`, `d` and `m` f16 (20 bytes).
    Q4_1,
    /// ggml `block_mxfp4`: 32 FP4 (E2M1) weights sharing an E8M0 scale (17 bytes).
    Mxfp4,
    /// An OCP MX block as `pipeline quantize` writes it (see [`gguf::MX_TYPE_BASE`]): the E8M0
    /// scale byte, then the 32 codes in mx-quant's linear packing.
    Mx(mx_quant::ElemFormat),
}

impl SourceDtype {
    /// Weights per block (1 for the plain float types).
    pub const fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Mxfp4 | Self::Mx(_) => 32,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => gguf::Q8_0_BYTES,
            Self::Q4_0 => gguf::Q4_0_BYTES,
            Self::Q4_1 => gguf::Q4_1_BYTES,
            Self::Mxfp4 => gguf::MXFP4_BYTES,
            Self::Mx(format) => 1 + mx_quant::layout::packed_len(format, mx_quant::BLOCK),
        }
    }

    /// Storage cost per weight, scales included (Q4_1: 5.0, MXFP4: 4.25).
    pub fn bits_per_weight(self) -> f32 {
        // Both factors are below 2^24, so the conversions are exact.
        (self.block_bytes() * 8) as f32 / self.block_size() as f32
    }
}

impl fmt::Display for SourceDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Mxfp4 => "MXFP4",
            Self::Mx(format) => return write!(f, "MX {format}"),
        })
    }
}

/// A source of named weight tensors, read as f32 rows.
///
/// Names are the canonical ones of the module docs; a source may also answer to its own names.
pub trait TensorSource {
    /// (rows, cols) of a 1-D or 2-D tensor in row-major semantics: for a 2-D weight used as
    /// y = W x, rows = output features, cols = input features (GGUF `ne[1]`, `ne[0]`;
    /// safetensors `shape[0]`, `shape[1]`); a 1-D tensor is (1, len). A tensor of more
    /// dimensions is (product of all but the innermost, innermost), as ggml counts rows.
    fn shape(&self, name: &str) -> Option<(usize, usize)>;

    /// Source element type (for reporting / policies). `None` when the tensor is absent or of a
    /// type this loader cannot read.
    fn dtype(&self, name: &str) -> Option<SourceDtype>;

    /// Dequantizes rows `rows` of `name` into `out` (rows.len() * cols f32), exactly (no rounding
    /// beyond the format's own definition: e.g. Q4_1 is d*q+m computed in f32 from f16 d and m,
    /// as ggml does).
    ///
    /// # Errors
    /// [`LoadError::TensorMissing`], [`LoadError::TensorDtype`], [`LoadError::RowRange`] or
    /// [`LoadError::OutputLength`].
    fn read_rows(&self, name: &str, rows: Range<usize>, out: &mut [f32]) -> Result<(), LoadError>;

    /// Raw bytes of a tensor and its dtype, for zero-copy import (e.g. GGUF MXFP4 blocks).
    /// Quantized rows are whole blocks, rows back to back, as the file stores them.
    fn raw(&self, name: &str) -> Option<(SourceDtype, &[u8])>;

    /// Whether `name`'s stored rows are block-rotated (`mx_quant::hadamard`; only files that
    /// `pipeline quantize --rotate` wrote have such tensors). [`TensorSource::read_rows`] undoes
    /// the rotation; [`TensorSource::raw`] gives the rotated blocks as stored.
    fn block_rotation(&self, _name: &str) -> bool {
        false
    }
}

/// How the q/k weights expect rotary embeddings to pair up dimensions within a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// GGUF llama: llama.cpp's converter permutes q/k, so rotation acts on adjacent pairs
    /// (2i, 2i+1).
    Interleaved,
    /// Hugging Face `rotate_half`: rotation acts on pairs (i, i + head_dim/2).
    HalfSplit,
}

/// Hyperparameters of a LLaMA-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Rows of `token_embd` (and `output`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden: usize,
    /// FFN width.
    pub intermediate: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Context length the model was trained for.
    pub max_positions: usize,
    /// The output projection is `token_embd` (no `output` tensor).
    pub tied_embeddings: bool,
    /// Rotary pairing the q/k weights are laid out for.
    pub rope_style: RopeStyle,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token.
    pub eos_token_id: Option<u32>,
    /// The model expects a BOS token in front of every prompt.
    pub add_bos: bool,
}

impl ModelConfig {
    /// Checks that every dimension is positive, that heads tile `hidden` and group evenly over
    /// `kv_heads`, that `head_dim` is even (RoPE rotates pairs), that the floats are positive and
    /// finite, and that no tensor has [`MAX_TENSOR_ELEMENTS`] or more elements.
    ///
    /// # Errors
    /// [`LoadError::InvalidConfig`] naming the first field that breaks a rule.
    pub fn validate(&self) -> Result<(), LoadError> {
        fn invalid(
            field: &'static str,
            value: impl fmt::Display,
            requirement: String,
        ) -> LoadError {
            LoadError::InvalidConfig {
                field,
                value: value.to_string(),
                requirement,
            }
        }
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_positions", self.max_positions),
        ];
        for (field, value) in dims {
            if value == 0 {
                return Err(invalid(field, value, "must be greater than zero".into()));
            }
        }
        if self.heads.checked_mul(self.head_dim) != Some(self.hidden) {
            return Err(invalid(
                "hidden",
                self.hidden,
                format!(
                    "must equal heads ({}) × head_dim ({})",
                    self.heads, self.head_dim
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(
                "kv_heads",
                self.kv_heads,
                format!("must divide heads ({})", self.heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                self.head_dim,
                "must be even (RoPE rotates pairs)".into(),
            ));
        }
        for (field, value) in [("rope_theta", self.rope_theta), ("rms_eps", self.rms_eps)] {
            if !(value.is_finite() && value > 0.0) {
                return Err(invalid(field, value, "must be positive and finite".into()));
            }
        }
        let kv_width = self.kv_heads.checked_mul(self.head_dim);
        let products = [
            (
                "vocab_size",
                self.vocab_size,
                self.vocab_size.checked_mul(self.hidden),
            ),
            (
                "intermediate",
                self.intermediate,
                self.intermediate.checked_mul(self.hidden),
            ),
            ("hidden", self.hidden, self.hidden.checked_mul(self.hidden)),
            (
                "kv_heads",
                self.kv_heads,
                kv_width.and_then(|w| w.checked_mul(self.hidden)),
            ),
        ];
        for (field, value, elements) in products {
            let fits = elements
                .and_then(|e| u64::try_from(e).ok())
                .is_some_and(|e| e < MAX_TENSOR_ELEMENTS);
            if !fits {
                return Err(invalid(
                    field,
                    value,
                    format!("makes a tensor of {MAX_TENSOR_ELEMENTS} or more elements"),
                ));
            }
        }
        if let Some(id) = self.bos_token_id {
            check_token_id("bos_token_id", id, self.vocab_size)?;
        }
        if let Some(id) = self.eos_token_id {
            check_token_id("eos_token_id", id, self.vocab_size)?;
        }
        Ok(())
    }

    /// Canonical names and shapes of every tensor the decoder reads, in load order; the `bool` is
    /// `true` for required tensors (`output` is optional: absent means tied).
    ///
    /// Lazy: a config from an untrusted file may declare billions of layers, and a checker that
    /// stops at the first missing tensor then does work bounded by the tensors actually present,
    /// never by the declared count.
    pub fn tensor_shapes(&self) -> impl Iterator<Item = (String, (usize, usize), bool)> + '_ {
        let (h, q, kv, ff) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        let head = [
            ("token_embd".to_owned(), (self.vocab_size, h), true),
            ("output_norm".to_owned(), (1, h), true),
            (
                "output".to_owned(),
                (self.vocab_size, h),
                !self.tied_embeddings,
            ),
        ];
        let layer = [
            ("attn_norm", (1, h)),
            ("attn_q", (q, h)),
            ("attn_k", (kv, h)),
            ("attn_v", (kv, h)),
            ("attn_output", (h, q)),
            ("ffn_norm", (1, h)),
            ("ffn_gate", (ff, h)),
            ("ffn_up", (ff, h)),
            ("ffn_down", (h, ff)),
        ];
        head.into_iter().chain((0..self.layers).flat_map(move |i| {
            layer
                .into_iter()
                .map(move |(n, s)| (format!("blk.{i}.{n}"), s, true))
        }))
    }
}

/// The most bytes of a JSON config (config.json, tokenizer_config.json) read: real ones are a few
/// KB, tens with an embedded chat template.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The most bytes of a `tokenizer.json` read: a 256k-token vocabulary with merges is ~20 MB.
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;
/// The most bytes of a chat template read (`chat_template.jinja`): real ones are under 20 KB.
pub const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// Reads a text file of at most `max` bytes; a larger one is [`LoadError::TooLarge`] before any of
/// it is read (and a file that grows while read is cut off at `max + 1` and refused the same way).
pub(crate) fn read_text_capped(
    path: &Path,
    what: &'static str,
    max: u64,
) -> Result<String, LoadError> {
    use std::io::Read;
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let too_large = |size| LoadError::TooLarge {
        path: path.to_owned(),
        what,
        size,
        max,
    };
    if size > max {
        return Err(too_large(size));
    }
    let mut text = String::new();
    file.take(max + 1).read_to_string(&mut text).map_err(io)?;
    if text.len() as u64 > max {
        return Err(too_large(text.len() as u64));
    }
    Ok(text)
}

fn check_token_id(field: &'static str, id: u32, vocab_size: usize) -> Result<(), LoadError> {
    if usize::try_from(id).is_ok_and(|i| i < vocab_size) {
        Ok(())
    } else {
        Err(LoadError::InvalidConfig {
            field,
            value: id.to_string(),
            requirement: format!("must be below vocab_size ({vocab_size})"),
        })
    }
}

/// Checks that every canonical LLaMA tensor of `config` is present in `source` with the shape the
/// config implies (`output` only if present or untied).
///
/// # Errors
/// The first [`LoadError::TensorMissing`] or [`LoadError::TensorShape`], in load order.
pub fn check_llama_tensors<S: TensorSource + ?Sized>(
    config: &ModelConfig,
    source: &S,
) -> Result<(), LoadError> {
    for (tensor, expected, required) in config.tensor_shapes() {
        match source.shape(&tensor) {
            Some(found) if found == expected => {}
            Some(found) => {
                return Err(LoadError::TensorShape {
                    tensor,
                    expected,
                    found,
                });
            }
            None if required => return Err(LoadError::TensorMissing { tensor }),
            None => {}
        }
    }
    Ok(())
}

/// An opened model: what [`open_model`] returns.
pub struct LoadedModel {
    /// The validated hyperparameters.
    pub config: ModelConfig,
    /// The weights, under canonical names, already checked against `config`.
    pub tensors: Box<dyn TensorSource + Send + Sync>,
    /// The tokenizer, when the model carries one (GGUF `tokenizer.ggml.*`, or `tokenizer.json`
    /// in the directory).
    pub tokenizer: Option<Tokenizer>,
}

impl fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedModel")
            .field("config", &self.config)
            .field("tokenizer", &self.tokenizer.is_some())
            .finish_non_exhaustive()
    }
}

/// Opens a LLaMA-family model: a `.gguf` file, or a directory with `config.json`, one or more
/// `*.safetensors` and, optionally, `tokenizer.json` (+ `tokenizer_config.json`).
///
/// The config is validated and every canonical tensor checked for presence and shape before
/// this returns.
///
/// # Errors
/// Any [`LoadError`]: unreadable path, corrupt file, unsupported architecture or feature, config
/// inconsistent with the tensors, or a tokenizer that cannot be built.
pub fn open_model(path: &Path) -> Result<LoadedModel, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let (config, tensors, tokenizer): (_, Box<dyn TensorSource + Send + Sync>, _) = if meta.is_dir()
    {
        let dir = SafetensorsDir::open(path)?;
        let tokenizer_json = path.join("tokenizer.json");
        let tokenizer = if tokenizer_json.is_file() {
            Some(Tokenizer::from_file(&tokenizer_json)?)
        } else {
            None
        };
        let mut config = dir.config().clone();
        // The tokenizer knows best: it also sees a post-processor that adds BOS.
        if let Some(tokenizer) = &tokenizer {
            config.add_bos = tokenizer.add_bos();
        }
        (config, Box::new(dir), tokenizer)
    } else {
        let mut magic = Vec::with_capacity(4);
        File::open(path)
            .map_err(io)?
            .take(4)
            .read_to_end(&mut magic)
            .map_err(io)?;
        if magic != gguf::MAGIC {
            return Err(LoadError::NotAModel {
                path: path.to_owned(),
                magic,
            });
        }
        let file = GgufFile::open(path)?;
        let config = file.model_config()?;
        let tokenizer = if file.get("tokenizer.ggml.model").is_some() {
            Some(Tokenizer::from_gguf(&file)?)
        } else {
            None
        };
        (config, Box::new(file), tokenizer)
    };
    check_llama_tensors(&config, &*tensors)?;
    Ok(LoadedModel {
        config,
        tensors,
        tokenizer,
    })
}

/// `mmap(fd, PROT_READ, MAP_SHARED)` of a whole file, read-only (memmap2's `Mmap::map`).
///
/// # Errors
/// [`LoadError::Io`] when the file cannot be opened or mapped.
#[allow(unsafe_code)]
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap, LoadError> {
    let io = |source| LoadError::Io {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: memmap2 requires that the mapped file is not modified for the lifetime of the map.
    // The file is opened read-only and its bytes are treated as untrusted input: every length,
    // offset and value read through the map is bounds-checked, so any *content* is sound. The
    // mapping is MAP_SHARED, so what this process cannot rule out is another process truncating
    // the file (later reads fault with SIGBUS) or rewriting it in place (the new bytes show
    // through the mapping, under a header already validated). Model files are
    // written once and then only read, so this is accepted as a documented limitation, as every
    // mmap-based model loader does.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok(map)
}

/// Helpers shared by this module's tests.
#[cfg(test)]
pub(crate) mod test_util {
    use std::path::PathBuf;

    /// The real SmolLM2-135M GGUF: `$SMOLLM2_GGUF`, else where `cargo xtask fetch-model
    /// smollm2-135m` puts it. Missing, the test skips with a note on stderr, except under CI,
    /// where it fails: CI fetches the model, so a skip there would be a silent pass.
    pub(crate) fn smollm2_gguf() -> Option<PathBuf> {
        let path = std::env::var_os("SMOLLM2_GGUF").map_or_else(
            || {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
            },
            PathBuf::from,
        );
        if path.is_file() {
            return Some(path);
        }
        let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
        assert!(
            !ci,
            "{} is missing: CI fetches it (cargo xtask fetch-model smollm2-135m) and must run \
             this test",
            path.display()
        );
        eprintln!(
            "\nSKIPPED: {} is missing (cargo xtask fetch-model smollm2-135m)\n",
            path.display()
        );
        None
    }

    /// A fresh directory under the system temp dir, removed on drop.
    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> Self {
            let path =
                std::env::temp_dir().join(format!("pipeline-model-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).expect("create temp dir");
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gguf::test_writer::GgufWriter;
    use super::test_util::TempDir;
    use super::*;

    fn smollm2_like() -> ModelConfig {
        ModelConfig {
            vocab_size: 49152,
            hidden: 576,
            intermediate: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            rope_theta: 100_000.0,
            rms_eps: 1e-5,
            max_positions: 8192,
            tied_embeddings: true,
            rope_style: RopeStyle::Interleaved,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            add_bos: false,
        }
    }

    #[test]
    fn validate_names_the_offending_field() {
        smollm2_like().validate().expect("SmolLM2 is valid");
        type Breaker = fn(&mut ModelConfig);
        let cases: [(Breaker, &str); 9] = [
            (|c| c.layers = 0, "layers"),
            (|c| c.hidden = 577, "hidden"),
            (|c| c.kv_heads = 4, "kv_heads"),
            (
                |c| (c.heads, c.kv_heads, c.head_dim) = (64, 1, 9),
                "head_dim",
            ),
            (|c| c.rope_theta = f32::NAN, "rope_theta"),
            (|c| c.rms_eps = 0.0, "rms_eps"),
            (|c| c.vocab_size = 1 << 22, "vocab_size"),
            (|c| c.eos_token_id = Some(49152), "eos_token_id"),
            (|c| c.heads = usize::MAX, "hidden"),
        ];
        for (break_it, field) in cases {
            let mut config = smollm2_like();
            break_it(&mut config);
            match config.validate() {
                Err(LoadError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn bits_per_weight_include_scales() {
        let bits = [
            (SourceDtype::F32, 32.0),
            (SourceDtype::BF16, 16.0),
            (SourceDtype::Q8_0, 8.5),
            (SourceDtype::Q4_0, 4.5),
            (SourceDtype::Q4_1, 5.0),
            (SourceDtype::Mxfp4, 4.25),
        ];
        for (dtype, want) in bits {
            assert_eq!(dtype.bits_per_weight(), want, "{dtype}");
        }
        assert_eq!(SourceDtype::Mxfp4.to_string(), "MXFP4");
    }

    /// A complete tiny llama GGUF (hidden 8, 2 heads of 4, 1 KV head, FFN 16, 2 layers, vocab 4),
    /// every tensor F32, optionally without one tensor.
    fn tiny_llama_gguf(skip: Option<&str>) -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.kv_str("general.architecture", "llama")
            .kv_u32("llama.embedding_length", 8)
            .kv_u32("llama.attention.head_count", 2)
            .kv_u32("llama.attention.head_count_kv", 1)
            .kv_u32("llama.feed_forward_length", 16)
            .kv_u32("llama.block_count", 2)
            .kv_u32("llama.context_length", 128)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "ab", "<|im_end|>"])
            .kv_str_array("tokenizer.ggml.merges", &["a b"])
            .kv_i32_array("tokenizer.ggml.token_type", &[1, 1, 1, 3])
            .kv_u32("tokenizer.ggml.eos_token_id", 3);
        let config = ModelConfig {
            vocab_size: 4,
            hidden: 8,
            intermediate: 16,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            ..smollm2_like()
        };
        for (name, (rows, cols), required) in config.tensor_shapes() {
            if !required || Some(name.as_str()) == skip {
                continue;
            }
            let dims: Vec<u64> = if rows == 1 {
                vec![cols as u64]
            } else {
                vec![cols as u64, rows as u64]
            };
            w.tensor(
                &format!("{name}.weight"),
                &dims,
                0,
                vec![0; rows * cols * 4],
            );
        }
        w.finish()
    }

    #[test]
    fn open_model_reads_a_gguf_file() {
        let dir = TempDir::new("open-gguf");
        let path = dir.0.join("tiny.gguf");
        std::fs::write(&path, tiny_llama_gguf(None)).expect("write");
        let model = open_model(&path).expect("open");
        assert_eq!(
            (
                model.config.hidden,
                model.config.vocab_size,
                model.config.tied_embeddings
            ),
            (8, 4, true)
        );
        assert_eq!(model.tensors.shape("blk.1.ffn_down"), Some((8, 16)));
        let tokenizer = model.tokenizer.expect("tokenizer");
        assert_eq!(tokenizer.encode("ab", false).expect("encode"), [2]);
        assert_eq!(tokenizer.stop_ids(), [3]);

        std::fs::write(&path, tiny_llama_gguf(Some("blk.1.attn_v"))).expect("write");
        let err = open_model(&path).expect_err("missing tensor");
        assert!(
            matches!(err, LoadError::TensorMissing { ref tensor } if tensor == "blk.1.attn_v"),
            "{err:?}"
        );

        std::fs::write(&path, b"PK\x03\x04 not a model").expect("write");
        assert!(matches!(
            open_model(&path),
            Err(LoadError::NotAModel { .. })
        ));
        assert!(matches!(
            open_model(&dir.0.join("absent.gguf")),
            Err(LoadError::Io { .. })
        ));
    }

    /// Opens the real SmolLM2 GGUF end to end.
    #[test]
    #[ignore = "needs the SmolLM2-135M model: cargo xtask fetch-model smollm2-135m (or SMOLLM2_GGUF)"]
    fn open_model_smollm2() {
        let Some(path) = crate::model::test_util::smollm2_gguf() else {
            return;
        };
        let model = open_model(Path::new(&path)).expect("open");
        assert_eq!(model.config, smollm2_like());
        assert_eq!(model.tensors.dtype("blk.0.attn_q"), Some(SourceDtype::Q4_1));
        assert_eq!(model.tensors.dtype("token_embd"), Some(SourceDtype::Q8_0));
        assert_eq!(model.tensors.dtype("output_norm"), Some(SourceDtype::F32));
        assert!(model.tokenizer.is_some());
    }
}

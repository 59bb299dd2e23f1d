//! Hugging Face LLaMA checkpoints: a directory with `config.json` and one or more
//! `*.safetensors` files, read as a [`TensorSource`] under the canonical names of [`super`].
//!
//! # Invariants
//! - Every `*.safetensors` file in the directory is mapped and its header validated by the
//!   `safetensors` crate (JSON, offsets contiguous and covering exactly the data, sizes in checked
//!   arithmetic) before any tensor is used; a tensor that appears in two files is an error, so a
//!   stale consolidated file next to shards cannot shadow them silently.
//! - Only F32, F16 and BF16 tensors are readable; others are listed (and reported by name when
//!   asked for) but never reinterpreted.
//! - `config.json` is parsed into a [`ModelConfig`] with [`RopeStyle::HalfSplit`] (Hugging Face
//!   keeps q/k in `rotate_half` order), and validated. Options this decoder does not implement
//!   (`rope_scaling`, biases, activations other than SiLU, non-LLaMA `model_type`) are errors,
//!   not ignored.
//! - A vision-language checkpoint (`model_type` `smolvlm` or `idefics3`) opens as its text
//!   model: the config is its `text_config`, the tensors those under `model.text_model.`; the
//!   vision tower in the same files is [`crate::vision`]'s to read.
//! - `add_bos` comes from `tokenizer_config.json`'s `add_bos_token` when present (false
//!   otherwise); [`super::open_model`] replaces it with what the tokenizer itself does.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ::safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use super::{LoadError, ModelConfig, RopeStyle, SourceDtype, TensorSource};

/// The fields of a Hugging Face `LlamaConfig` this loader reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f32>,
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<TokenIds>,
    eos_token_id: Option<TokenIds>,
    hidden_act: Option<String>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 moves `rope_theta` (and the scaling type) here.
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

/// transformers 5's `rope_parameters` object.
#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f32>,
    rope_type: Option<String>,
}

/// A token id field that may be one id or a list (the first is taken).
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn first(&self) -> Option<u32> {
        match self {
            Self::One(id) => Some(*id),
            Self::Many(ids) => ids.first().copied(),
        }
    }
}

/// The one field of `tokenizer_config.json` the model config needs.
#[derive(Deserialize)]
struct TokenizerConfigBos {
    add_bos_token: Option<bool>,
}

/// Reads and parses a JSON file.
pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, LoadError> {
    let text = super::read_text_capped(path, "JSON config", super::MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: path.to_owned(),
        source,
    })
}

/// The model types whose text model is a LLaMA nested under `text_config`, with its tensors
/// under `model.text_model.` (SmolVLM and the Idefics3 family it comes from).
const VLM_TYPES: [&str; 2] = ["smolvlm", "idefics3"];

/// Builds and validates the model config from `config.json` (and `tokenizer_config.json`), and
/// returns the prefix of the text model's tensor names (`model.`, or `model.text_model.` for a
/// vision-language checkpoint, whose `text_config` describes the text model).
fn model_config(dir: &Path) -> Result<(ModelConfig, &'static str), LoadError> {
    let path = dir.join("config.json");
    let top: serde_json::Value = read_json(&path)?;
    let vlm = top
        .get("model_type")
        .and_then(|t| t.as_str())
        .is_some_and(|t| VLM_TYPES.contains(&t));
    let (hf, prefix): (HfConfig, _) = match top.get("text_config") {
        Some(text) if vlm => (
            HfConfig::deserialize(text).map_err(|source| LoadError::Json {
                path: path.clone(),
                source,
            })?,
            "model.text_model.",
        ),
        _ => (
            HfConfig::deserialize(&top).map_err(|source| LoadError::Json {
                path: path.clone(),
                source,
            })?,
            "model.",
        ),
    };
    let unsupported = |feature: String| LoadError::Unsupported {
        path: path.clone(),
        feature,
    };
    if let Some(kind) = hf.model_type.as_deref()
        && kind != "llama"
    {
        return Err(LoadError::MetadataValue {
            path: path.clone(),
            key: "model_type".into(),
            value: format!("\"{kind}\""),
            supported: "\"llama\"".into(),
        });
    }
    if let Some(act) = hf.hidden_act.as_deref()
        && act != "silu"
    {
        return Err(unsupported(format!(
            "activation \"{act}\" (hidden_act; SiLU only)"
        )));
    }
    if hf.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("RoPE scaling (rope_scaling)".into()));
    }
    if let Some(kind) = hf
        .rope_parameters
        .as_ref()
        .and_then(|r| r.rope_type.as_deref())
        .filter(|&k| k != "default")
    {
        return Err(unsupported(format!(
            "RoPE type \"{kind}\" (rope_parameters.rope_type; default only)"
        )));
    }
    if hf.attention_bias || hf.mlp_bias {
        return Err(unsupported(
            "biases on the projections (attention_bias / mlp_bias)".into(),
        ));
    }
    let tokenizer_config = dir.join("tokenizer_config.json");
    let add_bos = if tokenizer_config.is_file() {
        read_json::<TokenizerConfigBos>(&tokenizer_config)?
            .add_bos_token
            .unwrap_or(false)
    } else {
        false
    };
    let heads = hf.num_attention_heads;
    let config = ModelConfig {
        vocab_size: hf.vocab_size,
        hidden: hf.hidden_size,
        intermediate: hf.intermediate_size,
        layers: hf.num_hidden_layers,
        heads,
        kv_heads: hf.num_key_value_heads.unwrap_or(heads),
        head_dim: hf
            .head_dim
            .unwrap_or_else(|| hf.hidden_size.checked_div(heads).unwrap_or(0)),
        rope_theta: hf
            .rope_theta
            .or(hf.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10_000.0),
        rms_eps: hf.rms_norm_eps,
        max_positions: hf.max_position_embeddings,
        tied_embeddings: hf.tie_word_embeddings,
        rope_style: RopeStyle::HalfSplit,
        bos_token_id: hf.bos_token_id.as_ref().and_then(TokenIds::first),
        eos_token_id: hf.eos_token_id.as_ref().and_then(TokenIds::first),
        add_bos,
    };
    config.validate()?;
    Ok((config, prefix))
}

/// The Hugging Face name of a canonical tensor name.
pub fn hf_name(canonical: &str) -> Option<String> {
    hf_name_under("model.", canonical)
}

/// The Hugging Face name of a canonical tensor name for a text model whose tensors sit under
/// `prefix` (`model.` for a LLaMA checkpoint, `model.text_model.` inside SmolVLM); the output
/// projection is `lm_head.weight` in both.
pub fn hf_name_under(prefix: &str, canonical: &str) -> Option<String> {
    let fixed = match canonical {
        "token_embd" => Some("embed_tokens.weight"),
        "output_norm" => Some("norm.weight"),
        "output" => return Some("lm_head.weight".to_owned()),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(format!("{prefix}{name}"));
    }
    let (layer, kind) = canonical.strip_prefix("blk.")?.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let hf = match kind {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("{prefix}layers.{layer}.{hf}.weight"))
}

/// One tensor: where it is and how to read it.
struct Entry {
    file: usize,
    /// The readable type, or the safetensors type this loader cannot read.
    dtype: Result<SourceDtype, Dtype>,
    rows: usize,
    cols: usize,
    /// Absolute byte range in its file, validated by the safetensors crate.
    data: Range<usize>,
}

/// A Hugging Face LLaMA checkpoint directory, mapped.
pub struct SafetensorsDir {
    dir: PathBuf,
    config: ModelConfig,
    /// Where the text model's tensors sit (see [`hf_name_under`]).
    prefix: &'static str,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    tensors: HashMap<String, Entry>,
}

impl fmt::Debug for SafetensorsDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsDir")
            .field("dir", &self.dir)
            .field(
                "files",
                &self.files.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl SafetensorsDir {
    /// Reads `config.json`, maps every `*.safetensors` in `dir` and validates their headers.
    ///
    /// # Errors
    /// [`LoadError::Io`], [`LoadError::Json`] (config), [`LoadError::Unsupported`] or
    /// [`LoadError::InvalidConfig`] (config), [`LoadError::NoWeights`],
    /// [`LoadError::Safetensors`] (a bad header) or [`LoadError::DuplicateTensor`].
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let (config, prefix) = model_config(dir)?;
        let io = |source| LoadError::Io {
            path: dir.to_owned(),
            source,
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "safetensors") && path.is_file() {
                paths.push(path);
            }
        }
        if paths.is_empty() {
            return Err(LoadError::NoWeights {
                path: dir.to_owned(),
            });
        }
        paths.sort();

        let mut files = Vec::with_capacity(paths.len());
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for path in paths {
            let map = super::map_file(&path)?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&map).map_err(|source| LoadError::Safetensors {
                    path: path.clone(),
                    source,
                })?;
            // read_metadata checked that 8 + header + data is the file length.
            let data_start = 8 + header_len;
            let file = files.len();
            for (name, info) in metadata.tensors() {
                if let Some(other) = tensors.get(&name) {
                    let other = files
                        .get(other.file)
                        .map_or_else(PathBuf::new, |(p, _): &(PathBuf, _)| p.clone());
                    return Err(LoadError::DuplicateTensor {
                        path,
                        tensor: name,
                        other,
                    });
                }
                let dtype = match info.dtype {
                    Dtype::F32 => Ok(SourceDtype::F32),
                    Dtype::F16 => Ok(SourceDtype::F16),
                    Dtype::BF16 => Ok(SourceDtype::BF16),
                    other => Err(other),
                };
                let (rows, cols) = match info.shape.split_last() {
                    None => (1, 1),
                    // The crate checked that the product does not overflow.
                    Some((&cols, rest)) => (rest.iter().product(), cols),
                };
                let (s, e) = info.data_offsets;
                let data = data_start + s..data_start + e;
                tensors.insert(
                    name,
                    Entry {
                        file,
                        dtype,
                        rows,
                        cols,
                        data,
                    },
                );
            }
            files.push((path, map));
        }
        Ok(Self {
            dir: dir.to_owned(),
            config,
            prefix,
            files,
            tensors,
        })
    }

    /// The validated model config from `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Names of all tensors as the files spell them, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// A canonical name maps to its Hugging Face name; a name the files use is taken as is.
    fn resolve(&self, name: &str) -> Option<(&str, &Entry)> {
        hf_name_under(self.prefix, name)
            .and_then(|hf| self.tensors.get_key_value(&hf))
            .or_else(|| self.tensors.get_key_value(name))
            .map(|(k, v)| (k.as_str(), v))
    }

    fn bytes(&self, entry: &Entry) -> &[u8] {
        self.files
            .get(entry.file)
            .and_then(|(_, map)| map.get(entry.data.clone()))
            .unwrap_or_default()
    }
}

impl TensorSource for SafetensorsDir {
    fn shape(&self, name: &str) -> Option<(usize, usize)> {
        self.resolve(name).map(|(_, e)| (e.rows, e.cols))
    }

    fn dtype(&self, name: &str) -> Option<SourceDtype> {
        self.resolve(name)?.1.dtype.ok()
    }

    fn read_rows(&self, name: &str, rows: Range<usize>, out: &mut [f32]) -> Result<(), LoadError> {
        let (file_name, entry) = self.resolve(name).ok_or_else(|| LoadError::TensorMissing {
            tensor: name.to_owned(),
        })?;
        let dtype = entry.dtype.map_err(|dtype| LoadError::TensorDtype {
            path: self
                .files
                .get(entry.file)
                .map_or_else(|| self.dir.clone(), |(p, _)| p.clone()),
            tensor: file_name.to_owned(),
            dtype: format!("{dtype:?}"),
        })?;
        let range_error = || LoadError::RowRange {
            tensor: name.to_owned(),
            start: rows.start,
            end: rows.end,
            rows: entry.rows,
        };
        if rows.start > rows.end || rows.end > entry.rows {
            return Err(range_error());
        }
        let expected = (rows.end - rows.start) * entry.cols;
        if out.len() != expected {
            return Err(LoadError::OutputLength {
                tensor: name.to_owned(),
                expected,
                found: out.len(),
            });
        }
        let row_bytes = entry.cols * dtype.block_bytes();
        let src = self
            .bytes(entry)
            .get(rows.start * row_bytes..rows.end * row_bytes)
            .ok_or_else(range_error)?;
        super::gguf::dequantize(dtype, src, out);
        Ok(())
    }

    fn raw(&self, name: &str) -> Option<(SourceDtype, &[u8])> {
        let (_, entry) = self.resolve(name)?;
        Some((entry.dtype.ok()?, self.bytes(entry)))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use half::{bf16, f16};

    use super::*;
    use crate::model::test_util::TempDir;
    use crate::model::{check_llama_tensors, open_model};

    /// Serializes tensors (name, dtype name, shape, bytes) as a safetensors file.
    fn safetensors_bytes(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let mut header = BTreeMap::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        let header = serde_json::to_vec(&header).expect("json");
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&header);
        out.extend_from_slice(&data);
        out
    }

    const CONFIG: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": 4, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-05,
        "rope_theta": 100000, "max_position_embeddings": 64, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": [2, 3], "rope_scaling": null
    }"#;

    /// All tensors of the tiny config, F32 except the embedding (BF16) and q (F16); weight i of
    /// a tensor is i / 8.
    fn tiny_tensors() -> Vec<(String, &'static str, Vec<usize>, Vec<u8>)> {
        let config: ModelConfig = ModelConfig {
            vocab_size: 4,
            hidden: 8,
            intermediate: 16,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            rope_theta: 1e5,
            rms_eps: 1e-5,
            max_positions: 64,
            tied_embeddings: true,
            rope_style: RopeStyle::HalfSplit,
            bos_token_id: None,
            eos_token_id: None,
            add_bos: false,
        };
        let mut out = Vec::new();
        for (canonical, (rows, cols), required) in config.tensor_shapes() {
            if !required {
                continue;
            }
            let shape = if rows == 1 && canonical.ends_with("norm") {
                vec![cols]
            } else {
                vec![rows, cols]
            };
            let values = (0..rows * cols).map(|i| i as f32 / 8.0);
            let (dtype, bytes): (_, Vec<u8>) = match canonical.as_str() {
                "token_embd" => (
                    "BF16",
                    values
                        .flat_map(|v| bf16::from_f32(v).to_le_bytes())
                        .collect(),
                ),
                "blk.0.attn_q" => (
                    "F16",
                    values
                        .flat_map(|v| f16::from_f32(v).to_le_bytes())
                        .collect(),
                ),
                _ => ("F32", values.flat_map(f32::to_le_bytes).collect()),
            };
            out.push((hf_name(&canonical).expect("canonical"), dtype, shape, bytes));
        }
        out
    }

    fn write_model(dir: &Path, split: bool) {
        std::fs::write(dir.join("config.json"), CONFIG).expect("config");
        let tensors = tiny_tensors();
        let as_refs: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
            .collect();
        if split {
            let (a, b) = as_refs.split_at(3);
            std::fs::write(
                dir.join("model-00001-of-00002.safetensors"),
                safetensors_bytes(a),
            )
            .expect("a");
            std::fs::write(
                dir.join("model-00002-of-00002.safetensors"),
                safetensors_bytes(b),
            )
            .expect("b");
        } else {
            std::fs::write(dir.join("model.safetensors"), safetensors_bytes(&as_refs))
                .expect("model");
        }
    }

    #[test]
    fn canonical_names_map_to_hf() {
        assert_eq!(
            hf_name("token_embd").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(
            hf_name("blk.12.ffn_down").as_deref(),
            Some("model.layers.12.mlp.down_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.attn_output").as_deref(),
            Some("model.layers.0.self_attn.o_proj.weight")
        );
        assert_eq!(hf_name("blk.x.attn_q"), None);
        assert_eq!(hf_name("blk.1.nope"), None);
    }

    #[test]
    fn loads_a_sharded_directory() {
        for split in [false, true] {
            let dir = TempDir::new(if split { "st-split" } else { "st-one" });
            write_model(&dir.0, split);
            let model = SafetensorsDir::open(&dir.0).expect("open");
            let config = model.config();
            assert_eq!((config.heads, config.kv_heads, config.head_dim), (2, 1, 4));
            assert_eq!(
                (config.rope_theta, config.rope_style),
                (1e5, RopeStyle::HalfSplit)
            );
            assert_eq!(
                (config.bos_token_id, config.eos_token_id),
                (Some(1), Some(2))
            );
            check_llama_tensors(config, &model).expect("all tensors");
            assert_eq!(model.shape("output_norm"), Some((1, 8)));
            assert_eq!(model.dtype("token_embd"), Some(SourceDtype::BF16));
            let mut row = [0f32; 8];
            model
                .read_rows("token_embd", 2..3, &mut row)
                .expect("bf16 row");
            assert_eq!(row, [2.0, 2.125, 2.25, 2.375, 2.5, 2.625, 2.75, 2.875]);
            model
                .read_rows("blk.0.attn_q", 1..2, &mut row)
                .expect("f16 row");
            assert_eq!(row[0], 1.0);
            let mut two = [0f32; 32];
            model
                .read_rows("blk.0.ffn_down", 0..2, &mut two)
                .expect("f32 rows");
            assert_eq!(two[17], 17.0 / 8.0);

            let loaded = open_model(&dir.0).expect("open_model");
            assert!(loaded.tokenizer.is_none());
            assert_eq!(&loaded.config, config);
        }
    }

    #[test]
    fn bad_directories_are_named_errors() {
        let dir = TempDir::new("st-bad");
        assert!(
            matches!(SafetensorsDir::open(&dir.0), Err(LoadError::Io { .. })),
            "no config.json"
        );
        std::fs::write(dir.0.join("config.json"), CONFIG).expect("config");
        assert!(matches!(
            SafetensorsDir::open(&dir.0),
            Err(LoadError::NoWeights { .. })
        ));
        std::fs::write(
            dir.0.join("model.safetensors"),
            b"\x10\x00\x00\x00\x00\x00\x00\x00{}",
        )
        .expect("w");
        assert!(matches!(
            SafetensorsDir::open(&dir.0),
            Err(LoadError::Safetensors { .. })
        ));

        let int8 =
            safetensors_bytes(&[("model.embed_tokens.weight", "I8", vec![4, 8], vec![0; 32])]);
        std::fs::write(dir.0.join("model.safetensors"), int8).expect("w");
        let model = SafetensorsDir::open(&dir.0).expect("an I8 tensor is listed");
        assert_eq!(model.dtype("token_embd"), None);
        let err = model
            .read_rows("token_embd", 0..1, &mut [0f32; 8])
            .expect_err("I8");
        assert!(
            matches!(err, LoadError::TensorDtype { .. }) && err.to_string().contains("I8"),
            "{err}"
        );
        let err = check_llama_tensors(model.config(), &model).expect_err("incomplete");
        assert!(
            matches!(err, LoadError::TensorMissing { ref tensor } if tensor == "output_norm"),
            "{err:?}"
        );

        std::fs::write(
            dir.0.join("extra.safetensors"),
            safetensors_bytes(&[("model.embed_tokens.weight", "F32", vec![4, 8], vec![0; 128])]),
        )
        .expect("w");
        assert!(matches!(
            SafetensorsDir::open(&dir.0),
            Err(LoadError::DuplicateTensor { .. })
        ));

        let scaled = CONFIG.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"type": "llama3"}"#,
        );
        std::fs::write(dir.0.join("config.json"), scaled).expect("config");
        assert!(matches!(
            SafetensorsDir::open(&dir.0),
            Err(LoadError::Unsupported { .. })
        ));
        let mistyped = CONFIG.replace(r#""hidden_size": 8"#, r#""hidden_size": "8""#);
        std::fs::write(dir.0.join("config.json"), mistyped).expect("config");
        let err = SafetensorsDir::open(&dir.0).expect_err("string hidden_size");
        assert!(
            matches!(err, LoadError::Json { .. }) && err.to_string().contains("config.json"),
            "{err}"
        );
        let odd = CONFIG.replace(r#""hidden_size": 8"#, r#""hidden_size": 9"#);
        std::fs::write(dir.0.join("config.json"), odd).expect("config");
        let err = SafetensorsDir::open(&dir.0).expect_err("hidden 9");
        assert!(matches!(err, LoadError::InvalidConfig { .. }), "{err:?}");
    }
}

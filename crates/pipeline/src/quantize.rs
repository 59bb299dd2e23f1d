//! `pipeline quantize`: a GGUF model converted once, offline, into a GGUF file of MX matrices
//! that `--model` loads as they are.
//!
//! The steps:
//! 1. **Calibration** ([`calibrate`]): the source model, at full precision (`exact-f32`), runs
//!    over calibration text in batches ([`calibration_batches`]), and each linear
//!    layer's input second moment `H = X^T X` is summed (one per distinct input: Q, K and V
//!    share one, as do gate and up). Evaluation texts must never be calibration text;
//!    [`check_not_evaluation_text`] refuses the one this project evaluates on.
//! 2. **Rounding** ([`quantize`]): every matrix the policy stores as MX is converted, by
//!    round-to-nearest or by GPTQ against its layer's `H` (`mx_quant::gptq`, with its
//!    coordinate-descent passes after), optionally after
//!    32-point block rotations of the weights (`mx_quant::hadamard`; the kernels rotate the
//!    activations to match). The embedding table is always rounded to nearest: most of its
//!    uses are row lookups, which no input statistic describes.
//! 3. **Writing**: the source's metadata (tokenizer included) and every other tensor are carried
//!    over unchanged; the MX matrices take `pipeline`'s MX tensor types
//!    ([`crate::model::gguf::MX_TYPE_BASE`]); the policy, the method and the calibration are
//!    recorded under `pipeline.quantize.*`. Loading the file under its recorded policy (the
//!    default when no `--policy` is given) takes its blocks as stored, with no conversion.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mx_quant::QuantOptions;
use mx_quant::gptq::{self, GptqOptions};

use crate::decoder::{DecodeError, Decoder, DecoderOptions, Storage, TensorClass, WeightPolicy};
use crate::model::gguf::{self, GgufFile, OutTensor, Value};
use crate::model::{LoadError, TensorSource};

/// How the MX codes are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// Each block on its own, with the policy's scale rule.
    RoundToNearest,
    /// GPTQ against each layer's calibration Hessian.
    Gptq(GptqOptions),
}

/// What [`quantize`] makes.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    pub policy: WeightPolicy,
    pub method: Method,
    /// Block-rotate the attention and MLP matrices (never the embedding or the output head).
    pub rotate: bool,
    /// Worker threads (0 = every core).
    pub threads: usize,
}

/// Why quantizing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("{tensor}: {source}")]
    Mx {
        tensor: String,
        source: mx_quant::Error,
    },
    #[error("{0}")]
    Input(String),
}

/// The summed input statistics of every linear layer.
#[derive(Debug)]
pub struct Calibration {
    /// Tokens the model ran over.
    pub tokens: usize,
    /// Batches (sequences) they came in.
    pub batches: usize,
    /// One `(width, X^T X)` per distinct input, row-major and symmetric.
    hessians: Vec<(usize, Vec<f64>)>,
    /// Matrix name (`blk.0.attn_q`) to its input's index in `hessians`.
    by_matrix: HashMap<String, usize>,
}

/// The first bytes of a saved [`Calibration`].
const CALIBRATION_MAGIC: &[u8; 8] = b"PQCAL\x00\x00\x01";

impl Calibration {
    /// The Hessian of `matrix`'s input, `(width, values)`.
    pub fn hessian(&self, matrix: &str) -> Option<(usize, &[f64])> {
        let &(n, ref h) = &self.hessians[*self.by_matrix.get(matrix)?];
        Some((n, h))
    }

    /// Saves the statistics with `key` (what they were computed from), so another quantization
    /// of the same model and text can skip calibration ([`Calibration::load`]). Little-endian:
    /// magic, key, tokens, batches, then per input its width, the names reading it and the
    /// lower triangle of its Hessian as f64.
    ///
    /// # Errors
    /// I/O errors.
    pub fn save(&self, path: &Path, key: &str) -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        let u64s =
            |f: &mut std::io::BufWriter<std::fs::File>, v: u64| f.write_all(&v.to_le_bytes());
        f.write_all(CALIBRATION_MAGIC)?;
        u64s(&mut f, key.len() as u64)?;
        f.write_all(key.as_bytes())?;
        u64s(&mut f, self.tokens as u64)?;
        u64s(&mut f, self.batches as u64)?;
        u64s(&mut f, self.hessians.len() as u64)?;
        for (i, (n, h)) in self.hessians.iter().enumerate() {
            let mut names: Vec<&String> = self
                .by_matrix
                .iter()
                .filter(|&(_, &j)| j == i)
                .map(|(name, _)| name)
                .collect();
            names.sort();
            u64s(&mut f, *n as u64)?;
            u64s(&mut f, names.len() as u64)?;
            for name in names {
                u64s(&mut f, name.len() as u64)?;
                f.write_all(name.as_bytes())?;
            }
            for r in 0..*n {
                for v in &h[r * n..r * n + r + 1] {
                    f.write_all(&v.to_le_bytes())?;
                }
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    }

    /// Loads statistics [`Calibration::save`] wrote with the same `key`; `Ok(None)` when the
    /// file was made from something else (another model, other text or settings).
    ///
    /// # Errors
    /// [`QuantizeError::Input`] for an unreadable or malformed file.
    pub fn load(path: &Path, key: &str) -> Result<Option<Calibration>, QuantizeError> {
        let bytes = std::fs::read(path)
            .map_err(|e| QuantizeError::Input(format!("{}: {e}", path.display())))?;
        Calibration::from_bytes(&path.display().to_string(), &bytes, key)
    }

    /// [`Calibration::load`] of bytes already read; `name` names them in errors.
    ///
    /// # Errors
    /// [`QuantizeError::Input`] for malformed bytes.
    pub fn from_bytes(
        name: &str,
        bytes: &[u8],
        key: &str,
    ) -> Result<Option<Calibration>, QuantizeError> {
        let bad = |what: &str| {
            QuantizeError::Input(format!("{name}: {what}; delete it to calibrate again"))
        };
        struct Reader<'a> {
            bytes: &'a [u8],
            at: usize,
        }
        impl<'a> Reader<'a> {
            fn take(&mut self, len: usize) -> Option<&'a [u8]> {
                let end = self
                    .at
                    .checked_add(len)
                    .filter(|&e| e <= self.bytes.len())?;
                let s = &self.bytes[self.at..end];
                self.at = end;
                Some(s)
            }
            fn u64(&mut self) -> Option<u64> {
                self.take(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            }
        }
        let mut r = Reader { bytes, at: 0 };
        let truncated = || bad("the file is truncated");
        if r.take(8).ok_or_else(truncated)? != CALIBRATION_MAGIC {
            return Err(bad("not a calibration file of this version"));
        }
        let len = r.u64().ok_or_else(truncated)?;
        let stored_key = r
            .take(usize::try_from(len).map_err(|_| truncated())?)
            .ok_or_else(truncated)?;
        if stored_key != key.as_bytes() {
            return Ok(None);
        }
        let tokens = r.u64().ok_or_else(truncated)? as usize;
        let batches = r.u64().ok_or_else(truncated)? as usize;
        let count = r.u64().ok_or_else(truncated)?;
        // Each input takes at least 16 bytes, so a count past the file is refused here.
        if count > bytes.len() as u64 / 16 {
            return Err(bad("the input count does not fit the file"));
        }
        let mut cal = Calibration {
            tokens,
            batches,
            hessians: Vec::new(),
            by_matrix: HashMap::new(),
        };
        for i in 0..count as usize {
            let n = r.u64().ok_or_else(truncated)?;
            let names = r.u64().ok_or_else(truncated)?;
            if n == 0 || n > 1 << 16 || names > 1 << 10 {
                return Err(bad("an input's width or name count is out of range"));
            }
            let n = n as usize;
            for _ in 0..names {
                let len = r.u64().ok_or_else(truncated)? as usize;
                let name = r.take(len).ok_or_else(truncated)?;
                let name = std::str::from_utf8(name).map_err(|_| bad("a name is not UTF-8"))?;
                cal.by_matrix.insert(name.to_string(), i);
            }
            let tri = r.take(n * (n + 1) / 2 * 8).ok_or_else(truncated)?;
            let mut h = vec![0f64; n * n];
            let mut values = tri
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")));
            for row in 0..n {
                for c in 0..=row {
                    h[row * n + c] = values.next().expect("sized above");
                }
            }
            gptq::symmetrize(&mut h, n);
            cal.hessians.push((n, h));
        }
        Ok(Some(cal))
    }
}

/// Refuses calibration text this project evaluates perplexity on (Debian's license texts), so
/// no reported figure is measured on what the quantizer saw.
///
/// # Errors
/// [`QuantizeError::Input`] naming the file.
pub fn check_not_evaluation_text(path: &Path) -> Result<(), QuantizeError> {
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if canonical.starts_with("/usr/share/common-licenses") {
        return Err(QuantizeError::Input(format!(
            "{} is an evaluation text (perplexity is measured on the license texts); calibrate \
             on other text, such as the model's own samples or /usr/share/doc",
            path.display()
        )));
    }
    Ok(())
}

/// The calibration texts as token batches: each file tokenized, all of them end to end, cut
/// into batches of `ctx` tokens (the last partial one kept if it has at least 32), at most
/// `max_tokens` in all. A batch starts with BOS when the model expects one.
///
/// # Errors
/// Unreadable or non-UTF-8 files, an evaluation text, a tokenizer failure, or too little text.
pub fn calibration_batches(
    files: &[PathBuf],
    tokenizer: &crate::model::tokenizer::Tokenizer,
    ctx: usize,
    max_tokens: usize,
) -> Result<Vec<Vec<u32>>, QuantizeError> {
    const MAX_FILE: u64 = 64 << 20;
    if ctx < 2 {
        return Err(QuantizeError::Input(
            "--calib-ctx must be at least 2 tokens".into(),
        ));
    }
    let bos = tokenizer.bos_id().filter(|_| tokenizer.add_bos());
    let body = ctx - usize::from(bos.is_some());
    let mut stream = Vec::new();
    for path in files {
        check_not_evaluation_text(path)?;
        let len = std::fs::metadata(path)
            .map_err(|e| QuantizeError::Input(format!("{}: {e}", path.display())))?
            .len();
        if len > MAX_FILE {
            return Err(QuantizeError::Input(format!(
                "{} is {len} bytes; calibration files are capped at {MAX_FILE} (split it)",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            QuantizeError::Input(format!(
                "{}: {e} (calibration files are UTF-8 text)",
                path.display()
            ))
        })?;
        let tokens = tokenizer
            .encode(&text, false)
            .map_err(|e| QuantizeError::Input(format!("tokenizing {}: {e}", path.display())))?;
        stream.extend(tokens);
        if stream.len() >= max_tokens {
            break;
        }
    }
    stream.truncate(max_tokens.min(stream.len()));
    let batches: Vec<Vec<u32>> = stream
        .chunks(body)
        .filter(|c| c.len() >= 32)
        .map(|c| bos.into_iter().chain(c.iter().copied()).collect())
        .collect();
    if batches.is_empty() {
        return Err(QuantizeError::Input(
            "the calibration files hold fewer than 32 tokens; give more text with --calib".into(),
        ));
    }
    Ok(batches)
}

/// Runs `decoder` over `batches` and sums every linear layer's input statistics on `threads`
/// threads (0 = every core). `progress(done, total)` is called after each batch.
///
/// # Errors
/// What the decoder reports, or an MX error for a layer whose width is not whole blocks.
pub fn calibrate(
    decoder: &mut Decoder,
    batches: &[Vec<u32>],
    threads: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Calibration, QuantizeError> {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut cal = Calibration {
        tokens: 0,
        batches: 0,
        hessians: Vec::new(),
        by_matrix: HashMap::new(),
    };
    let mut failure = None;
    for (i, batch) in batches.iter().enumerate() {
        decoder.observe_linear_inputs(batch, |names, rows| {
            let Some(first) = names.first() else { return };
            let width = rows.len() / batch.len();
            let index = *cal.by_matrix.entry(first.to_string()).or_insert_with(|| {
                cal.hessians.push((width, vec![0f64; width * width]));
                cal.hessians.len() - 1
            });
            for name in &names[1..] {
                cal.by_matrix.insert(name.to_string(), index);
            }
            let (n, h) = &mut cal.hessians[index];
            if let Err(e) = gptq::accumulate_hessian_threads(h, *n, rows, threads) {
                failure.get_or_insert(QuantizeError::Mx {
                    tensor: first.to_string(),
                    source: e,
                });
            }
        })?;
        if let Some(e) = failure.take() {
            return Err(e);
        }
        cal.tokens += batch.len();
        cal.batches += 1;
        progress(i + 1, batches.len());
    }
    for (n, h) in &mut cal.hessians {
        gptq::symmetrize(h, *n);
    }
    Ok(cal)
}

/// What [`quantize`] did.
#[derive(Clone, Debug, Default)]
pub struct QuantizeReport {
    /// Matrices converted to MX.
    pub converted: usize,
    /// Of those, rounded by GPTQ.
    pub by_gptq: usize,
    /// Of those, block-rotated.
    pub rotated: usize,
    /// Tensors carried over as the source stores them.
    pub carried: usize,
    /// Mean bits per weight over the decoder's matrices, as written.
    pub bits_per_weight: f64,
    /// Bytes written.
    pub file_bytes: u64,
}

/// Converts `source` (a GGUF file) as `options` say and writes the result to `out`.
/// `calibration` is required for [`Method::Gptq`]. `progress(done, total)` is called per tensor.
///
/// # Errors
/// A missing Hessian, bad weights, or an I/O error writing `out`.
pub fn quantize(
    source: &GgufFile,
    calibration: Option<&Calibration>,
    options: &QuantizeOptions,
    out: &Path,
    describe_calibration: &str,
    mut progress: impl FnMut(usize, usize),
) -> Result<QuantizeReport, QuantizeError> {
    let mut report = QuantizeReport::default();
    let threads = match options.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let (mut bits, mut params) = (0f64, 0usize);
    let mut tensors = Vec::with_capacity(source.tensors().len());
    let mut rotated_names = Vec::new();
    // Rotated Hessians, made once per shared input.
    let mut rotated_hessians: HashMap<usize, Vec<f64>> = HashMap::new();
    let total = source.tensors().len();
    for (i, info) in source.tensors().iter().enumerate() {
        let canonical = info.name.strip_suffix(".weight").unwrap_or(&info.name);
        let (rows, cols) = info.shape();
        let class = TensorClass::of(canonical);
        let format = match class.map(|c| options.policy.storage(c)) {
            Some(Storage::Mx(f)) if cols.is_multiple_of(mx_quant::BLOCK) => Some(f),
            _ => None,
        };
        let Some(format) = format else {
            if let Some(dtype) = info.ggml_type.source_dtype().filter(|_| class.is_some()) {
                bits += f64::from(dtype.bits_per_weight()) * (rows * cols) as f64;
                params += rows * cols;
            }
            tensors.push(OutTensor {
                name: info.name.clone(),
                dims: info.dims.clone(),
                type_id: info.ggml_type.id(),
                data: source.tensor_data(info).to_vec(),
            });
            report.carried += 1;
            progress(i + 1, total);
            continue;
        };
        let mx_err = |source| QuantizeError::Mx {
            tensor: info.name.clone(),
            source,
        };
        let mut w = vec![0f32; rows * cols];
        source.read_rows(canonical, 0..rows, &mut w)?;
        let rotate = options.rotate
            && !matches!(
                class,
                Some(TensorClass::Embedding | TensorClass::Output) | None
            );
        if rotate {
            mx_quant::hadamard::rotate_weights(&mut w).map_err(mx_err)?;
        }
        let per_row = cols / mx_quant::BLOCK;
        let mut scales = vec![0u8; rows * per_row];
        let mut packed = vec![0u8; mx_quant::layout::packed_len(format, rows * cols)];
        let gptq_options = match options.method {
            Method::Gptq(g) if class != Some(TensorClass::Embedding) => Some(g),
            _ => None,
        };
        if let Some(g) = gptq_options {
            let cal = calibration.ok_or_else(|| {
                QuantizeError::Input("GPTQ needs calibration text (--calib)".into())
            })?;
            let index = *cal.by_matrix.get(canonical).ok_or_else(|| {
                QuantizeError::Input(format!(
                    "calibration saw no input of {canonical}; the model's program does not read it"
                ))
            })?;
            let (n, h) = &cal.hessians[index];
            if *n != cols {
                return Err(QuantizeError::Input(format!(
                    "{canonical} has {cols} columns but its calibrated input is {n} wide"
                )));
            }
            let h: &[f64] = if rotate {
                rotated_hessians.entry(index).or_insert_with(|| {
                    let mut r = h.clone();
                    mx_quant::hadamard::rotate_hessian(&mut r, *n)
                        .expect("a block-multiple width, checked above");
                    r
                })
            } else {
                h
            };
            let prepared = gptq::Prepared::new(h, cols, g).map_err(mx_err)?;
            quantize_rows(threads, cols, &w, &mut scales, &mut packed, |w, s, p| {
                prepared.quantize(format, w, s, p)
            })
            .map_err(mx_err)?;
            report.by_gptq += 1;
        } else {
            let q = QuantOptions {
                scale: options.policy.scale,
                ..QuantOptions::default()
            };
            quantize_rows(threads, cols, &w, &mut scales, &mut packed, |w, s, p| {
                mx_quant::bulk::quantize(format, q, w, s, p)
            })
            .map_err(mx_err)?;
        }
        // Blocks as the GGUF type stores them: the scale byte, then the block's codes.
        let block_bytes = mx_quant::layout::packed_len(format, mx_quant::BLOCK);
        let mut data = Vec::with_capacity(scales.len() * (1 + block_bytes));
        for (s, codes) in scales.iter().zip(packed.chunks_exact(block_bytes)) {
            data.push(*s);
            data.extend_from_slice(codes);
        }
        if rotate {
            rotated_names.push(info.name.clone());
            report.rotated += 1;
        }
        bits += format.bits_per_element() * (rows * cols) as f64;
        params += rows * cols;
        tensors.push(OutTensor {
            name: info.name.clone(),
            dims: info.dims.clone(),
            type_id: gguf::mx_type_id(format),
            data,
        });
        report.converted += 1;
        progress(i + 1, total);
    }
    report.bits_per_weight = bits / params.max(1) as f64;
    let method = match options.method {
        Method::RoundToNearest => format!("round-to-nearest, scale {:?}", options.policy.scale),
        Method::Gptq(g) => format!(
            "gptq, damp {}, order {:?}, scale {:?}, {} refinement passes (embedding rounded to \
             nearest)",
            g.damp, g.order, g.scale, g.refine_passes
        ),
    };
    let mut metadata: Vec<(String, Value)> = source
        .metadata()
        .filter(|(k, _)| !k.starts_with("pipeline.quantize.") && *k != "general.file_type")
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let string = |s: &str| Value::String(s.to_string());
    metadata.push((gguf::POLICY_KEY.into(), string(&options.policy.name)));
    metadata.push(("pipeline.quantize.method".into(), string(&method)));
    metadata.push((
        "pipeline.quantize.calibration".into(),
        string(describe_calibration),
    ));
    metadata.push((
        "pipeline.quantize.source".into(),
        string(&source.path().display().to_string()),
    ));
    metadata.push((
        gguf::BLOCK_ROTATION_KEY.into(),
        Value::Array(
            gguf::ValueType::String,
            rotated_names.into_iter().map(Value::String).collect(),
        ),
    ));
    gguf::write(out, &metadata, &tensors)?;
    report.file_bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(report)
}

/// Runs `f` over `threads` contiguous shares of the rows (each quantizer is row-independent).
fn quantize_rows(
    threads: usize,
    cols: usize,
    w: &[f32],
    scales: &mut [u8],
    packed: &mut [u8],
    f: impl Fn(&[f32], &mut [u8], &mut [u8]) -> Result<(), mx_quant::Error> + Sync,
) -> Result<(), mx_quant::Error> {
    let rows = w.len() / cols;
    let per_row = cols / mx_quant::BLOCK;
    let row_bytes = packed.len() / rows.max(1);
    let share = rows.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let jobs: Vec<_> = w
            .chunks(share * cols)
            .zip(scales.chunks_mut(share * per_row))
            .zip(packed.chunks_mut(share * row_bytes))
            .map(|((w, s), p)| scope.spawn(|| f(w, s, p)))
            .collect();
        jobs.into_iter()
            .try_for_each(|j| j.join().expect("a quantizer thread panicked"))
    })
}

/// Opens `model` (GGUF) at full precision on the CPU NPU for calibration: `exact-f32` (the
/// file's values in f32, f32 activations), batches of `ctx` tokens.
///
/// # Errors
/// As [`crate::llm::open_decoder`].
pub fn calibration_decoder(
    model: &Path,
    ctx: usize,
    threads: usize,
) -> Result<(Decoder, Option<crate::model::tokenizer::Tokenizer>), DecodeError> {
    let options = DecoderOptions {
        policy: WeightPolicy::parse("exact-f32")?,
        ctx,
        max_batch: ctx,
        max_logit_rows: 1,
        cache: None,
        ..DecoderOptions::default()
    };
    crate::llm::open_decoder(model, options, threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_statistics_load_back_under_their_key_only() {
        let mut h = vec![0f64; 32 * 32];
        let x: Vec<f32> = (0..32 * 5).map(|i| (i % 7) as f32 - 3.0).collect();
        gptq::accumulate_hessian(&mut h, 32, &x).unwrap();
        gptq::symmetrize(&mut h, 32);
        let cal = Calibration {
            tokens: 5,
            batches: 1,
            hessians: vec![(32, h.clone())],
            by_matrix: [
                ("blk.0.attn_q".to_string(), 0),
                ("blk.0.attn_k".to_string(), 0),
            ]
            .into(),
        };
        let path = std::env::temp_dir().join(format!("pq-cal-{}.bin", std::process::id()));
        cal.save(&path, "key").unwrap();
        let back = Calibration::load(&path, "key").unwrap().unwrap();
        assert_eq!((back.tokens, back.batches), (5, 1));
        assert_eq!(back.hessian("blk.0.attn_k").unwrap(), (32, &h[..]));
        assert!(Calibration::load(&path, "another key").unwrap().is_none());
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let e = Calibration::from_bytes("cut.bin", &bytes[..bytes.len() - 9], "key").unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    #[test]
    fn the_evaluation_text_is_refused_as_calibration() {
        let e = check_not_evaluation_text(Path::new("/usr/share/common-licenses/Apache-2.0"));
        assert!(matches!(e, Err(QuantizeError::Input(m)) if m.contains("evaluation text")));
        assert!(check_not_evaluation_text(Path::new("/usr/share/doc/README")).is_ok());
    }
}

//! How much a format costs in accuracy, measured; and per-tensor format policies.
//!
//! [`ErrorReport`] compares a tensor with its MX round trip (RMSE, SQNR, largest error).
//! [`Policy`] maps tensor names to a format and mode, first matching rule wins, so a loader can
//! say "embeddings INT8, attention FP6, MLP FP4" in one place and report what it chose.

use crate::Error;
use crate::format::{ElemFormat, QuantOptions};
use crate::layout::packed_len;

/// The error of one tensor's MX round trip.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ErrorReport {
    pub format: ElemFormat,
    pub options: QuantOptions,
    /// Elements compared (non-finite inputs are left out).
    pub elements: usize,
    /// Root mean squared error.
    pub rmse: f64,
    /// Signal-to-quantization-noise ratio in dB: `10 log10(sum x^2 / sum (x - q)^2)`; infinite
    /// when the round trip is exact.
    pub sqnr_db: f64,
    /// Largest absolute error.
    pub max_abs_error: f64,
    /// Storage cost including the shared scales.
    pub bits_per_element: f64,
}

impl ErrorReport {
    /// Quantizes and dequantizes `data` (zero-padded to whole blocks) and measures the error.
    pub fn measure(
        format: ElemFormat,
        options: QuantOptions,
        data: &[f32],
    ) -> Result<ErrorReport, Error> {
        let padded = crate::bulk::pad_to_block(data);
        let mut scales = vec![0u8; padded.len() / crate::BLOCK];
        let mut packed = vec![0u8; packed_len(format, padded.len())];
        crate::bulk::quantize(format, options, &padded, &mut scales, &mut packed)?;
        let mut back = vec![0f32; padded.len()];
        crate::bulk::dequantize(format, &scales, &packed, &mut back)?;
        let (mut signal, mut noise, mut max_abs_error, mut elements) = (0f64, 0f64, 0f64, 0usize);
        for (&x, &q) in data.iter().zip(&back) {
            if !x.is_finite() {
                continue;
            }
            let (x, q) = (f64::from(x), f64::from(q));
            signal += x * x;
            noise += (x - q) * (x - q);
            max_abs_error = max_abs_error.max((x - q).abs());
            elements += 1;
        }
        Ok(ErrorReport {
            format,
            options,
            elements,
            rmse: if elements == 0 {
                0.0
            } else {
                (noise / elements as f64).sqrt()
            },
            sqnr_db: 10.0 * (signal / noise).log10(),
            max_abs_error,
            bits_per_element: format.bits_per_element(),
        })
    }

    /// One report per format, in [`ElemFormat::ALL`] order.
    pub fn all_formats(options: QuantOptions, data: &[f32]) -> Result<Vec<ErrorReport>, Error> {
        ElemFormat::ALL
            .iter()
            .map(|&f| ErrorReport::measure(f, options, data))
            .collect()
    }
}

impl std::fmt::Display for ErrorReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:9} {:5.2} bits/elem  rmse {:.3e}  sqnr {:6.2} dB  max err {:.3e}",
            self.format.name(),
            self.bits_per_element,
            self.rmse,
            self.sqnr_db,
            self.max_abs_error
        )
    }
}

/// What a policy decides for one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Store in MX with this format and mode.
    Mx {
        format: ElemFormat,
        options: QuantOptions,
    },
    /// Keep the source values (no requantization): the quality baseline.
    Keep,
}

/// Per-tensor format choice: ordered rules of (name pattern, choice), first match wins.
///
/// A pattern matches when the tensor name contains it (`"ffn_"` matches `blk.3.ffn_up.weight`);
/// `*` inside a pattern matches any run of characters (`"blk.*.attn_"`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub rules: Vec<(String, Choice)>,
    pub default: Choice,
}

impl Policy {
    /// Every tensor in one format and mode.
    pub fn uniform(format: ElemFormat, options: QuantOptions) -> Policy {
        Policy {
            rules: Vec::new(),
            default: Choice::Mx { format, options },
        }
    }

    /// Adds a rule after the existing ones.
    pub fn rule(mut self, pattern: &str, choice: Choice) -> Policy {
        self.rules.push((pattern.to_owned(), choice));
        self
    }

    /// The choice for `tensor_name`.
    pub fn choose(&self, tensor_name: &str) -> Choice {
        self.rules
            .iter()
            .find(|(pattern, _)| contains_glob(tensor_name, pattern))
            .map_or(self.default, |(_, choice)| *choice)
    }
}

/// Whether `name` contains a run matching `pattern`, where `*` matches any characters.
fn contains_glob(name: &str, pattern: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(start) = name.find(first) else {
        return false;
    };
    let mut rest = &name[start + first.len()..];
    for part in parts {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScaleRule;

    #[test]
    fn reports_rank_formats_by_precision() {
        let data: Vec<f32> = (0..4096)
            .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i % 13) as f32))
            .collect();
        let reports = ErrorReport::all_formats(QuantOptions::default(), &data).unwrap();
        let sqnr = |f: ElemFormat| reports.iter().find(|r| r.format == f).unwrap().sqnr_db;
        assert!(sqnr(ElemFormat::Int8) > sqnr(ElemFormat::Fp8E4M3));
        assert!(sqnr(ElemFormat::Fp8E4M3) > sqnr(ElemFormat::Fp6E2M3));
        assert!(sqnr(ElemFormat::Fp6E2M3) > sqnr(ElemFormat::Fp4E2M1));
        let floor =
            ErrorReport::measure(ElemFormat::Fp4E2M1, QuantOptions::default(), &data).unwrap();
        let mse = ErrorReport::measure(
            ElemFormat::Fp4E2M1,
            QuantOptions {
                scale: ScaleRule::MseSearch,
                ..Default::default()
            },
            &data,
        )
        .unwrap();
        assert!(mse.rmse <= floor.rmse);
        let exact = ErrorReport::measure(
            ElemFormat::Fp8E4M3,
            QuantOptions::default(),
            &[1.0, 2.0, -0.5],
        )
        .unwrap();
        assert_eq!(exact.rmse, 0.0);
        assert!(exact.sqnr_db.is_infinite());
    }

    #[test]
    fn policies_pick_the_first_matching_rule() {
        let mx = |format| Choice::Mx {
            format,
            options: QuantOptions::default(),
        };
        let policy = Policy::uniform(ElemFormat::Fp4E2M1, QuantOptions::default())
            .rule("token_embd", mx(ElemFormat::Int8))
            .rule("blk.*.attn_", mx(ElemFormat::Fp6E2M3))
            .rule("norm", Choice::Keep);
        assert_eq!(policy.choose("token_embd.weight"), mx(ElemFormat::Int8));
        assert_eq!(
            policy.choose("blk.7.attn_q.weight"),
            mx(ElemFormat::Fp6E2M3)
        );
        assert_eq!(
            policy.choose("blk.7.ffn_down.weight"),
            mx(ElemFormat::Fp4E2M1)
        );
        assert_eq!(
            policy.choose("blk.7.attn_norm.weight"),
            mx(ElemFormat::Fp6E2M3)
        );
        assert_eq!(policy.choose("output_norm.weight"), Choice::Keep);
    }
}

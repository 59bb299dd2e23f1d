//! The element formats of OCP MX v1.0 and the options that choose a quantization mode.

/// Elements per MX block: every block shares one E8M0 scale.
pub const BLOCK: usize = 32;

/// The E8M0 scale byte that marks a block holding NaN or infinity: all its values decode to NaN.
pub const SCALE_NAN: u8 = 0xFF;

/// The E8M0 exponent bias: scale byte `b` means `2^(b - 127)`.
pub const SCALE_BIAS: i32 = 127;

/// An MX element format (OCP MX v1.0, section 5.3).
///
/// Codes are the element's raw bit pattern in the low bits of a byte: E2M1 has its sign at bit 3,
/// E2M3 and E3M2 at bit 5, FP8 is the usual byte, INT8 is two's complement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemFormat {
    /// FP8 E5M2: max normal 57344; saturating, so its Inf/NaN codes are never produced.
    Fp8E5M2,
    /// FP8 E4M3: max normal 448; the all-ones mantissa at the top exponent is NaN.
    Fp8E4M3,
    /// FP6 E3M2: max normal 28.
    Fp6E3M2,
    /// FP6 E2M3: max normal 7.5.
    Fp6E2M3,
    /// FP4 E2M1: max normal 6.
    Fp4E2M1,
    /// INT8 with an implicit scale of 2^-6: values `k / 64` for `k` in `-127..=127`.
    Int8,
}

impl ElemFormat {
    /// Every format, in the order the OCP spec lists them.
    pub const ALL: [ElemFormat; 6] = [
        ElemFormat::Fp8E5M2,
        ElemFormat::Fp8E4M3,
        ElemFormat::Fp6E3M2,
        ElemFormat::Fp6E2M3,
        ElemFormat::Fp4E2M1,
        ElemFormat::Int8,
    ];

    /// Bits per element in a packed layout (4, 6 or 8).
    pub const fn bits(self) -> u32 {
        match self {
            ElemFormat::Fp8E5M2 | ElemFormat::Fp8E4M3 | ElemFormat::Int8 => 8,
            ElemFormat::Fp6E3M2 | ElemFormat::Fp6E2M3 => 6,
            ElemFormat::Fp4E2M1 => 4,
        }
    }

    /// Exponent bits (0 for INT8).
    pub const fn exp_bits(self) -> u32 {
        match self {
            ElemFormat::Fp8E5M2 => 5,
            ElemFormat::Fp8E4M3 => 4,
            ElemFormat::Fp6E3M2 => 3,
            ElemFormat::Fp6E2M3 | ElemFormat::Fp4E2M1 => 2,
            ElemFormat::Int8 => 0,
        }
    }

    /// Mantissa bits (for INT8: the 6 fraction bits of `k / 64`).
    pub const fn mant_bits(self) -> u32 {
        match self {
            ElemFormat::Fp8E5M2 | ElemFormat::Fp6E3M2 => 2,
            ElemFormat::Fp8E4M3 | ElemFormat::Fp6E2M3 => 3,
            ElemFormat::Fp4E2M1 => 1,
            ElemFormat::Int8 => 6,
        }
    }

    /// Exponent bias of a floating-point element (0 for INT8).
    pub const fn exp_bias(self) -> i32 {
        match self {
            ElemFormat::Fp8E5M2 => 15,
            ElemFormat::Fp8E4M3 => 7,
            ElemFormat::Fp6E3M2 => 3,
            ElemFormat::Fp6E2M3 | ElemFormat::Fp4E2M1 => 1,
            ElemFormat::Int8 => 0,
        }
    }

    /// `emax_elem`: the exponent of the largest normal, subtracted from `floor(log2(amax))` to get
    /// the shared scale exponent.
    pub const fn emax(self) -> i32 {
        match self {
            ElemFormat::Fp8E5M2 => 15,
            ElemFormat::Fp8E4M3 => 8,
            ElemFormat::Fp6E3M2 => 4,
            ElemFormat::Fp6E2M3 | ElemFormat::Fp4E2M1 => 2,
            ElemFormat::Int8 => 0,
        }
    }

    /// The smallest normal exponent `1 - bias` (for INT8, 0: its grid is uniform).
    pub const fn emin(self) -> i32 {
        match self {
            ElemFormat::Int8 => 0,
            _ => 1 - self.exp_bias(),
        }
    }

    /// Largest finite magnitude; quantization saturates here.
    pub const fn max_normal(self) -> f32 {
        match self {
            ElemFormat::Fp8E5M2 => 57344.0,
            ElemFormat::Fp8E4M3 => 448.0,
            ElemFormat::Fp6E3M2 => 28.0,
            ElemFormat::Fp6E2M3 => 7.5,
            ElemFormat::Fp4E2M1 => 6.0,
            ElemFormat::Int8 => 127.0 / 64.0,
        }
    }

    /// Bit that holds the sign in a code (INT8: its two's complement sign bit).
    pub const fn sign_bit(self) -> u8 {
        1 << (self.bits() - 1)
    }

    /// Number of distinct codes (16, 64 or 256).
    pub const fn code_count(self) -> usize {
        1 << self.bits()
    }

    /// Storage cost with the shared scale: `(32 * bits + 8) / 32` bits per element.
    pub fn bits_per_element(self) -> f64 {
        (BLOCK as f64 * f64::from(self.bits()) + 8.0) / BLOCK as f64
    }

    /// Lower-case name as used in fixtures and reports (`fp4_e2m1`, `int8`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ElemFormat::Fp8E5M2 => "fp8_e5m2",
            ElemFormat::Fp8E4M3 => "fp8_e4m3",
            ElemFormat::Fp6E3M2 => "fp6_e3m2",
            ElemFormat::Fp6E2M3 => "fp6_e2m3",
            ElemFormat::Fp4E2M1 => "fp4_e2m1",
            ElemFormat::Int8 => "int8",
        }
    }

    /// Parses [`ElemFormat::name`] (also accepts `mxfp4`, `mxfp8_e4m3`, ... and `mxint8`).
    pub fn from_name(name: &str) -> Option<ElemFormat> {
        let n = name.to_ascii_lowercase();
        let n = n.strip_prefix("mx").unwrap_or(&n);
        Some(match n {
            "fp8_e5m2" | "e5m2" => ElemFormat::Fp8E5M2,
            "fp8_e4m3" | "e4m3" | "fp8" => ElemFormat::Fp8E4M3,
            "fp6_e3m2" | "e3m2" => ElemFormat::Fp6E3M2,
            "fp6_e2m3" | "e2m3" | "fp6" => ElemFormat::Fp6E2M3,
            "fp4_e2m1" | "e2m1" | "fp4" => ElemFormat::Fp4E2M1,
            "int8" => ElemFormat::Int8,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ElemFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the shared exponent is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ScaleRule {
    /// OCP MX v1.0: `X = floor(log2(amax)) - emax_elem`. Elements above the max normal after
    /// scaling saturate. torchao calls this FLOOR.
    #[default]
    Floor,
    /// Round the scale up: the smallest `X` with `max_normal * 2^X >= amax`, so no element
    /// saturates (NVIDIA's and torchao's RCEIL). Costs up to one binade of resolution.
    Rceil,
    /// Try the spec exponent and its neighbours (`X - 1`, `X`, `X + 1`) and keep the one with the
    /// smallest squared error over the block. Never worse than [`ScaleRule::Floor`] on a block.
    MseSearch,
}

/// How a scaled element is rounded to the element grid.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// Round to nearest, ties to even (OCP MX v1.0, ml_dtypes casts).
    #[default]
    NearestEven,
    /// Round to nearest, ties away from zero (microxcaling's default).
    NearestAway,
}

/// A quantization mode: [`Default`] is the OCP MX v1.0 algorithm (FLOOR scale, ties to even).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuantOptions {
    pub scale: ScaleRule,
    pub rounding: Rounding,
}

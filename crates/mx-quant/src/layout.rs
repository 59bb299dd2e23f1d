//! Packed storage of element codes: the linear layout and llama.cpp's `block_mxfp4`.
//!
//! Linear layout (one code stream, scales kept apart):
//! - FP4: element `2i` in the low nibble of byte `i`, element `2i + 1` in the high nibble;
//! - FP6: four elements in three bytes, as a little-endian 24-bit word with element 0 in the
//!   lowest six bits;
//! - FP8 and INT8: one byte each.
//!
//! GGUF's `block_mxfp4` (17 bytes per 32 elements) interleaves the scale with the codes: byte 0 is
//! the E8M0 scale, then byte `1 + j` holds element `j` in its low nibble and element `j + 16` in
//! its high nibble, so GGUF MXFP4 tensors load and save without conversion of meaning.

use crate::Error;
use crate::format::{BLOCK, ElemFormat};

/// Bytes that `elements` codes of `format` occupy in the linear layout. `elements` must be a
/// multiple of [`BLOCK`], which keeps every layout byte-aligned.
pub const fn packed_len(format: ElemFormat, elements: usize) -> usize {
    elements / 8 * format.bits() as usize
}

/// Packs one code per byte (`codes`) into the linear layout (`out`).
pub fn pack_codes(format: ElemFormat, codes: &[u8], out: &mut [u8]) -> Result<(), Error> {
    check_block_multiple(codes.len())?;
    check_len("packed output", packed_len(format, codes.len()), out.len())?;
    let per_block = packed_len(format, BLOCK);
    for (block, bytes) in codes
        .chunks_exact(BLOCK)
        .zip(out.chunks_exact_mut(per_block))
    {
        let block: &[u8; BLOCK] = block.try_into().expect("chunks_exact yields whole blocks");
        pack_block(format, block, bytes);
    }
    Ok(())
}

/// Unpacks the linear layout (`packed`) into one code per byte (`codes`).
pub fn unpack_codes(format: ElemFormat, packed: &[u8], codes: &mut [u8]) -> Result<(), Error> {
    check_block_multiple(codes.len())?;
    check_len(
        "packed input",
        packed_len(format, codes.len()),
        packed.len(),
    )?;
    let per_block = packed_len(format, BLOCK);
    for (block, bytes) in codes
        .chunks_exact_mut(BLOCK)
        .zip(packed.chunks_exact(per_block))
    {
        block.copy_from_slice(&unpack_block(format, bytes));
    }
    Ok(())
}

/// Packs one block's codes into its linear-layout bytes (`out` is exactly one block long).
pub(crate) fn pack_block(format: ElemFormat, codes: &[u8; BLOCK], out: &mut [u8]) {
    match format.bits() {
        8 => out.copy_from_slice(codes),
        4 => {
            for (o, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
                *o = (pair[0] & 0x0F) | (pair[1] << 4);
            }
        }
        _ => {
            for (o, quad) in out.chunks_exact_mut(3).zip(codes.chunks_exact(4)) {
                let word = u32::from(quad[0] & 0x3F)
                    | u32::from(quad[1] & 0x3F) << 6
                    | u32::from(quad[2] & 0x3F) << 12
                    | u32::from(quad[3] & 0x3F) << 18;
                o.copy_from_slice(&word.to_le_bytes()[..3]);
            }
        }
    }
}

/// Unpacks one block's linear-layout bytes into one code per byte.
pub(crate) fn unpack_block(format: ElemFormat, bytes: &[u8]) -> [u8; BLOCK] {
    let mut codes = [0u8; BLOCK];
    match format.bits() {
        8 => codes.copy_from_slice(bytes),
        4 => {
            for (pair, &b) in codes.chunks_exact_mut(2).zip(bytes) {
                pair[0] = b & 0x0F;
                pair[1] = b >> 4;
            }
        }
        _ => {
            for (quad, b) in codes.chunks_exact_mut(4).zip(bytes.chunks_exact(3)) {
                let word = u32::from_le_bytes([b[0], b[1], b[2], 0]);
                for (i, c) in quad.iter_mut().enumerate() {
                    *c = ((word >> (6 * i)) & 0x3F) as u8;
                }
            }
        }
    }
    codes
}

/// llama.cpp's `block_mxfp4`: an E8M0 scale and 32 E2M1 codes, 17 bytes, no padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockMxfp4 {
    /// E8M0 shared scale.
    pub e: u8,
    /// Byte `j`: element `j` in the low nibble, element `j + 16` in the high nibble.
    pub qs: [u8; BLOCK / 2],
}

// The GGUF on-disk layout: a mismatch here would misread every MXFP4 tensor.
const _: () = assert!(size_of::<BlockMxfp4>() == 17);
const _: () = assert!(align_of::<BlockMxfp4>() == 1);
const _: () = assert!(std::mem::offset_of!(BlockMxfp4, qs) == 1);

impl BlockMxfp4 {
    /// Builds a block from a scale and 32 E2M1 codes (one per byte).
    pub fn from_codes(scale: u8, codes: &[u8; BLOCK]) -> BlockMxfp4 {
        let mut qs = [0u8; BLOCK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (codes[j] & 0x0F) | (codes[j + 16] << 4);
        }
        BlockMxfp4 { e: scale, qs }
    }

    /// The 32 E2M1 codes, one per byte.
    pub fn codes(&self) -> [u8; BLOCK] {
        let mut codes = [0u8; BLOCK];
        for (j, &q) in self.qs.iter().enumerate() {
            codes[j] = q & 0x0F;
            codes[j + 16] = q >> 4;
        }
        codes
    }
}

pub(crate) fn check_block_multiple(len: usize) -> Result<(), Error> {
    if len.is_multiple_of(BLOCK) {
        Ok(())
    } else {
        Err(Error::NotBlockMultiple { len })
    }
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), Error> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layouts_are_bit_exact() {
        let codes: Vec<u8> = (0..64u8).collect();
        let mut out = vec![0u8; packed_len(ElemFormat::Fp4E2M1, 64)];
        let nibbles: Vec<u8> = codes.iter().map(|c| c & 0xF).collect();
        pack_codes(ElemFormat::Fp4E2M1, &nibbles, &mut out).unwrap();
        assert_eq!(out[0], 0x10);
        assert_eq!(out[1], 0x32);
        let mut back = vec![0u8; 64];
        unpack_codes(ElemFormat::Fp4E2M1, &out, &mut back).unwrap();
        assert_eq!(back, nibbles);

        let mut out = vec![0u8; packed_len(ElemFormat::Fp6E2M3, 64)];
        pack_codes(ElemFormat::Fp6E2M3, &codes, &mut out).unwrap();
        // Elements 0..4 = 0, 1, 2, 3: word 0 | 1 << 6 | 2 << 12 | 3 << 18 = 0x0C2040.
        assert_eq!(&out[..3], &[0x40, 0x20, 0x0C]);
        unpack_codes(ElemFormat::Fp6E2M3, &out, &mut back).unwrap();
        assert_eq!(back, codes);
    }

    #[test]
    fn gguf_block_mxfp4_layout() {
        let codes: [u8; BLOCK] = std::array::from_fn(|i| (i % 16) as u8);
        let block = BlockMxfp4::from_codes(130, &codes);
        let bytes = bytemuck::bytes_of(&block);
        assert_eq!(bytes[0], 130);
        // Byte 1 + j: element j low, element j + 16 high.
        assert_eq!(bytes[1], codes[0] | codes[16] << 4);
        assert_eq!(bytes[16], codes[15] | codes[31] << 4);
        assert_eq!(block.codes(), codes);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = [0u8; 16];
        assert_eq!(
            pack_codes(ElemFormat::Fp4E2M1, &[0; 31], &mut out),
            Err(Error::NotBlockMultiple { len: 31 })
        );
        assert!(matches!(
            pack_codes(ElemFormat::Fp8E4M3, &[0; 32], &mut out),
            Err(Error::LengthMismatch { .. })
        ));
    }
}

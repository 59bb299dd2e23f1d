//! Page storage: every block's K and V for every layer, in one uvm-alloc buffer, in f32, f16,
//! bf16, MXFP8 (E4M3) or MXFP4 (E2M1).
//!
//! # Layout
//! A block holds, for each layer, K then V, each `[kv_head][token][head_dim]`. One token-head
//! vector is `head_dim` elements: raw little-endian values for f32/f16/bf16; for MX, the packed
//! codes (mx-quant's linear layout) followed by one E8M0 scale per 32 elements, so the MX blocks
//! run along `head_dim` as the format intends. Blocks are padded to 128 bytes, and the buffer
//! starts page aligned, so every block is 128-byte aligned.

use mx_quant::layout::packed_len;
use mx_quant::{ElemFormat, QuantOptions};
use uvm_alloc::{Access, Allocator, AllocatorDesc, StageCopies, UnifiedBuffer};

use crate::Error;
use crate::pool::{Appended, BlockId, BlockManager, SeqId};

/// How K/V values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageDtype {
    F32,
    F16,
    Bf16,
    /// OCP MXFP8 E4M3, 32-element blocks along head_dim.
    Mxfp8,
    /// OCP MXFP4 E2M1, 32-element blocks along head_dim.
    Mxfp4,
}

impl PageDtype {
    /// Every dtype.
    pub const ALL: [PageDtype; 5] = [
        PageDtype::F32,
        PageDtype::F16,
        PageDtype::Bf16,
        PageDtype::Mxfp8,
        PageDtype::Mxfp4,
    ];

    fn mx(self) -> Option<ElemFormat> {
        match self {
            PageDtype::Mxfp8 => Some(ElemFormat::Fp8E4M3),
            PageDtype::Mxfp4 => Some(ElemFormat::Fp4E2M1),
            _ => None,
        }
    }

    /// Bytes of one `head_dim`-element vector.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        match self {
            PageDtype::F32 => 4 * head_dim,
            PageDtype::F16 | PageDtype::Bf16 => 2 * head_dim,
            PageDtype::Mxfp8 | PageDtype::Mxfp4 => {
                packed_len(self.mx().expect("mx dtype"), head_dim) + head_dim / mx_quant::BLOCK
            }
        }
    }
}

/// The shape of a model's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
    pub dtype: PageDtype,
}

impl KvLayout {
    /// Bytes of one block (all layers, K and V), padded to 128.
    pub fn block_bytes(&self) -> Result<usize, Error> {
        self.layers
            .checked_mul(2 * self.kv_heads)
            .and_then(|n| n.checked_mul(self.block_tokens))
            .and_then(|n| n.checked_mul(self.dtype.vector_bytes(self.head_dim)))
            .and_then(|n| n.checked_next_multiple_of(128))
            .ok_or(Error::BadConfig {
                what: "KV layout size overflows",
            })
    }

    fn validate(&self) -> Result<(), Error> {
        if self.layers == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.block_tokens == 0 {
            return Err(Error::BadConfig {
                what: "layers, kv_heads, head_dim and block_tokens must be at least 1",
            });
        }
        if self.dtype.mx().is_some() && !self.head_dim.is_multiple_of(mx_quant::BLOCK) {
            return Err(Error::BadConfig {
                what: "MX pages need head_dim to be a multiple of 32",
            });
        }
        Ok(())
    }

    /// Byte offset of `(layer, is_v, kv_head, token)`'s vector inside a block.
    fn vector_offset(&self, layer: usize, is_v: bool, head: usize, token: usize) -> usize {
        let vb = self.dtype.vector_bytes(self.head_dim);
        (((layer * 2 + usize::from(is_v)) * self.kv_heads + head) * self.block_tokens + token) * vb
    }
}

/// A paged KV cache: a [`BlockManager`] and the unified buffer its blocks live in.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    block_bytes: usize,
    manager: BlockManager,
    buffer: UnifiedBuffer,
    cow: std::sync::Arc<StageCopies>,
}

impl KvCache {
    /// A cache of `blocks` blocks in one buffer from `allocator` (the default allocator picks the
    /// best backend this machine has).
    pub fn new(
        layout: KvLayout,
        blocks: usize,
        allocator: Option<&Allocator>,
    ) -> Result<KvCache, Error> {
        layout.validate()?;
        let block_bytes = layout.block_bytes()?;
        let bytes = block_bytes.checked_mul(blocks).ok_or(Error::BadConfig {
            what: "KV cache size overflows",
        })?;
        let default;
        let allocator = match allocator {
            Some(a) => a,
            None => {
                default = Allocator::new(AllocatorDesc::default()).map_err(Error::Memory)?;
                &default
            }
        };
        let buffer = allocator.allocate(bytes).map_err(Error::Memory)?;
        Ok(KvCache {
            layout,
            block_bytes,
            manager: BlockManager::new(blocks, layout.block_tokens)?,
            buffer,
            cow: uvm_alloc::CopyLedger::global().stage("kv-cow"),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The block manager (tables, accounting).
    pub fn manager(&self) -> &BlockManager {
        &self.manager
    }

    /// The buffer holding every block (for devices that import it).
    pub fn buffer(&self) -> &UnifiedBuffer {
        &self.buffer
    }

    /// Bytes of KV storage per token (all layers, K and V), the figure dtypes are compared by.
    pub fn bytes_per_token(&self) -> f64 {
        (self.layout.layers
            * 2
            * self.layout.kv_heads
            * self.layout.dtype.vector_bytes(self.layout.head_dim)) as f64
    }

    /// Adds a sequence (see [`BlockManager::add_sequence`]); copy-on-write copies are done here.
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<Appended, Error> {
        let a = self.manager.add_sequence(seq, prompt)?;
        self.do_copies(&a)?;
        Ok(a)
    }

    /// Appends tokens (see [`BlockManager::append`]); copy-on-write copies are done here.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Appended, Error> {
        let a = self.manager.append(seq, tokens)?;
        self.do_copies(&a)?;
        Ok(a)
    }

    /// Forks a sequence (no copy until one side appends into a shared block).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        self.manager.fork(parent, child)
    }

    /// Frees a sequence.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), Error> {
        self.manager.free_sequence(seq).map(|_| ())
    }

    /// Drops whole pages of a sequence (pruning).
    pub fn drop_blocks(&mut self, seq: SeqId, logical: &[usize]) -> Result<Vec<BlockId>, Error> {
        self.manager.drop_blocks(seq, logical)
    }

    fn do_copies(&mut self, a: &Appended) -> Result<(), Error> {
        if a.copies.is_empty() {
            return Ok(());
        }
        let mut guard = self
            .buffer
            .cpu_access(0..self.buffer.len(), Access::ReadWrite)
            .map_err(Error::Memory)?;
        let bytes = guard.bytes_mut().map_err(Error::Memory)?;
        for c in &a.copies {
            let (from, to) = (
                c.from as usize * self.block_bytes,
                c.to as usize * self.block_bytes,
            );
            // A copy the zero-copy design cannot avoid: copy-on-write of a shared page.
            bytes.copy_within(from..from + self.block_bytes, to);
            self.cow.record(self.block_bytes);
        }
        Ok(())
    }

    /// Writes the K and V of one token (`kv_heads * head_dim` values each) for `layer` into its
    /// slot, converting to the page dtype.
    pub fn write(
        &mut self,
        layer: usize,
        slot: crate::Slot,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), Error> {
        let l = self.layout;
        let n = l.kv_heads * l.head_dim;
        if layer >= l.layers
            || k.len() != n
            || v.len() != n
            || slot.offset as usize >= l.block_tokens
        {
            return Err(Error::BadConfig {
                what: "write: layer, slot or K/V length out of range",
            });
        }
        if slot.block as usize >= self.manager.total_blocks() {
            return Err(Error::BadConfig {
                what: "write: block out of range",
            });
        }
        let base = slot.block as usize * self.block_bytes;
        let mut guard = self
            .buffer
            .cpu_access(base..base + self.block_bytes, Access::Write)
            .map_err(Error::Memory)?;
        let block = guard.bytes_mut().map_err(Error::Memory)?;
        let vb = l.dtype.vector_bytes(l.head_dim);
        for (is_v, src) in [(false, k), (true, v)] {
            for h in 0..l.kv_heads {
                let off = l.vector_offset(layer, is_v, h, slot.offset as usize);
                encode(
                    l.dtype,
                    &src[h * l.head_dim..(h + 1) * l.head_dim],
                    &mut block[off..off + vb],
                )?;
            }
        }
        Ok(())
    }

    /// Reads the K (or V) vectors of `seq`'s tokens `0..len` for `layer` and `kv_head` into `out`
    /// (`len * head_dim` f32), dequantizing page by page.
    pub fn gather(
        &self,
        seq: SeqId,
        layer: usize,
        kv_head: usize,
        is_v: bool,
        out: &mut Vec<f32>,
    ) -> Result<(), Error> {
        let l = self.layout;
        let table = self.manager.block_table(seq)?;
        let len = self.manager.len(seq)?;
        if layer >= l.layers || kv_head >= l.kv_heads {
            return Err(Error::BadConfig {
                what: "gather: layer or head out of range",
            });
        }
        out.clear();
        out.resize(len * l.head_dim, 0.0);
        let guard = self
            .buffer
            .cpu_access(0..self.buffer.len(), Access::Read)
            .map_err(Error::Memory)?;
        let bytes = guard.bytes();
        let vb = l.dtype.vector_bytes(l.head_dim);
        for (t, dst) in out.chunks_exact_mut(l.head_dim).enumerate() {
            let block = table[t / l.block_tokens] as usize;
            let off = block * self.block_bytes
                + l.vector_offset(layer, is_v, kv_head, t % l.block_tokens);
            decode(l.dtype, &bytes[off..off + vb], dst)?;
        }
        Ok(())
    }

    /// Runs `f(token, k_or_v_vector)` over the stored vectors without gathering, page by page;
    /// `scratch` holds one dequantized vector.
    pub(crate) fn for_each_vector(
        &self,
        bytes: &[u8],
        table: &[BlockId],
        len: usize,
        layer: usize,
        kv_head: usize,
        is_v: bool,
        scratch: &mut [f32],
        mut f: impl FnMut(usize, &[f32]),
    ) -> Result<(), Error> {
        let l = self.layout;
        let vb = l.dtype.vector_bytes(l.head_dim);
        for t in 0..len {
            let block = table[t / l.block_tokens] as usize;
            let off = block * self.block_bytes
                + l.vector_offset(layer, is_v, kv_head, t % l.block_tokens);
            decode(l.dtype, &bytes[off..off + vb], scratch)?;
            f(t, scratch);
        }
        Ok(())
    }
}

fn encode(dtype: PageDtype, src: &[f32], dst: &mut [u8]) -> Result<(), Error> {
    match dtype {
        PageDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        PageDtype::F16 => {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
            }
        }
        PageDtype::Bf16 => {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        }
        PageDtype::Mxfp8 | PageDtype::Mxfp4 => {
            let format = dtype.mx().expect("mx dtype");
            let codes = packed_len(format, src.len());
            let (packed, scales) = dst.split_at_mut(codes);
            mx_quant::bulk::quantize(format, QuantOptions::default(), src, scales, packed)
                .map_err(Error::Quant)?;
        }
    }
    Ok(())
}

fn decode(dtype: PageDtype, src: &[u8], dst: &mut [f32]) -> Result<(), Error> {
    match dtype {
        PageDtype::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        PageDtype::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        PageDtype::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        PageDtype::Mxfp8 | PageDtype::Mxfp4 => {
            let format = dtype.mx().expect("mx dtype");
            let codes = packed_len(format, dst.len());
            let (packed, scales) = src.split_at(codes);
            mx_quant::bulk::dequantize(format, scales, packed, dst).map_err(Error::Quant)?;
        }
    }
    Ok(())
}

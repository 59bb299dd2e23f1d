//! Page storage: every block's K and V for every layer, in one uvm-alloc buffer, in f32, f16,
//! bf16, MXFP8 (E4M3) or MXFP4 (E2M1).
//!
//! # Layout
//! A block holds, for each layer, K then V, each `[kv_head][token][head_dim]`. One token-head
//! vector is `head_dim` elements: raw little-endian values for f32/f16/bf16; for MX, the packed
//! codes (mx-quant's linear layout) and one E8M0 scale per 32 elements, so the MX blocks
//! run along `head_dim` as the format intends. Within one head's page the MX data is planar (all
//! tokens' codes, then all their scales), so a page decodes in one SIMD call. Blocks are padded
//! to 128 bytes, and the buffer starts page aligned, so every block is 128-byte aligned.

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

    /// Starts a sequence with the cached prefix of `prompt` (see
    /// [`BlockManager::add_cached_prefix`]); returns its length in tokens.
    pub fn add_cached_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize, Error> {
        self.manager.add_cached_prefix(seq, prompt)
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

    /// Frees a sequence whose pages may be incomplete, so the prefix cache forgets them (see
    /// [`BlockManager::forget_sequence`]).
    pub fn forget_sequence(&mut self, seq: SeqId) -> Result<(), Error> {
        self.manager.forget_sequence(seq).map(|_| ())
    }

    /// Shortens a sequence to its first `len` tokens (see [`BlockManager::truncate`]); nothing
    /// is copied or cleared, the pages past `len` are simply no longer the sequence's.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<Vec<BlockId>, Error> {
        self.manager.truncate(seq, len)
    }

    /// Drops whole pages of a sequence (pruning).
    pub fn drop_blocks(&mut self, seq: SeqId, logical: &[usize]) -> Result<Vec<BlockId>, Error> {
        self.manager.drop_blocks(seq, logical)
    }

    /// Applies a pruning decision to the sequence and its attention tracker.
    pub fn apply_prune(
        &mut self,
        tracker: &mut crate::prune::AttentionTracker,
        report: &crate::prune::PruneReport,
    ) -> Result<Vec<BlockId>, Error> {
        crate::prune::apply(&mut self.manager, tracker, report)
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
        let page_bytes = l.block_tokens * l.dtype.vector_bytes(l.head_dim);
        for (is_v, src) in [(false, k), (true, v)] {
            for h in 0..l.kv_heads {
                let off = l.vector_offset(layer, is_v, h, 0);
                encode_token(
                    &l,
                    &mut block[off..off + page_bytes],
                    slot.offset as usize,
                    &src[h * l.head_dim..(h + 1) * l.head_dim],
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
        let page_bytes = l.block_tokens * l.dtype.vector_bytes(l.head_dim);
        for (page, dst) in out.chunks_mut(l.block_tokens * l.head_dim).enumerate() {
            let off =
                table[page] as usize * self.block_bytes + l.vector_offset(layer, is_v, kv_head, 0);
            decode_tokens(&l, &bytes[off..off + page_bytes], dst)?;
        }
        Ok(())
    }

    /// Runs `f(token, k_or_v_vector)` over the stored vectors without gathering, one page at a
    /// time: a page's `block_tokens` vectors of one head are contiguous, so they are converted in
    /// one call into `scratch` (`block_tokens * head_dim`), or read in place for f32 pages.
    pub(crate) fn for_each_vector(
        &self,
        bytes: &[u8],
        table: &[BlockId],
        len: usize,
        layer: usize,
        kv_head: usize,
        is_v: bool,
        scratch: &mut Vec<f32>,
        mut f: impl FnMut(usize, &[f32]),
    ) -> Result<(), Error> {
        let l = self.layout;
        let (bt, hd) = (l.block_tokens, l.head_dim);
        let page_bytes = bt * l.dtype.vector_bytes(hd);
        scratch.resize(bt * hd, 0.0);
        for (page, &block) in table.iter().enumerate() {
            let first = page * bt;
            if first >= len {
                break;
            }
            let count = bt.min(len - first);
            let off = block as usize * self.block_bytes + l.vector_offset(layer, is_v, kv_head, 0);
            let src = &bytes[off..off + page_bytes];
            let values: &[f32] = match l.dtype {
                // The mapping is page aligned and every page offset a multiple of 4: read f32
                // pages in place.
                PageDtype::F32 => {
                    bytemuck::try_cast_slice(&src[..count * hd * 4]).map_err(|_| {
                        Error::BadConfig {
                            what: "misaligned f32 page",
                        }
                    })?
                }
                _ => {
                    decode_tokens(&l, src, &mut scratch[..count * hd])?;
                    &scratch[..count * hd]
                }
            };
            for (i, v) in values.chunks_exact(hd).enumerate() {
                f(first + i, v);
            }
        }
        Ok(())
    }
}

/// Writes token `t`'s vector `src` into one head's page (`block_tokens` vectors). MX pages are
/// planar: all tokens' codes, then all tokens' scales, so a page decodes in one call.
fn encode_token(l: &KvLayout, page: &mut [u8], t: usize, src: &[f32]) -> Result<(), Error> {
    let hd = l.head_dim;
    match l.dtype {
        PageDtype::F32 => {
            page[t * 4 * hd..(t + 1) * 4 * hd].copy_from_slice(bytemuck::cast_slice(src))
        }
        PageDtype::F16 => {
            for (d, &x) in page[t * 2 * hd..(t + 1) * 2 * hd]
                .chunks_exact_mut(2)
                .zip(src)
            {
                d.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
            }
        }
        PageDtype::Bf16 => {
            for (d, &x) in page[t * 2 * hd..(t + 1) * 2 * hd]
                .chunks_exact_mut(2)
                .zip(src)
            {
                d.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
            }
        }
        PageDtype::Mxfp8 | PageDtype::Mxfp4 => {
            let format = l.dtype.mx().expect("mx dtype");
            let (pl, ns) = (packed_len(format, hd), hd / mx_quant::BLOCK);
            let (codes, scales) = page.split_at_mut(l.block_tokens * pl);
            mx_quant::bulk::quantize(
                format,
                QuantOptions::default(),
                src,
                &mut scales[t * ns..(t + 1) * ns],
                &mut codes[t * pl..(t + 1) * pl],
            )
            .map_err(Error::Quant)?;
        }
    }
    Ok(())
}

/// Decodes the first `dst.len() / head_dim` tokens of one head's page into `dst`, in one
/// conversion call (F16C for f16 where the CPU has it, mx-quant's SIMD kernels for MX).
fn decode_tokens(l: &KvLayout, page: &[u8], dst: &mut [f32]) -> Result<(), Error> {
    use half::slice::HalfFloatSliceExt;
    let n = dst.len();
    let misaligned = || Error::BadConfig {
        what: "misaligned KV page",
    };
    match l.dtype {
        PageDtype::F32 => {
            dst.copy_from_slice(bytemuck::try_cast_slice(&page[..4 * n]).map_err(|_| misaligned())?)
        }
        PageDtype::F16 => bytemuck::try_cast_slice::<u8, half::f16>(&page[..2 * n])
            .map_err(|_| misaligned())?
            .convert_to_f32_slice(dst),
        PageDtype::Bf16 => bytemuck::try_cast_slice::<u8, half::bf16>(&page[..2 * n])
            .map_err(|_| misaligned())?
            .convert_to_f32_slice(dst),
        PageDtype::Mxfp8 | PageDtype::Mxfp4 => {
            let format = l.dtype.mx().expect("mx dtype");
            let (pl, ns) = (packed_len(format, l.head_dim), l.head_dim / mx_quant::BLOCK);
            let tokens = n / l.head_dim;
            let (codes, scales) = page.split_at(l.block_tokens * pl);
            mx_quant::bulk::dequantize(format, &scales[..tokens * ns], &codes[..tokens * pl], dst)
                .map_err(Error::Quant)?;
        }
    }
    Ok(())
}

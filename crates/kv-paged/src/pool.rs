//! The block manager: fixed-size token blocks, refcounts, copy-on-write forks, per-sequence
//! block tables and a prefix cache with LRU eviction.
//!
//! # States of a block
//! Every block is in exactly one state:
//! - **free**: on the free stack, holding nothing;
//! - **used**: referenced by `refcount >= 1` sequence tables;
//! - **cached**: unreferenced but full and hashed, so a later sequence with the same prefix can
//!   reuse it; kept in LRU order and evicted (oldest first) when the free stack is empty.
//!
//! Allocation pops the free stack, else evicts the least recently cached block: O(1) either
//! way. A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal
//! prefixes (up to 64-bit collisions), the vLLM scheme.
//!
//! Appending into a block that other sequences share first copies it (copy-on-write); the copy
//! is counted in uvm-alloc's ledger under stage `kv-cow`.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::Error;

/// A physical block index.
pub type BlockId = u32;

/// A sequence handle, chosen by the caller.
pub type SeqId = u64;

/// Where one token's K/V goes: its block and slot within the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub block: BlockId,
    pub offset: u32,
}

/// A copy the caller must perform before writing (copy-on-write of a shared block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub from: BlockId,
    pub to: BlockId,
}

/// What [`BlockManager::append`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Appended {
    /// One slot per appended token, in order.
    pub slots: Vec<Slot>,
    /// Copies made for copy-on-write (already done when the manager owns the storage).
    pub copies: Vec<BlockCopy>,
}

/// Counters and ratios for capacity planning.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Accounting {
    pub total_blocks: usize,
    pub free_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Unreferenced blocks kept for the prefix cache.
    pub cached_blocks: usize,
    /// Blocks referenced by more than one sequence.
    pub shared_blocks: usize,
    /// Token slots in used blocks.
    pub reserved_slots: usize,
    /// Slots holding a token (a shared block counts once).
    pub filled_slots: usize,
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl Accounting {
    /// Used blocks over total blocks.
    pub fn utilisation(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            self.used_blocks as f64 / self.total_blocks as f64
        }
    }

    /// Reserved but unfilled slots over reserved slots (the tail of each sequence's last block).
    pub fn internal_waste(&self) -> f64 {
        if self.reserved_slots == 0 {
            0.0
        } else {
            (self.reserved_slots - self.filled_slots) as f64 / self.reserved_slots as f64
        }
    }
}

#[derive(Clone, Debug)]
struct Sequence {
    /// Arrival order, for preemption policies.
    arrival: u64,
    blocks: Vec<BlockId>,
    tokens: Vec<u32>,
    /// The prefix-cache hash of each full block, in order (the last is the parent hash of the
    /// next); `None` once pruning has dropped pages, since the blocks no longer form the prefix
    /// their tokens say, and blocks filled after that are not cached.
    block_hashes: Option<Vec<u64>>,
}

const NONE: u32 = u32::MAX;

/// The block manager. Storage-agnostic: [`crate::KvCache`] pairs it with a uvm-alloc buffer.
#[derive(Debug)]
pub struct BlockManager {
    block_tokens: usize,
    refcount: Vec<u32>,
    free: Vec<BlockId>,
    /// Tokens written into each block (the fill of shared blocks is the same for all holders).
    fill: Vec<u32>,
    /// Prefix-cache hash of each full, registered block.
    hash_of: Vec<Option<u64>>,
    cache: HashMap<u64, BlockId>,
    /// Intrusive LRU list of cached (unreferenced) blocks: oldest at `lru_head`.
    lru_prev: Vec<u32>,
    lru_next: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    cached_count: usize,
    seqs: HashMap<SeqId, Sequence>,
    arrivals: u64,
    cache_hits: u64,
    cache_misses: u64,
}

/// Chooses a sequence to preempt when blocks run out, so a caller can keep serving: the victim
/// is freed (its blocks return to the pool) and its tokens handed back for recomputation.
pub trait Preempt {
    /// A sequence to preempt (never `requester`), or `None` to give up with the error.
    fn victim(&mut self, manager: &BlockManager, requester: SeqId, needed: usize) -> Option<SeqId>;
}

/// Preempts the most recently arrived sequence other than the requester (vLLM's recompute
/// policy: the newest request has the least work to redo).
#[derive(Clone, Copy, Debug, Default)]
pub struct PreemptNewest;

impl Preempt for PreemptNewest {
    fn victim(
        &mut self,
        manager: &BlockManager,
        requester: SeqId,
        _needed: usize,
    ) -> Option<SeqId> {
        manager
            .seqs
            .iter()
            .filter(|(id, _)| **id != requester)
            .max_by_key(|(_, s)| s.arrival)
            .map(|(id, _)| *id)
    }
}

/// A sequence preempted to make room, and the tokens to recompute it from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preempted {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
}

impl BlockManager {
    /// A manager of `total_blocks` blocks of `block_tokens` tokens each.
    pub fn new(total_blocks: usize, block_tokens: usize) -> Result<BlockManager, Error> {
        if block_tokens == 0 || total_blocks == 0 {
            return Err(Error::BadConfig {
                what: "block_tokens and total_blocks must be at least 1",
            });
        }
        if total_blocks >= NONE as usize {
            return Err(Error::BadConfig {
                what: "at most 2^32 - 2 blocks",
            });
        }
        Ok(BlockManager {
            block_tokens,
            refcount: vec![0; total_blocks],
            // Pop order 0, 1, 2, ...: deterministic tables for goldens.
            free: (0..total_blocks as u32).rev().collect(),
            fill: vec![0; total_blocks],
            hash_of: vec![None; total_blocks],
            cache: HashMap::new(),
            lru_prev: vec![NONE; total_blocks],
            lru_next: vec![NONE; total_blocks],
            lru_head: NONE,
            lru_tail: NONE,
            cached_count: 0,
            seqs: HashMap::new(),
            arrivals: 0,
            cache_hits: 0,
            cache_misses: 0,
        })
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Total blocks.
    pub fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks an allocation can take now (free plus evictable cached ones).
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.cached_count
    }

    /// A sequence's block table (logical block index -> physical block).
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], Error> {
        self.seqs
            .get(&seq)
            .map(|s| s.blocks.as_slice())
            .ok_or(Error::UnknownSequence { seq })
    }

    /// A sequence's token count.
    pub fn len(&self, seq: SeqId) -> Result<usize, Error> {
        self.seqs
            .get(&seq)
            .map(|s| s.tokens.len())
            .ok_or(Error::UnknownSequence { seq })
    }

    /// The sequences present, in no particular order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Starts sequence `seq` with `prompt`, reusing cached blocks for every leading full block
    /// whose prefix hash is cached, and allocating the rest. Returns the slots of the tokens that
    /// still need their K/V written (those past the reused prefix).
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<Appended, Error> {
        let reused = self.add_cached_prefix(seq, prompt)?;
        match self.append(seq, &prompt[reused..]) {
            Ok(a) => Ok(a),
            Err(e) => {
                // Leave no half-made sequence behind.
                let _ = self.free_sequence(seq);
                Err(e)
            }
        }
    }

    /// Starts sequence `seq` with only the longest prefix of `prompt` the prefix cache holds,
    /// in whole blocks, and returns its length in tokens: the caller computes the rest and
    /// appends it. This is how a prompt shared across requests is prefilled once.
    pub fn add_cached_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize, Error> {
        if self.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists { seq });
        }
        self.arrivals += 1;
        let mut s = Sequence {
            arrival: self.arrivals,
            blocks: Vec::new(),
            tokens: Vec::new(),
            block_hashes: Some(Vec::new()),
        };
        let mut parent = None;
        for chunk in prompt.chunks_exact(self.block_tokens) {
            let h = block_hash(parent, chunk);
            match self.cache.get(&h) {
                Some(&b) => {
                    self.cache_hits += 1;
                    self.retain(b);
                    s.blocks.push(b);
                    s.tokens.extend_from_slice(chunk);
                    s.block_hashes.get_or_insert_default().push(h);
                    parent = Some(h);
                }
                None => {
                    self.cache_misses += 1;
                    break;
                }
            }
        }
        let reused = s.tokens.len();
        self.seqs.insert(seq, s);
        Ok(reused)
    }

    /// How many leading tokens of `prompt` [`BlockManager::add_cached_prefix`] would take from
    /// the prefix cache now (whole blocks), without taking them or counting a hit or miss.
    pub fn cached_prefix_len(&self, prompt: &[u32]) -> usize {
        let mut parent = None;
        let mut len = 0;
        for chunk in prompt.chunks_exact(self.block_tokens) {
            let h = block_hash(parent, chunk);
            if !self.cache.contains_key(&h) {
                break;
            }
            len += chunk.len();
            parent = Some(h);
        }
        len
    }

    /// Appends `tokens` to `seq`, allocating blocks as they fill; a shared last block is copied
    /// first. Fails with [`Error::OutOfBlocks`] (changing nothing) when the blocks needed exceed
    /// those available.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Appended, Error> {
        let bt = self.block_tokens;
        let s = self.seqs.get(&seq).ok_or(Error::UnknownSequence { seq })?;
        let len = s.tokens.len();
        let partial = len % bt != 0;
        let last_shared = partial
            && s.blocks
                .last()
                .is_some_and(|&b| self.refcount[b as usize] > 1);
        let new_blocks = (len + tokens.len()).div_ceil(bt) - len.div_ceil(bt)
            + usize::from(last_shared && !tokens.is_empty());
        if new_blocks > self.available_blocks() {
            return Err(Error::OutOfBlocks {
                requested: new_blocks,
                free: self.available_blocks(),
                total: self.total_blocks(),
            });
        }
        let mut out = Appended::default();
        if tokens.is_empty() {
            return Ok(out);
        }
        if last_shared {
            let old = *self.seqs[&seq]
                .blocks
                .last()
                .expect("a partial block exists");
            let new = self.allocate().expect("counted above");
            // This sequence's fill, which after a truncation can be less than the others'.
            self.fill[new as usize] = (len % bt) as u32;
            self.release(old);
            *self
                .seqs
                .get_mut(&seq)
                .expect("checked")
                .blocks
                .last_mut()
                .expect("non-empty") = new;
            out.copies.push(BlockCopy { from: old, to: new });
        }
        if partial && !last_shared {
            // A page this sequence alone holds, cut short by a truncation but still cached
            // under the tokens it held: it is about to hold others.
            let b = *self.seqs[&seq]
                .blocks
                .last()
                .expect("a partial block exists");
            if let Some(h) = self.hash_of[b as usize].take() {
                self.cache.remove(&h);
            }
        }
        for &t in tokens {
            let s = self.seqs.get_mut(&seq).expect("checked");
            let offset = s.tokens.len() % bt;
            if offset == 0 {
                let b = self.allocate().expect("counted above");
                self.seqs.get_mut(&seq).expect("checked").blocks.push(b);
            }
            let s = self.seqs.get_mut(&seq).expect("checked");
            let block = *s.blocks.last().expect("just ensured");
            s.tokens.push(t);
            self.fill[block as usize] = (offset + 1) as u32;
            out.slots.push(Slot {
                block,
                offset: offset as u32,
            });
            if offset + 1 == bt {
                self.register_full(seq);
            }
        }
        Ok(out)
    }

    /// Forks `parent` into `child`: the child shares every block (refcounts grow); the first
    /// append into a shared partial block copies it.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), Error> {
        if self.seqs.contains_key(&child) {
            return Err(Error::SequenceExists { seq: child });
        }
        let s = self
            .seqs
            .get(&parent)
            .ok_or(Error::UnknownSequence { seq: parent })?
            .clone();
        for &b in &s.blocks {
            self.refcount[b as usize] += 1;
        }
        self.arrivals += 1;
        self.seqs.insert(
            child,
            Sequence {
                arrival: self.arrivals,
                ..s
            },
        );
        Ok(())
    }

    /// [`BlockManager::append`], preempting sequences chosen by `policy` while blocks run out.
    /// Returns what was appended and the sequences preempted (freed; recompute them later).
    pub fn append_or_preempt(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        policy: &mut dyn Preempt,
    ) -> Result<(Appended, Vec<Preempted>), Error> {
        let mut preempted = Vec::new();
        loop {
            match self.append(seq, tokens) {
                Ok(a) => return Ok((a, preempted)),
                Err(Error::OutOfBlocks {
                    requested,
                    free,
                    total,
                }) => {
                    let Some(victim) = policy.victim(self, seq, requested).filter(|v| *v != seq)
                    else {
                        return Err(Error::OutOfBlocks {
                            requested,
                            free,
                            total,
                        });
                    };
                    let tokens = self
                        .seqs
                        .get(&victim)
                        .map(|s| s.tokens.clone())
                        .unwrap_or_default();
                    self.free_sequence(victim)?;
                    preempted.push(Preempted {
                        seq: victim,
                        tokens,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Frees `seq`: its blocks lose a reference; unreferenced full hashed blocks stay cached
    /// (evictable), the rest return to the free stack. Blocks are released last to first, so a
    /// prefix's tail is evicted before its root, which more prompts share. Returns the blocks.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<Vec<BlockId>, Error> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        for &b in s.blocks.iter().rev() {
            self.release(b);
        }
        Ok(s.blocks)
    }

    /// Frees `seq` like [`BlockManager::free_sequence`], except that the blocks it leaves
    /// unreferenced also leave the prefix cache: for a sequence whose K/V may be incomplete (a
    /// failed submission), whose pages must not be found by a later prompt.
    pub fn forget_sequence(&mut self, seq: SeqId) -> Result<Vec<BlockId>, Error> {
        let blocks = self.block_table(seq)?.to_vec();
        for &b in &blocks {
            if self.refcount[b as usize] == 1
                && let Some(h) = self.hash_of[b as usize].take()
            {
                self.cache.remove(&h);
            }
        }
        self.free_sequence(seq)
    }

    /// Drops the full logical blocks `logical` of `seq` from its table (whole-page eviction by a
    /// pruning policy); the sequence loses those blocks' tokens. Returns the physical blocks.
    pub fn drop_blocks(&mut self, seq: SeqId, logical: &[usize]) -> Result<Vec<BlockId>, Error> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        let full = s.tokens.len() / self.block_tokens;
        if let Some(&bad) = logical.iter().find(|&&l| l >= full) {
            return Err(Error::BlockOutOfRange {
                seq,
                logical: bad,
                full_blocks: full,
            });
        }
        let mut sorted: Vec<usize> = logical.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut dropped = Vec::new();
        for &l in sorted.iter().rev() {
            let b = s.blocks.remove(l);
            let start = l * self.block_tokens;
            s.tokens.drain(start..start + self.block_tokens);
            dropped.push(b);
        }
        // The remaining blocks no longer form a hashed prefix chain: neither they nor blocks
        // filled later may be found by a prompt with the same tokens.
        s.block_hashes = None;
        for &b in &dropped {
            self.release(b);
        }
        Ok(dropped)
    }

    /// Shortens `seq` to its first `len` tokens, the rollback of speculative decoding's rejected
    /// drafts. Copies nothing: the blocks wholly past `len` lose this sequence's reference (last
    /// to first), and the block `len` ends inside stays. If other sequences share that block,
    /// the next append copies it first, as after a fork; if this sequence alone holds it, the
    /// next append writes into it and takes it out of the prefix cache first. Returns the
    /// released blocks.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<Vec<BlockId>, Error> {
        let bt = self.block_tokens;
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        let have = s.tokens.len();
        if len > have {
            return Err(Error::TruncatePastEnd { seq, len, have });
        }
        s.tokens.truncate(len);
        if let Some(hashes) = s.block_hashes.as_mut() {
            hashes.truncate(len / bt);
        }
        let released = s.blocks.split_off(len.div_ceil(bt));
        let partial =
            (!len.is_multiple_of(bt)).then(|| *s.blocks.last().expect("len > 0 has a block"));
        for &b in released.iter().rev() {
            self.release(b);
        }
        if let Some(b) = partial.filter(|&b| self.refcount[b as usize] == 1) {
            // Still hashed: its slots keep the old tokens until the next append writes them.
            self.fill[b as usize] = (len % bt) as u32;
        }
        Ok(released)
    }

    /// Counters and ratios now.
    pub fn accounting(&self) -> Accounting {
        let used: Vec<usize> = (0..self.total_blocks())
            .filter(|&b| self.refcount[b] > 0)
            .collect();
        Accounting {
            total_blocks: self.total_blocks(),
            free_blocks: self.free.len(),
            used_blocks: used.len(),
            cached_blocks: self.cached_count,
            shared_blocks: used.iter().filter(|&&b| self.refcount[b] > 1).count(),
            reserved_slots: used.len() * self.block_tokens,
            filled_slots: used.iter().map(|&b| self.fill[b] as usize).sum(),
            cache_hits: self.cache_hits,
            cache_misses: self.cache_misses,
        }
    }

    /// Checks every internal invariant; for tests and debugging. O(blocks + table entries).
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.total_blocks();
        let mut refs = vec![0u32; n];
        for (id, s) in &self.seqs {
            if s.blocks.len() != s.tokens.len().div_ceil(self.block_tokens) {
                return Err(format!(
                    "seq {id}: {} blocks for {} tokens",
                    s.blocks.len(),
                    s.tokens.len()
                ));
            }
            if let Some(h) = &s.block_hashes
                && h.len() != s.tokens.len() / self.block_tokens
            {
                return Err(format!(
                    "seq {id}: {} block hashes for {} full blocks",
                    h.len(),
                    s.tokens.len() / self.block_tokens
                ));
            }
            for &b in &s.blocks {
                refs[b as usize] += 1;
            }
        }
        if refs != self.refcount {
            return Err("refcounts differ from table references".into());
        }
        let mut state = vec![0u8; n];
        for &b in &self.free {
            state[b as usize] += 1;
        }
        let mut cached = 0;
        let mut cur = self.lru_head;
        while cur != NONE {
            state[cur as usize] += 1;
            cached += 1;
            if self.hash_of[cur as usize].is_none() {
                return Err(format!("cached block {cur} has no hash"));
            }
            cur = self.lru_next[cur as usize];
        }
        if cached != self.cached_count {
            return Err(format!(
                "LRU holds {cached} blocks, count says {}",
                self.cached_count
            ));
        }
        for (b, (&listed, &refs)) in state.iter().zip(&self.refcount).enumerate() {
            let states = listed + u8::from(refs > 0);
            if states != 1 {
                return Err(format!("block {b} is in {states} states"));
            }
        }
        for (&h, &b) in &self.cache {
            if self.hash_of[b as usize] != Some(h) {
                return Err(format!("cache maps {h:#x} to block {b} whose hash differs"));
            }
        }
        Ok(())
    }

    fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.lru_head;
                if b == NONE {
                    return None;
                }
                self.lru_remove(b);
                if let Some(h) = self.hash_of[b as usize].take() {
                    self.cache.remove(&h);
                }
                b
            }
        };
        self.refcount[b as usize] = 1;
        self.fill[b as usize] = 0;
        Some(b)
    }

    fn retain(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            // Revived from the cache.
            self.lru_remove(b);
        }
        self.refcount[b as usize] += 1;
    }

    fn release(&mut self, b: BlockId) {
        let r = &mut self.refcount[b as usize];
        debug_assert!(*r > 0, "release of an unreferenced block");
        *r -= 1;
        if *r == 0 {
            if self.hash_of[b as usize].is_some() {
                self.lru_push(b);
            } else {
                self.fill[b as usize] = 0;
                self.free.push(b);
            }
        }
    }

    /// Registers the sequence's just-filled last block in the prefix cache.
    fn register_full(&mut self, seq: SeqId) {
        let bt = self.block_tokens;
        let s = self.seqs.get_mut(&seq).expect("caller checked");
        let Some(hashes) = s.block_hashes.as_mut() else {
            return;
        };
        let start = s.tokens.len() - bt;
        let h = block_hash(hashes.last().copied(), &s.tokens[start..]);
        hashes.push(h);
        let b = *s.blocks.last().expect("a full block");
        if self.hash_of[b as usize].is_none() && !self.cache.contains_key(&h) {
            self.hash_of[b as usize] = Some(h);
            self.cache.insert(h, b);
        }
    }

    fn lru_push(&mut self, b: BlockId) {
        self.lru_prev[b as usize] = self.lru_tail;
        self.lru_next[b as usize] = NONE;
        if self.lru_tail != NONE {
            self.lru_next[self.lru_tail as usize] = b;
        } else {
            self.lru_head = b;
        }
        self.lru_tail = b;
        self.cached_count += 1;
    }

    fn lru_remove(&mut self, b: BlockId) {
        let (p, n) = (self.lru_prev[b as usize], self.lru_next[b as usize]);
        if p != NONE {
            self.lru_next[p as usize] = n;
        } else {
            self.lru_head = n;
        }
        if n != NONE {
            self.lru_prev[n as usize] = p;
        } else {
            self.lru_tail = p;
        }
        self.lru_prev[b as usize] = NONE;
        self.lru_next[b as usize] = NONE;
        self.cached_count -= 1;
    }
}

/// The prefix-cache hash of a full block: its tokens and its parent block's hash.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same on every run of one build (std does not promise the
    // algorithm across Rust releases, so the hashes are not a persistent format).
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

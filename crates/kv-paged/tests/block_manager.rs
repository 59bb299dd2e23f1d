//! The block manager: invariants and page contents under random interleavings of
//! add/append/fork/free/forget/drop/truncate (property test with a seeded generator against a shadow
//! of what the pages hold), truncation, a byte-exact golden of block tables for a scripted
//! workload, copy-on-write, prefix-cache reuse and eviction, out-of-blocks and preemption, and
//! internal waste on a mixed-length workload.

use std::collections::HashMap;

use kv_paged::{Appended, BlockCopy, BlockId, BlockManager, Error, PreemptNewest, SeqId, Slot};

/// xorshift64*: deterministic, dependency-free test randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the pages would hold: the token written into each block slot, kept from the slots
/// and copies the manager reports, and each sequence's tokens kept from the operations.
#[derive(Default)]
struct Shadow {
    pages: HashMap<BlockId, Vec<Option<u32>>>,
    seqs: HashMap<SeqId, Vec<u32>>,
}

impl Shadow {
    fn write(&mut self, block_tokens: usize, a: &Appended, tokens: &[u32]) {
        for c in &a.copies {
            let page = self.pages.get(&c.from).cloned().unwrap_or_default();
            self.pages.insert(c.to, page);
        }
        for (slot, &t) in a.slots.iter().zip(tokens) {
            let page = self.pages.entry(slot.block).or_default();
            page.resize(block_tokens, None);
            page[slot.offset as usize] = Some(t);
        }
    }

    /// Every sequence's table points at pages holding exactly its tokens, in order: the prefix
    /// cache never hands out a page written for other tokens, and no write lands in a page
    /// another sequence still reads.
    fn check(&self, m: &BlockManager) -> Result<(), String> {
        let bt = m.block_tokens();
        for (&seq, tokens) in &self.seqs {
            let table = m.block_table(seq).map_err(|e| e.to_string())?;
            for (i, chunk) in tokens.chunks(bt).enumerate() {
                let page = self.pages.get(&table[i]).cloned().unwrap_or_default();
                let held: Vec<Option<u32>> = page.iter().take(chunk.len()).copied().collect();
                let want: Vec<Option<u32>> = chunk.iter().map(|&t| Some(t)).collect();
                if held != want {
                    return Err(format!(
                        "seq {seq} block {i} (page {}) holds {held:?}, not {want:?}",
                        table[i]
                    ));
                }
            }
        }
        Ok(())
    }
}

#[test]
fn invariants_and_page_contents_hold_under_random_interleavings() {
    for seed in 1..=20u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let block_tokens = [1usize, 4, 16][(seed % 3) as usize];
        let mut m = BlockManager::new(64, block_tokens).unwrap();
        let mut shadow = Shadow::default();
        // Prompts share prefixes drawn from a few stems, so the prefix cache sees hits.
        let stems: Vec<Vec<u32>> = (0..3)
            .map(|s| (0..40).map(|i| s * 1000 + i).collect())
            .collect();
        for step in 0..2000 {
            let seq = rng.below(10);
            let op = rng.below(8);
            let result = match op {
                0 => {
                    let stem = &stems[rng.below(3) as usize];
                    let mut prompt = stem[..rng.below(40) as usize].to_vec();
                    prompt.extend((0..rng.below(20)).map(|_| rng.below(50) as u32));
                    m.add_sequence(seq, &prompt).map(|a| {
                        // The slots are those of the tokens past the reused prefix.
                        let fresh = prompt.len() - a.slots.len();
                        shadow.write(block_tokens, &a, &prompt[fresh..]);
                        shadow.seqs.insert(seq, prompt);
                    })
                }
                1 | 2 => {
                    let tokens: Vec<u32> =
                        (0..rng.below(24)).map(|_| rng.below(50) as u32).collect();
                    m.append(seq, &tokens).map(|a| {
                        shadow.write(block_tokens, &a, &tokens);
                        shadow.seqs.get_mut(&seq).unwrap().extend(&tokens);
                    })
                }
                3 => {
                    let child = rng.below(10);
                    m.fork(seq, child).map(|()| {
                        let tokens = shadow.seqs[&seq].clone();
                        shadow.seqs.insert(child, tokens);
                    })
                }
                4 => m.free_sequence(seq).map(|_| {
                    shadow.seqs.remove(&seq);
                }),
                5 => {
                    let full = m.len(seq).map(|l| l / block_tokens).unwrap_or(0);
                    if full == 0 {
                        Ok(())
                    } else {
                        let logical = rng.below(full as u64) as usize;
                        m.drop_blocks(seq, &[logical]).map(|_| {
                            let start = logical * block_tokens;
                            shadow
                                .seqs
                                .get_mut(&seq)
                                .unwrap()
                                .drain(start..start + block_tokens);
                        })
                    }
                }
                6 => m.forget_sequence(seq).map(|_| {
                    shadow.seqs.remove(&seq);
                }),
                _ => {
                    let len = m.len(seq).unwrap_or(0);
                    let keep = rng.below(len as u64 + 1) as usize;
                    m.truncate(seq, keep).map(|_| {
                        shadow.seqs.get_mut(&seq).unwrap().truncate(keep);
                    })
                }
            };
            // Errors are allowed (unknown ids, out of blocks); corrupted state is not.
            if let Err(e) = &result {
                assert!(
                    matches!(
                        e,
                        Error::UnknownSequence { .. }
                            | Error::SequenceExists { .. }
                            | Error::OutOfBlocks { .. }
                    ),
                    "seed {seed} step {step}: unexpected {e}"
                );
            }
            if let Err(msg) = m.check_invariants().and_then(|()| shadow.check(&m)) {
                panic!("seed {seed} step {step} op {op}: {msg}");
            }
        }
    }
}

#[test]
fn truncation_copies_nothing_and_the_next_append_writes_in_place_or_copies_a_shared_page() {
    let mut m = BlockManager::new(8, 4).unwrap();
    m.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap(); // blocks 0, 1 full, 2 partial
    // Rolling back three drafted tokens: block 2 goes back to the pool, block 1 stays.
    assert_eq!(m.truncate(1, 6).unwrap(), vec![2]);
    assert_eq!(m.block_table(1).unwrap(), &[0, 1]);
    assert_eq!(m.len(1).unwrap(), 6);
    let a = m.append(1, &[60, 70]).unwrap();
    assert!(
        a.copies.is_empty(),
        "a page this sequence alone holds is rewritten in place"
    );
    assert_eq!(
        a.slots,
        vec![
            Slot {
                block: 1,
                offset: 2
            },
            Slot {
                block: 1,
                offset: 3
            }
        ]
    );
    // A page shared with a fork is copied before the truncated sequence writes into it.
    m.fork(1, 2).unwrap();
    m.truncate(2, 5).unwrap();
    let a = m.append(2, &[99]).unwrap();
    assert_eq!(a.copies, vec![BlockCopy { from: 1, to: 2 }]);
    assert_eq!(m.block_table(1).unwrap(), &[0, 1]);
    assert_eq!(m.block_table(2).unwrap(), &[0, 2]);
    assert_eq!(
        m.truncate(2, 7),
        Err(Error::TruncatePastEnd {
            seq: 2,
            len: 7,
            have: 6
        })
    );
    m.check_invariants().unwrap();
}

#[test]
fn a_truncated_page_leaves_the_prefix_cache_and_pruned_sequences_cache_nothing() {
    let mut m = BlockManager::new(8, 2).unwrap();
    m.add_sequence(1, &[1, 2, 3, 4]).unwrap(); // blocks 0, 1 full and cached by hash
    m.truncate(1, 3).unwrap();
    m.append(1, &[40]).unwrap(); // block 1 now holds 3, 40
    m.free_sequence(1).unwrap();
    // [1, 2, 3, 4] must not find block 1, which no longer holds 3, 4.
    let a = m.add_sequence(2, &[1, 2, 3, 4]).unwrap();
    assert_eq!(a.slots.len(), 2, "only the first block is reused");
    m.free_sequence(2).unwrap();
    // After pruning, the pages that fill later hold tokens whose context is gone: a prompt
    // starting with the same tokens must not be handed them.
    m.add_sequence(3, &[7, 8, 9, 10]).unwrap();
    m.drop_blocks(3, &[0]).unwrap();
    m.append(3, &[11, 12]).unwrap();
    m.free_sequence(3).unwrap();
    let a = m.add_sequence(4, &[9, 10, 11, 12]).unwrap();
    assert_eq!(a.slots.len(), 4, "nothing of the pruned sequence is reused");
    m.check_invariants().unwrap();
}

#[test]
fn copy_on_write_and_forks() {
    let mut m = BlockManager::new(8, 4).unwrap();
    m.add_sequence(1, &[1, 2, 3, 4, 5, 6]).unwrap(); // blocks 0 (full), 1 (2 of 4)
    m.fork(1, 2).unwrap();
    assert_eq!(m.accounting().shared_blocks, 2);
    // Appending to the child copies the shared partial block, never the full one.
    let a = m.append(2, &[7]).unwrap();
    assert_eq!(a.copies, vec![BlockCopy { from: 1, to: 2 }]);
    assert_eq!(
        a.slots,
        vec![Slot {
            block: 2,
            offset: 2
        }]
    );
    assert_eq!(m.block_table(1).unwrap(), &[0, 1]);
    assert_eq!(m.block_table(2).unwrap(), &[0, 2]);
    // The parent now owns block 1 alone and appends in place.
    assert!(m.append(1, &[9]).unwrap().copies.is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn prefix_cache_reuses_and_evicts_lru() {
    let mut m = BlockManager::new(4, 2).unwrap();
    m.add_sequence(1, &[1, 2, 3, 4, 5]).unwrap(); // blocks 0, 1 full and hashed, 2 partial
    m.free_sequence(1).unwrap(); // 0 and 1 cached, 2 free
    assert_eq!(m.accounting().cached_blocks, 2);
    // A peek takes nothing and counts nothing: whole cached blocks of the longest prefix.
    assert_eq!(m.cached_prefix_len(&[1, 2, 3, 4, 9]), 4);
    assert_eq!(m.cached_prefix_len(&[1, 2, 3]), 2);
    assert_eq!(m.cached_prefix_len(&[1, 9, 3, 4]), 0);
    assert_eq!(m.accounting().cache_hits, 0);
    // Same prefix: both full blocks come back from the cache; only the tail is new.
    let a = m.add_sequence(2, &[1, 2, 3, 4, 9]).unwrap();
    assert_eq!(m.block_table(2).unwrap(), &[0, 1, 2]);
    assert_eq!(
        a.slots,
        vec![Slot {
            block: 2,
            offset: 0
        }],
        "only the uncached token needs K/V"
    );
    assert_eq!(m.accounting().cache_hits, 2);
    m.free_sequence(2).unwrap();
    // A different prompt needing 3 blocks takes the free ones first, then evicts the least
    // recently cached block. A sequence releases its blocks last to first, so the tail of a
    // prefix (block 1) is evicted before its root (block 0), which more prompts share.
    m.add_sequence(3, &[7, 7, 7, 7, 7]).unwrap();
    assert_eq!(m.block_table(3).unwrap(), &[2, 3, 1]);
    assert_eq!(m.accounting().cached_blocks, 1);
    m.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_reports_numbers_and_preemption_keeps_serving() {
    let mut m = BlockManager::new(4, 4).unwrap();
    m.add_sequence(1, &[0; 8]).unwrap();
    m.add_sequence(2, &[1; 6]).unwrap();
    assert_eq!(
        m.append(1, &[5; 12]),
        Err(Error::OutOfBlocks {
            requested: 3,
            free: 0,
            total: 4
        })
    );
    m.check_invariants().unwrap();
    assert_eq!(
        m.block_table(1).unwrap(),
        &[0, 1],
        "a failed append changes nothing"
    );
    let (_, preempted) = m.append_or_preempt(1, &[5; 4], &mut PreemptNewest).unwrap();
    assert_eq!(preempted.len(), 1);
    assert_eq!(
        (preempted[0].seq, preempted[0].tokens.clone()),
        (2, vec![1; 6])
    );
    assert_eq!(m.len(1).unwrap(), 12);
    // Nothing left to preempt: the error comes back.
    assert!(matches!(
        m.append_or_preempt(1, &[5; 40], &mut PreemptNewest),
        Err(Error::OutOfBlocks { .. })
    ));
    m.check_invariants().unwrap();
}

#[test]
fn internal_waste_is_small_on_mixed_lengths() {
    // 200 sequences of 64..2048 tokens in 16-token blocks: only each last block is partial.
    let mut rng = Rng(42);
    let lengths: Vec<usize> = (0..200).map(|_| 64 + rng.below(1985) as usize).collect();
    let blocks: usize = lengths.iter().map(|l| l.div_ceil(16)).sum();
    let mut m = BlockManager::new(blocks, 16).unwrap();
    for (i, &len) in lengths.iter().enumerate() {
        let prompt: Vec<u32> = (0..len as u32).map(|t| t + i as u32 * 100_000).collect();
        m.add_sequence(i as u64, &prompt).unwrap();
    }
    let a = m.accounting();
    assert_eq!(a.used_blocks, blocks);
    assert!(
        a.internal_waste() < 0.04,
        "waste {:.4} over {} reserved slots",
        a.internal_waste(),
        a.reserved_slots
    );
    eprintln!(
        "internal waste on 200 sequences of 64..2048 tokens: {:.2}%",
        a.internal_waste() * 100.0
    );
}

/// A scripted workload rendered step by step; compared byte for byte with
/// `fixtures/kv-paged/block_tables.golden` (regenerate with `UPDATE_GOLDENS=1`).
#[test]
fn block_tables_match_the_golden() {
    let mut m = BlockManager::new(12, 16).unwrap();
    let mut out = String::new();
    let mut render = |m: &BlockManager, step: &str| {
        out.push_str(&format!("# {step}\n"));
        let mut ids: Vec<u64> = m.sequences().collect();
        ids.sort();
        for id in ids {
            out.push_str(&format!(
                "seq {id}: len {} table {:?}\n",
                m.len(id).unwrap(),
                m.block_table(id).unwrap()
            ));
        }
        let a = m.accounting();
        out.push_str(&format!(
            "used {} free {} cached {} shared {} hits {} misses {}\n",
            a.used_blocks,
            a.free_blocks,
            a.cached_blocks,
            a.shared_blocks,
            a.cache_hits,
            a.cache_misses
        ));
    };
    let prompt: Vec<u32> = (0..40).collect();
    m.add_sequence(1, &prompt).unwrap();
    render(&m, "add seq 1 with 40 tokens");
    m.fork(1, 2).unwrap();
    render(&m, "fork 1 -> 2");
    m.append(2, &[100, 101]).unwrap();
    render(
        &m,
        "append 2 tokens to seq 2 (copy-on-write of the shared partial block)",
    );
    m.append(1, &(200..210).collect::<Vec<u32>>()).unwrap();
    render(&m, "append 10 tokens to seq 1");
    let mut p3: Vec<u32> = (0..32).collect();
    p3.extend([300, 301, 302, 303, 304]);
    m.add_sequence(3, &p3).unwrap();
    render(
        &m,
        "add seq 3 sharing seq 1's first 32 tokens (two cache hits)",
    );
    m.free_sequence(1).unwrap();
    render(&m, "free seq 1");
    let mut p4: Vec<u32> = (0..40).collect();
    p4.extend(200..208);
    p4.extend([400, 401]);
    m.add_sequence(4, &p4).unwrap();
    render(
        &m,
        "add seq 4 with seq 1's first 48 tokens (three cache hits)",
    );
    m.drop_blocks(4, &[1]).unwrap();
    render(&m, "drop logical block 1 of seq 4");
    m.check_invariants().unwrap();

    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/kv-paged/block_tables.golden"
    );
    if std::env::var("UPDATE_GOLDENS").is_ok() {
        std::fs::write(path, &out).unwrap();
    }
    let golden = std::fs::read_to_string(path).expect("golden exists (UPDATE_GOLDENS=1 makes it)");
    assert_eq!(
        out, golden,
        "block tables changed; inspect and regenerate with UPDATE_GOLDENS=1"
    );
}

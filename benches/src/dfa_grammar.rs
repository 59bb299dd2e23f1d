//! The previous grammar engine of `pipeline` (until it moved to llguidance), kept only as the
//! peer the `grammar_mask` bench measures llguidance against in the same run: a regular
//! expression (or a JSON schema converted to one) compiled to a byte DFA, and a token trie walked
//! per mask step. Nothing in the runtime uses it. Its design, as it was:
//!
//! # Design
//! - The pattern is compiled by regex-automata to a dense DFA over bytes, anchored at the start,
//!   with `MatchKind::All` so that no alternative is dropped after an earlier one matched (`a|ab`
//!   must still allow `b` after `a`). Its states reachable from the start are then copied into a
//!   table of our own, and every state from which no accepting state can be reached is merged
//!   into the dead state. So "not dead" means exactly "still a prefix of some match": the raw
//!   DFA reports a match one byte late and keeps states that can no longer match.
//! - Tokens are the bytes they stand for (`pipeline::model::tokenizer::Tokenizer::token_bytes`),
//!   sorted once into a byte trie laid out in preorder. A mask step walks that array from the
//!   current state, skipping a whole subtree at the first byte that dies, so it costs one table
//!   lookup per trie node whose prefix is still alive: a few hundred at structural JSON
//!   positions, all of the trie (100,297 nodes for SmolLM2's 49,152 tokens) only where nearly
//!   any text is allowed, such as inside a JSON string. The step is branch-free but for the
//!   dead check (each node holds its token id, inner nodes a spare bit past the ids); on one
//!   core that is about 3-5 µs at structural points and 150 µs inside a string
//!   (`cargo bench -p benches -- grammar`).
//! - A JSON schema becomes a regular expression the way outlines and llama.cpp build one:
//!   properties in declared order (serde_json's `preserve_order` is enabled for this), optional
//!   properties may be left out, whitespace between tokens is bounded (llama.cpp's `space` rule by
//!   default) and numbers have at most 16 digits per part, so a small model cannot loop forever
//!   on spaces or digits. Anything that would make the language non-regular or that is not
//!   implemented is refused with the keyword named, never approximated.
//!
//! # Invariants
//! - A token is allowed in state `s` iff walking its bytes from `s` never reaches the dead state;
//!   an end-of-generation id iff `s` is accepting. Special tokens (no bytes), empty tokens and ids
//!   outside the vocabulary are never allowed.
//! - Every state but the dead one can still reach acceptance, so text built from allowed tokens
//!   can always be completed, unless the vocabulary cannot spell any continuation, which
//!   [`Grammar::mask`] reports as [`GrammarError::NoTokenAllowed`].
//! - Patterns and schemas are untrusted input: the DFA size and schema nesting are bounded and
//!   every failure is a [`GrammarError`], never a panic.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::nfa::thompson;
use regex_automata::util::primitives::StateID;
use regex_automata::util::{start, syntax};
use regex_automata::{Anchored, MatchKind};
use serde_json::Value;

/// Deepest nesting of a JSON schema (objects, arrays, anyOf) that is converted.
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// Longest token, in bytes, that a grammar can allow; longer ones (none in real vocabularies)
/// are never allowed.
const MAX_TOKEN_BYTES: usize = u16::MAX as usize;

/// Row of the dead state: every transition of it leads back to it.
const DEAD: u32 = 0;

const FLAG_ACCEPT: u8 = 1;
const FLAG_EXHAUSTED: u8 = 2;

/// What can go wrong while building or using a grammar.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GrammarError {
    /// The pattern does not parse, or needs something a DFA cannot do (Unicode word boundaries).
    #[error("the regular expression {pattern:?} does not compile to a byte DFA: {source}")]
    Regex {
        /// The pattern.
        pattern: String,
        /// regex-automata's error.
        #[source]
        source: Box<dense::BuildError>,
    },
    /// The DFA would exceed the size limit.
    #[error(
        "the grammar's DFA needs more than {max} bytes; bound fewer repetitions (maxLength, \
         maxItems, `{{n,m}}`) or raise GrammarOptions::max_dfa_bytes"
    )]
    TooLarge {
        /// The limit, [`GrammarOptions::max_dfa_bytes`].
        max: usize,
    },
    /// The DFA cannot start or step here (a look-behind it was not built for).
    #[error("the regular expression {pattern:?} cannot be followed byte by byte: {what}")]
    Unsupported {
        /// The pattern.
        pattern: String,
        /// What failed.
        what: String,
    },
    /// The pattern matches no text at all.
    #[error("the regular expression {pattern:?} matches no text, so nothing could be generated")]
    EmptyLanguage {
        /// The pattern.
        pattern: String,
    },
    /// A JSON schema keyword (or form) that is not converted.
    #[error(
        "JSON schema: `{keyword}` at {path} is not supported; supported are type (object, \
         string, integer, number, boolean, null, array, or a list of them), properties, \
         required, additionalProperties (true/false), items, minItems, maxItems, minLength, \
         maxLength, enum, const, anyOf and annotations (title, description, default, ...)"
    )]
    UnsupportedSchema {
        /// The keyword, or a description of the unsupported form.
        keyword: String,
        /// JSON pointer of the schema that has it (`#/properties/name`).
        path: String,
    },
    /// A JSON schema that is malformed or cannot be satisfied.
    #[error("JSON schema at {path}: {reason}")]
    InvalidSchema {
        /// JSON pointer of the offending schema.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The sampled token cannot continue the text here.
    #[error(
        "token {token} is not allowed by the grammar in this state; mask the logits with \
         Grammar::mask before sampling"
    )]
    TokenNotAllowed {
        /// The token id.
        token: u32,
    },
    /// A token id outside the vocabulary the grammar was built with.
    #[error("token id {token} is outside the grammar's vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// No token of the vocabulary (within the logits) can continue the text, and ending is not
    /// allowed either.
    #[error(
        "no token can continue the grammar here ({}); the vocabulary cannot spell any \
         continuation, so generation cannot go on",
        if *.accepting { "the text is complete but no end-of-generation id is in the logits" }
        else { "the text is incomplete" }
    )]
    NoTokenAllowed {
        /// Whether the text so far already matches (only an end-of-generation id was missing).
        accepting: bool,
    },
    /// A [`GrammarState`] of another grammar.
    #[error(
        "the grammar state does not belong to this grammar; use states from this grammar's \
         start() and advance()"
    )]
    ForeignState,
}

/// How much whitespace a JSON schema grammar allows between tokens (after `{`, `[`, `,`, `:`
/// and before `}`, `]`, `,`, `:`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Whitespace {
    /// llama.cpp's `space` rule: nothing, one space, or one or two newlines and up to 20 spaces
    /// or tabs of indentation, so pretty-printed JSON can be written but not padded forever.
    #[default]
    Bounded,
    /// outlines' default, `[ ]?`: at most one space, no newlines.
    Compact,
    /// No whitespace at all.
    None,
}

impl Whitespace {
    fn pattern(self) -> &'static str {
        match self {
            Self::Bounded => r"(?:[ ]?|\n{1,2}[ \t]{0,20})",
            Self::Compact => "[ ]?",
            Self::None => "",
        }
    }
}

/// How a grammar is built; `..Default::default()` for the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarOptions {
    /// Most bytes the DFA may take, while being built and once built (64 MiB by default).
    pub max_dfa_bytes: usize,
    /// Whitespace a JSON schema grammar allows between tokens.
    pub whitespace: Whitespace,
}

impl Default for GrammarOptions {
    fn default() -> Self {
        Self {
            max_dfa_bytes: 64 << 20,
            whitespace: Whitespace::default(),
        }
    }
}

/// The bytes of every token id, which ids end generation, and the byte trie a mask step walks.
///
/// Cheap to clone (shared); build it once per tokenizer and pass it to every grammar.
#[derive(Clone)]
pub struct TokenVocab {
    index: Arc<VocabIndex>,
}

struct VocabIndex {
    /// Token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// Whether a token has bytes at all (a special token has none, which differs from empty).
    has_bytes: Vec<bool>,
    /// End-of-generation ids, sorted, all within the vocabulary.
    eos: Vec<u32>,
    /// The trie of every token with bytes (end-of-generation ids excluded), in preorder.
    nodes: Vec<Node>,
    /// Further ids of a byte string that several ids share, as (node, id), by node.
    extra_tokens: Vec<(u32, u32)>,
    /// Longest token in bytes, the depth of the trie.
    max_depth: usize,
}

/// One trie node: the byte on the edge into it, the token that ends here and where its subtree
/// ends.
#[derive(Debug, Clone, Copy)]
struct Node {
    /// Index of the first node after this node's subtree.
    end: u32,
    /// The id that ends here or, for an inner node, the vocabulary size: one bit past the ids,
    /// so that a mask step sets a bit for every live node without a branch.
    token: u32,
    /// Depth, 1 for a child of the root.
    depth: u16,
    byte: u8,
    /// Whether `extra_tokens` has ids for this node too.
    extra: bool,
}

impl fmt::Debug for TokenVocab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenVocab")
            .field("len", &self.len())
            .field("eos", &self.index.eos)
            .field("trie_nodes", &self.index.nodes.len())
            .field("max_depth", &self.index.max_depth)
            .finish_non_exhaustive()
    }
}

impl TokenVocab {
    /// A vocabulary from the bytes of each id (`None` for special tokens) and the ids that end
    /// generation. An end-of-generation id is never walked as bytes; ids outside `tokens` are
    /// dropped from `eos`.
    pub fn new(tokens: Vec<Option<Vec<u8>>>, eos_ids: &[u32]) -> Self {
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        let mut has_bytes = Vec::with_capacity(tokens.len());
        offsets.push(0);
        for token in &tokens {
            has_bytes.push(token.is_some());
            bytes.extend_from_slice(token.as_deref().unwrap_or_default());
            offsets.push(bytes.len());
        }
        let mut eos: Vec<u32> = eos_ids
            .iter()
            .copied()
            .filter(|&id| usize::try_from(id).is_ok_and(|i| i < tokens.len()))
            .collect();
        eos.sort_unstable();
        eos.dedup();

        // Tokens the trie holds, in byte order, so that shared prefixes are adjacent.
        let token_bytes = |id: u32| {
            let i = id as usize;
            &bytes[offsets[i]..offsets[i + 1]]
        };
        let mut order: Vec<u32> = (0..tokens.len())
            .filter_map(|i| u32::try_from(i).ok())
            .filter(|&id| {
                let len = token_bytes(id).len();
                len > 0 && len <= MAX_TOKEN_BYTES && eos.binary_search(&id).is_err()
            })
            .collect();
        order.sort_by(|&a, &b| token_bytes(a).cmp(token_bytes(b)).then(a.cmp(&b)));

        let inner = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
        let mut nodes: Vec<Node> = Vec::new();
        let mut extra_tokens = Vec::new();
        // Nodes on the path to the last token, by depth - 1.
        let mut path: Vec<usize> = Vec::new();
        let mut previous: &[u8] = &[];
        let mut max_depth = 0;
        for &id in &order {
            let token = token_bytes(id);
            let shared = token
                .iter()
                .zip(previous)
                .take_while(|(a, b)| a == b)
                .count();
            while path.len() > shared {
                if let Some(done) = path.pop() {
                    nodes[done].end = nodes.len() as u32;
                }
            }
            for (depth, &byte) in token.iter().enumerate().skip(shared) {
                path.push(nodes.len());
                nodes.push(Node {
                    end: 0,
                    token: inner,
                    depth: (depth + 1) as u16,
                    byte,
                    extra: false,
                });
            }
            // Sorted order puts every token at the deepest node on the path, the last one made
            // (or, for a repeated byte string, the one made for its first id).
            let last = nodes.len() - 1;
            if nodes[last].token == inner {
                nodes[last].token = id;
            } else {
                nodes[last].extra = true;
                extra_tokens.push((last as u32, id));
            }
            max_depth = max_depth.max(token.len());
            previous = token;
        }
        for done in path.drain(..) {
            nodes[done].end = nodes.len() as u32;
        }
        Self {
            index: Arc::new(VocabIndex {
                bytes,
                offsets,
                has_bytes,
                eos,
                nodes,
                extra_tokens,
                max_depth,
            }),
        }
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.index.has_bytes.len()
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of `id`, or `None` for a special token or an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.index.token_bytes(id)
    }

    /// The end-of-generation ids, sorted.
    pub fn eos_ids(&self) -> &[u32] {
        &self.index.eos
    }
}

impl VocabIndex {
    fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = usize::try_from(id).ok()?;
        if !*self.has_bytes.get(i)? {
            return None;
        }
        Some(&self.bytes[self.offsets[i]..self.offsets[i + 1]])
    }
}

/// Where generation stands in a [`Grammar`]: the DFA state after the text so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrammarState(u32);

/// A regular language over bytes, bound to a vocabulary: which tokens may come next.
pub struct Grammar {
    vocab: Arc<VocabIndex>,
    pattern: String,
    /// Byte to equivalence class (column).
    classes: [u8; 256],
    /// Columns per row.
    stride: usize,
    /// `table[row + class]` is the next row; rows are premultiplied by `stride`, row 0 is dead.
    table: Vec<u32>,
    /// Per state (row / stride): [`FLAG_ACCEPT`], [`FLAG_EXHAUSTED`].
    flags: Vec<u8>,
    start: u32,
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar")
            .field("pattern", &self.pattern)
            .field("states", &self.flags.len())
            .field("byte_classes", &self.stride)
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// The grammar of a regular expression (regex crate syntax, Unicode on), which the whole
    /// generated text must match.
    ///
    /// # Errors
    /// [`GrammarError::Regex`] for a pattern that does not compile, [`GrammarError::TooLarge`]
    /// past the default DFA size limit, [`GrammarError::EmptyLanguage`] for one that matches
    /// nothing.
    pub fn regex(pattern: &str, vocab: &TokenVocab) -> Result<Self, GrammarError> {
        Self::regex_with(pattern, vocab, &GrammarOptions::default())
    }

    /// [`Grammar::regex`] with options.
    ///
    /// # Errors
    /// As [`Grammar::regex`].
    pub fn regex_with(
        pattern: &str,
        vocab: &TokenVocab,
        options: &GrammarOptions,
    ) -> Result<Self, GrammarError> {
        let compiled = Compiled::build(pattern, options.max_dfa_bytes)?;
        Ok(Self {
            vocab: Arc::clone(&vocab.index),
            pattern: pattern.to_owned(),
            classes: compiled.classes,
            stride: compiled.stride,
            table: compiled.table,
            flags: compiled.flags,
            start: compiled.start,
        })
    }

    /// The grammar of JSON text valid against `schema` (see [`schema_to_regex`] for the subset).
    ///
    /// # Errors
    /// [`GrammarError::UnsupportedSchema`] / [`GrammarError::InvalidSchema`] from the conversion,
    /// then as [`Grammar::regex`].
    pub fn json_schema(schema: &Value, vocab: &TokenVocab) -> Result<Self, GrammarError> {
        Self::json_schema_with(schema, vocab, &GrammarOptions::default())
    }

    /// [`Grammar::json_schema`] with options.
    ///
    /// # Errors
    /// As [`Grammar::json_schema`].
    pub fn json_schema_with(
        schema: &Value,
        vocab: &TokenVocab,
        options: &GrammarOptions,
    ) -> Result<Self, GrammarError> {
        let pattern = schema_to_regex(schema, options.whitespace)?;
        Self::regex_with(&pattern, vocab, options)
    }

    /// The regular expression this grammar was built from (a JSON schema's conversion).
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Number of DFA states, the dead one included.
    pub fn state_count(&self) -> usize {
        self.flags.len()
    }

    /// The state before any text.
    pub fn start(&self) -> GrammarState {
        GrammarState(self.start)
    }

    /// Whether the text so far matches: an end-of-generation id is allowed.
    pub fn is_complete(&self, state: GrammarState) -> bool {
        self.flag(state) & FLAG_ACCEPT != 0
    }

    /// Whether the text so far matches and no byte can follow it: generation must stop.
    pub fn is_exhausted(&self, state: GrammarState) -> bool {
        self.flag(state) & FLAG_EXHAUSTED != 0
    }

    fn flag(&self, state: GrammarState) -> u8 {
        self.flags
            .get(state.0 as usize / self.stride)
            .copied()
            .unwrap_or(0)
    }

    /// The row of `state`, checked to be one of this grammar's.
    fn row(&self, state: GrammarState) -> Result<u32, GrammarError> {
        let row = state.0 as usize;
        if row.is_multiple_of(self.stride) && row < self.table.len() && row != DEAD as usize {
            Ok(state.0)
        } else {
            Err(GrammarError::ForeignState)
        }
    }

    fn step(&self, row: u32, byte: u8) -> u32 {
        self.table[row as usize + usize::from(self.classes[usize::from(byte)])]
    }

    /// The state after `bytes` from `state`, or `None` when they cannot continue the text.
    ///
    /// # Errors
    /// [`GrammarError::ForeignState`] for a state of another grammar.
    pub fn advance_bytes(
        &self,
        state: GrammarState,
        bytes: &[u8],
    ) -> Result<Option<GrammarState>, GrammarError> {
        let mut row = self.row(state)?;
        for &byte in bytes {
            row = self.step(row, byte);
            if row == DEAD {
                return Ok(None);
            }
        }
        Ok(Some(GrammarState(row)))
    }

    /// Whether `text` as a whole matches the grammar.
    pub fn accepts(&self, text: &[u8]) -> bool {
        matches!(
            self.advance_bytes(self.start(), text),
            Ok(Some(state)) if self.is_complete(state)
        )
    }

    /// The state after sampling `token` in `state`. An end-of-generation id leaves the state as
    /// it is (generation ends there).
    ///
    /// # Errors
    /// [`GrammarError::TokenNotAllowed`] when [`Grammar::mask`] would have forbidden the token,
    /// [`GrammarError::TokenOutOfVocab`], [`GrammarError::ForeignState`].
    pub fn advance(&self, state: GrammarState, token: u32) -> Result<GrammarState, GrammarError> {
        self.row(state)?;
        let vocab_size = self.vocab.has_bytes.len();
        if usize::try_from(token).map_or(true, |t| t >= vocab_size) {
            return Err(GrammarError::TokenOutOfVocab { token, vocab_size });
        }
        let not_allowed = GrammarError::TokenNotAllowed { token };
        if self.vocab.eos.binary_search(&token).is_ok() {
            return if self.is_complete(state) {
                Ok(state)
            } else {
                Err(not_allowed)
            };
        }
        match self.vocab.token_bytes(token) {
            Some(bytes) if !bytes.is_empty() && bytes.len() <= MAX_TOKEN_BYTES => {
                self.advance_bytes(state, bytes)?.ok_or(not_allowed)
            }
            _ => Err(not_allowed),
        }
    }

    /// Sets the logit of every token not allowed in `state` to `f32::NEG_INFINITY` and returns
    /// how many are allowed. Ids past the vocabulary (a padded output layer) are never allowed;
    /// vocabulary ids past `logits` are ignored.
    ///
    /// # Errors
    /// [`GrammarError::NoTokenAllowed`] when no id within `logits` is allowed; the logits are
    /// then left as they were. [`GrammarError::ForeignState`].
    pub fn mask(&self, state: GrammarState, logits: &mut [f32]) -> Result<usize, GrammarError> {
        let allowed = self.allowed_bits(state)?;
        let limit = logits.len().min(self.vocab.has_bytes.len());
        let full = limit / 64;
        let partial = allowed
            .get(full)
            .map_or(0, |&w| (w & ((1u64 << (limit % 64)) - 1)).count_ones());
        let count = allowed[..full].iter().map(|w| w.count_ones()).sum::<u32>() + partial;
        if count == 0 {
            return Err(GrammarError::NoTokenAllowed {
                accepting: self.is_complete(state),
            });
        }
        let words = allowed.iter().copied().chain(std::iter::repeat(0));
        for (chunk, word) in logits.chunks_mut(64).zip(words) {
            match word {
                u64::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word >> bit & 1 == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        Ok(count as usize)
    }

    /// The ids allowed in `state`, ascending (for inspection; sampling uses [`Grammar::mask`]).
    ///
    /// # Errors
    /// [`GrammarError::ForeignState`].
    pub fn allowed_tokens(&self, state: GrammarState) -> Result<Vec<u32>, GrammarError> {
        let allowed = self.allowed_bits(state)?;
        Ok(allowed
            .iter()
            .enumerate()
            .flat_map(|(w, &word)| {
                (0..64u32)
                    .filter(move |bit| word >> bit & 1 != 0)
                    .map(move |bit| w as u32 * 64 + bit)
            })
            .collect())
    }

    /// One bit per vocabulary id, set for the ids allowed in `state` (no bit past the ids).
    fn allowed_bits(&self, state: GrammarState) -> Result<Vec<u64>, GrammarError> {
        let start = self.row(state)?;
        let vocab = &*self.vocab;
        let inner = vocab.has_bytes.len();
        let mut bits = vec![0u64; (inner + 1).div_ceil(64)];
        let mut set = |id: usize| bits[id / 64] |= 1 << (id % 64);
        if self.is_complete(state) {
            vocab.eos.iter().for_each(|&id| set(id as usize));
        }
        // The state after each prefix on the current trie path, by depth. Every step is
        // branch-free but for the dead check, which is well predicted (runs of live or dead
        // siblings); a data-dependent branch per node costs more than the walk itself.
        let mut rows = vec![start; vocab.max_depth + 1];
        let mut i = 0;
        while let Some(node) = vocab.nodes.get(i) {
            let depth = usize::from(node.depth);
            let row = self.step(rows[depth - 1], node.byte);
            if row == DEAD {
                i = node.end as usize;
                continue;
            }
            rows[depth] = row;
            set(node.token as usize);
            if node.extra {
                let first = vocab
                    .extra_tokens
                    .partition_point(|&(n, _)| (n as usize) < i);
                for &(_, id) in vocab.extra_tokens[first..]
                    .iter()
                    .take_while(|&&(n, _)| n as usize == i)
                {
                    set(id as usize);
                }
            }
            i += 1;
        }
        // Inner nodes set the bit past the ids.
        bits[inner / 64] &= !(1 << (inner % 64));
        Ok(bits)
    }
}

/// Masks `logits` for `state` (see [`Grammar::mask`]): the one call a sampling loop needs
/// before it samples.
///
/// # Errors
/// As [`Grammar::mask`].
/// A pattern compiled to our table.
struct Compiled {
    classes: [u8; 256],
    stride: usize,
    table: Vec<u32>,
    flags: Vec<u8>,
    start: u32,
}

impl Compiled {
    fn build(pattern: &str, max_bytes: usize) -> Result<Self, GrammarError> {
        let too_large = GrammarError::TooLarge { max: max_bytes };
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    .match_kind(MatchKind::All)
                    .minimize(false)
                    .accelerate(false)
                    .specialize_start_states(false)
                    .dfa_size_limit(Some(max_bytes))
                    .determinize_size_limit(Some(max_bytes)),
            )
            .syntax(syntax::Config::new().unicode(true).utf8(true))
            .thompson(thompson::Config::new().nfa_size_limit(Some(max_bytes)))
            .build(pattern)
            .map_err(|source| {
                let nfa_too_large = std::error::Error::source(&source)
                    .and_then(|e| e.downcast_ref::<thompson::BuildError>())
                    .is_some_and(|e| e.size_limit().is_some());
                if source.is_size_limit_exceeded() || nfa_too_large {
                    GrammarError::TooLarge { max: max_bytes }
                } else {
                    GrammarError::Regex {
                        pattern: pattern.to_owned(),
                        source: Box::new(source),
                    }
                }
            })?;
        let unsupported = |what: String| GrammarError::Unsupported {
            pattern: pattern.to_owned(),
            what,
        };
        let dfa_start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| unsupported(e.to_string()))?;

        // Columns: one per byte class, each walked through one byte of it.
        let byte_classes = dfa.byte_classes();
        let mut classes = [0u8; 256];
        let mut representative = [0u8; 256];
        let mut stride = 0;
        for byte in 0..=255u8 {
            let class = byte_classes.get(byte);
            classes[usize::from(byte)] = class;
            representative[usize::from(class)] = byte;
            stride = stride.max(usize::from(class) + 1);
        }

        // Every state reachable from the start, numbered in discovery order from 1 (0 is dead).
        let mut ids: HashMap<StateID, u32> = HashMap::new();
        let mut order: Vec<StateID> = Vec::new();
        let mut edges: Vec<u32> = vec![DEAD; stride];
        let mut accept: Vec<bool> = vec![false];
        if dfa.is_dead_state(dfa_start) {
            return Err(GrammarError::EmptyLanguage {
                pattern: pattern.to_owned(),
            });
        }
        ids.insert(dfa_start, 1);
        order.push(dfa_start);
        let mut next = 0;
        while let Some(&state) = order.get(next) {
            next += 1;
            accept.push(dfa.is_match_state(dfa.next_eoi_state(state)));
            for &byte in &representative[..stride] {
                let to = dfa.next_state(state, byte);
                let id = if dfa.is_dead_state(to) {
                    DEAD
                } else if dfa.is_quit_state(to) {
                    return Err(unsupported(format!("byte {byte:#04x} quits the DFA")));
                } else {
                    let fresh = order.len() as u32 + 1;
                    let id = *ids.entry(to).or_insert(fresh);
                    if id == fresh {
                        order.push(to);
                    }
                    id
                };
                edges.push(id);
            }
            if edges.len().saturating_mul(size_of::<u32>()) > max_bytes
                || edges.len() > u32::MAX as usize
            {
                return Err(too_large);
            }
        }
        let states = accept.len();

        // Live states: those that can reach an accepting one, found backwards over the edges
        // (predecessor lists in one array: those of `s` are `preds[first[s]..first[s + 1]]`).
        let mut first = vec![0usize; states + 1];
        for &to in &edges[stride..] {
            first[to as usize + 1] += 1;
        }
        for s in 0..states {
            first[s + 1] += first[s];
        }
        let mut fill = first.clone();
        let mut preds = vec![0u32; first[states]];
        for (from, row) in edges.chunks(stride).enumerate().skip(1) {
            for &to in row {
                preds[fill[to as usize]] = from as u32;
                fill[to as usize] += 1;
            }
        }
        let mut live = accept.clone();
        let mut stack: Vec<usize> = (1..states).filter(|&s| accept[s]).collect();
        while let Some(s) = stack.pop() {
            for &p in &preds[first[s]..first[s + 1]] {
                if !live[p as usize] {
                    live[p as usize] = true;
                    stack.push(p as usize);
                }
            }
        }
        if !live[1] {
            return Err(GrammarError::EmptyLanguage {
                pattern: pattern.to_owned(),
            });
        }

        // Renumber the live states into premultiplied rows; edges to dead-ended states go dead.
        let mut row_of = vec![DEAD; states];
        let mut rows = 1usize;
        for s in 1..states {
            if live[s] {
                row_of[s] = (rows * stride) as u32;
                rows += 1;
            }
        }
        let mut table = vec![DEAD; rows * stride];
        let mut flags = vec![0u8; rows];
        for s in (1..states).filter(|&s| live[s]) {
            let row = row_of[s] as usize;
            let out = &mut table[row..row + stride];
            for (slot, &to) in out.iter_mut().zip(&edges[s * stride..(s + 1) * stride]) {
                *slot = row_of[to as usize];
            }
            let mut flag = 0;
            if accept[s] {
                flag |= FLAG_ACCEPT;
                if out.iter().all(|&to| to == DEAD) {
                    flag |= FLAG_EXHAUSTED;
                }
            }
            flags[row / stride] = flag;
        }
        Ok(Self {
            classes,
            stride,
            table,
            flags,
            start: row_of[1],
        })
    }
}

/// The regular expression of JSON text valid against `schema`, as [`Grammar::json_schema`]
/// builds it.
///
/// Converted: `type` (`object`, `string`, `integer`, `number`, `boolean`, `null`, `array`, or a
/// list of them); for objects `properties` (in declared order), `required` and
/// `additionalProperties` true or false (extra properties are never generated); for arrays
/// `items`, `minItems`, `maxItems`; for strings `minLength`, `maxLength`; `enum`, `const`,
/// `anyOf`; annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`,
/// `$comment`, `$defs`, `definitions`, `deprecated`, `readOnly`, `writeOnly`) are ignored.
/// Integers and each part of a number have at most 16 digits, as in llama.cpp.
///
/// # Errors
/// [`GrammarError::UnsupportedSchema`] naming any other keyword (`pattern`, `format`,
/// `minimum`, `$ref`, `oneOf`, ...) or form (an object without `properties`, an array without
/// `items`, a schema that allows any value); [`GrammarError::InvalidSchema`] for malformed or
/// unsatisfiable schemas; both when nesting is deeper than [`MAX_SCHEMA_DEPTH`].
pub fn schema_to_regex(schema: &Value, whitespace: Whitespace) -> Result<String, GrammarError> {
    SchemaConverter {
        ws: whitespace.pattern(),
    }
    .convert(schema, "#", 0)
}

/// The longest regular expression a schema may become (each level is checked, so no level
/// builds more than a few times this).
pub const MAX_SCHEMA_REGEX_BYTES: usize = 1 << 20;

/// One JSON string character: anything but `"`, `\` and control characters, or an escape.
const JSON_CHAR: &str = r#"(?:[^"\\\x00-\x1F\x7F]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))"#;
/// llama.cpp's integral part: at most 16 digits, no leading zero.
const JSON_INTEGER: &str = "-?(?:0|[1-9][0-9]{0,15})";
const JSON_NUMBER: &str =
    r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][-+]?(?:0|[1-9][0-9]{0,15}))?";

const ANNOTATIONS: [&str; 12] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
];
const CONSTRAINTS: [&str; 12] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "enum",
    "const",
    "anyOf",
];

struct SchemaConverter {
    ws: &'static str,
}

impl SchemaConverter {
    /// The schema at `path` as a regular expression, refused once it passes
    /// [`MAX_SCHEMA_REGEX_BYTES`]: each nested array or alternative repeats its child's pattern,
    /// so a few hundred bytes of schema can ask for gigabytes of pattern.
    fn convert(&self, schema: &Value, path: &str, depth: usize) -> Result<String, GrammarError> {
        let pattern = self.convert_unbounded(schema, path, depth)?;
        if pattern.len() > MAX_SCHEMA_REGEX_BYTES {
            return Err(GrammarError::InvalidSchema {
                path: path.to_owned(),
                reason: format!(
                    "its regular expression passes {MAX_SCHEMA_REGEX_BYTES} bytes ({} here): \
                     nested arrays and alternatives repeat their items; flatten the schema",
                    pattern.len()
                ),
            });
        }
        Ok(pattern)
    }

    fn convert_unbounded(
        &self,
        schema: &Value,
        path: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let invalid = |reason: String| GrammarError::InvalidSchema {
            path: path.to_owned(),
            reason,
        };
        let unsupported = |keyword: &str| GrammarError::UnsupportedSchema {
            keyword: keyword.to_owned(),
            path: path.to_owned(),
        };
        if depth > MAX_SCHEMA_DEPTH {
            return Err(invalid(format!(
                "nested deeper than {MAX_SCHEMA_DEPTH} levels"
            )));
        }
        let map = match schema {
            Value::Object(map) => map,
            Value::Bool(true) => return Err(unsupported("true (any value)")),
            Value::Bool(false) => return Err(invalid("`false` allows no value".into())),
            other => return Err(invalid(format!("a schema is an object, not {other}"))),
        };
        if let Some(keyword) = map
            .keys()
            .find(|k| !ANNOTATIONS.contains(&k.as_str()) && !CONSTRAINTS.contains(&k.as_str()))
        {
            return Err(unsupported(keyword));
        }
        if let Some(value) = map.get("const") {
            return Ok(literal(value));
        }
        if let Some(values) = map.get("enum") {
            let values = values
                .as_array()
                .ok_or_else(|| invalid("`enum` is not an array".into()))?;
            if values.is_empty() {
                return Err(invalid("`enum` is empty, so no value is valid".into()));
            }
            let alternatives: Vec<String> = values.iter().map(literal).collect();
            return Ok(format!("(?:{})", alternatives.join("|")));
        }
        if let Some(branches) = map.get("anyOf") {
            if let Some(keyword) = map
                .keys()
                .find(|k| CONSTRAINTS.contains(&k.as_str()) && *k != "anyOf")
            {
                return Err(unsupported(&format!("{keyword} beside anyOf")));
            }
            let branches = branches
                .as_array()
                .filter(|b| !b.is_empty())
                .ok_or_else(|| invalid("`anyOf` is not a non-empty array".into()))?;
            let alternatives = branches
                .iter()
                .enumerate()
                .map(|(i, b)| self.convert(b, &format!("{path}/anyOf/{i}"), depth + 1))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(format!("(?:{})", alternatives.join("|")));
        }
        let types: Vec<&str> = match map.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(list)) if !list.is_empty() => list
                .iter()
                .map(|t| {
                    t.as_str()
                        .ok_or_else(|| invalid(format!("`type` lists {t}, not a type name")))
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(invalid(format!("`type` is {other}"))),
            None if map.contains_key("properties") => vec!["object"],
            None if map.contains_key("items") => vec!["array"],
            None => {
                return Err(unsupported(
                    "a schema without type, enum, const or anyOf (any value)",
                ));
            }
        };
        let alternatives = types
            .iter()
            .map(|&t| self.typed(t, map, path, depth))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(match alternatives.as_slice() {
            [one] => one.clone(),
            many => format!("(?:{})", many.join("|")),
        })
    }

    fn typed(
        &self,
        ty: &str,
        map: &serde_json::Map<String, Value>,
        path: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let invalid = |reason: String| GrammarError::InvalidSchema {
            path: path.to_owned(),
            reason,
        };
        let count = |key: &str| -> Result<Option<u64>, GrammarError> {
            map.get(key)
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| invalid(format!("`{key}` is {v}, not a count")))
                })
                .transpose()
        };
        let ws = self.ws;
        match ty {
            "string" => {
                let (min, max) = (count("minLength")?.unwrap_or(0), count("maxLength")?);
                Ok(format!("\"{JSON_CHAR}{}\"", repeat(min, max, &invalid)?))
            }
            "integer" => Ok(JSON_INTEGER.to_owned()),
            "number" => Ok(JSON_NUMBER.to_owned()),
            "boolean" => Ok("(?:true|false)".to_owned()),
            "null" => Ok("null".to_owned()),
            "array" => {
                let items = match map.get("items") {
                    Some(items @ (Value::Object(_) | Value::Bool(_))) => items,
                    Some(_) => {
                        return Err(GrammarError::UnsupportedSchema {
                            keyword: "items (a list of schemas)".into(),
                            path: path.to_owned(),
                        });
                    }
                    None => {
                        return Err(GrammarError::UnsupportedSchema {
                            keyword: "array without items".into(),
                            path: path.to_owned(),
                        });
                    }
                };
                let item = self.convert(items, &format!("{path}/items"), depth + 1)?;
                let (min, max) = (count("minItems")?.unwrap_or(0), count("maxItems")?);
                let more = format!("(?:{ws},{ws}{item})");
                Ok(match (min, max) {
                    (_, Some(0)) => format!(r"\[{ws}\]"),
                    (0, max) => format!(
                        r"\[{ws}(?:{item}{more}{})?{ws}\]",
                        repeat(0, max.map(|m| m - 1), &invalid)?
                    ),
                    (min, max) => format!(
                        r"\[{ws}{item}{more}{}{ws}\]",
                        repeat(min - 1, max.map(|m| m.saturating_sub(1)), &invalid)?
                    ),
                })
            }
            "object" => self.object(map, path, depth),
            other => Err(invalid(format!("`type` {other:?} is not a JSON type"))),
        }
    }

    fn object(
        &self,
        map: &serde_json::Map<String, Value>,
        path: &str,
        depth: usize,
    ) -> Result<String, GrammarError> {
        let invalid = |reason: String| GrammarError::InvalidSchema {
            path: path.to_owned(),
            reason,
        };
        let properties = match map.get("properties") {
            Some(Value::Object(p)) => p,
            Some(other) => return Err(invalid(format!("`properties` is {other}"))),
            None => {
                return Err(GrammarError::UnsupportedSchema {
                    keyword: "object without properties".into(),
                    path: path.to_owned(),
                });
            }
        };
        match map.get("additionalProperties") {
            None | Some(Value::Bool(_)) => {}
            Some(_) => {
                return Err(GrammarError::UnsupportedSchema {
                    keyword: "additionalProperties (a schema)".into(),
                    path: path.to_owned(),
                });
            }
        }
        let required: Vec<&str> = match map.get("required") {
            None => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .map(|r| {
                    r.as_str()
                        .ok_or_else(|| invalid(format!("`required` lists {r}, not a name")))
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(invalid(format!("`required` is {other}"))),
        };
        if let Some(missing) = required.iter().find(|r| !properties.contains_key(**r)) {
            return Err(invalid(format!(
                "required property {missing:?} is not in properties, so it cannot be generated"
            )));
        }
        let ws = self.ws;
        let mut members = Vec::with_capacity(properties.len());
        for (name, schema) in properties {
            let value = self.convert(
                schema,
                &format!("{path}/properties/{}", pointer_escape(name)),
                depth + 1,
            )?;
            members.push((
                format!("{}{ws}:{ws}{value}", literal(&Value::String(name.clone()))),
                required.contains(&name.as_str()),
            ));
        }
        // From the last property back: `after_some` is the rest when a property came before
        // (so each one starts with a comma), `after_none` when none did. An optional property
        // may be left out; `after_none` keeps both ways, which is quadratic in the number of
        // optional properties, not exponential.
        let (mut after_some, mut after_none) = (String::new(), String::new());
        for (member, required) in members.iter().rev() {
            let with_comma = format!("{ws},{ws}{member}");
            let (some, none) = if *required {
                (
                    format!("{with_comma}{after_some}"),
                    format!("{member}{after_some}"),
                )
            } else {
                (
                    format!("(?:{with_comma})?{after_some}"),
                    format!("(?:{member}{after_some}|{after_none})"),
                )
            };
            (after_some, after_none) = (some, none);
        }
        Ok(format!(r"\{{{ws}{after_none}{ws}\}}"))
    }
}

/// `{min,max}` (or `*`, `{min,}`) after a repeated item.
fn repeat(
    min: u64,
    max: Option<u64>,
    invalid: &dyn Fn(String) -> GrammarError,
) -> Result<String, GrammarError> {
    Ok(match max {
        Some(max) if max < min => {
            return Err(invalid(format!(
                "the maximum count {max} is below the minimum {min}"
            )));
        }
        Some(max) => format!("{{{min},{max}}}"),
        None if min == 0 => "*".to_owned(),
        None => format!("{{{min},}}"),
    })
}

/// The compact JSON text of `value`, as a regular expression that matches exactly it.
fn literal(value: &Value) -> String {
    escape(&value.to_string())
}

/// `text` with every regex meta character escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if r"\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A property name as a JSON pointer segment (RFC 6901).
fn pointer_escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

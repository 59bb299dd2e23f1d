//! Grammar-constrained sampling on llguidance, the engine llama.cpp and vLLM use: a regular
//! expression, a JSON schema or a Lark grammar restricts which tokens the sampler may pick, so
//! the generated text is guaranteed to match it.
//!
//! Use: build a [`TokenVocab`] once per tokenizer ([`TokenVocab::from_tokenizer`]; it holds the
//! token trie and llguidance's parser factory), a [`Grammar`] per request ([`Grammar::regex`],
//! [`Grammar::json_schema`], [`Grammar::lark`]), a [`GrammarState`] per sequence
//! ([`Grammar::start`]), then per generated token call [`Grammar::mask`] on the logits before
//! sampling and [`Grammar::advance`] with the sampled id after it; stop when an
//! end-of-generation id was sampled or [`Grammar::is_exhausted`] says nothing can follow.
//!
//! # Coverage
//! - JSON schema as llguidance implements it: `$ref` and `$defs`, `oneOf`/`anyOf`/`allOf`,
//!   `pattern`, `format`, numeric bounds (`minimum`, `exclusiveMaximum`, ...), string and array
//!   lengths, `additionalProperties` (schemas too), `enum`, `const`. Separators are fixed
//!   (`", "`, `": "`) with no free whitespace, so a small model cannot pad a reply forever.
//! - Regular expressions (llguidance's syntax, the regex crate's in practice), matched by the
//!   whole reply.
//! - Lark grammars (llguidance's dialect: rules, terminals, `%json` embedded schemas, ...).
//!
//! # Invariants
//! - Grammars are untrusted input: their text is capped at [`MAX_GRAMMAR_BYTES`] and llguidance
//!   runs under its parser limits (grammar size, lexer states, per-step fuel), so a hostile
//!   schema or grammar is a [`GrammarError`], never an unbounded allocation, a hang or a panic
//!   (llguidance turns its own panics into errors).
//! - A token is allowed iff llguidance's mask allows it; every end-of-generation id of the
//!   vocabulary is allowed exactly when the text so far is complete. Special tokens with no
//!   bytes are never allowed otherwise.
//! - [`Grammar::advance`] refuses a token the mask did not allow, so a state always holds text
//!   the grammar can still complete.

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::model::tokenizer::Tokenizer;

/// The longest grammar text (a pattern, a schema, a Lark file) accepted.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;

/// Why a grammar could not be built or followed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GrammarError {
    /// The regular expression, schema or Lark grammar does not compile (or is over
    /// llguidance's limits).
    #[error("the {kind} does not compile: {message}")]
    Invalid {
        /// `regular expression`, `JSON schema` or `Lark grammar`.
        kind: &'static str,
        /// llguidance's message.
        message: String,
    },
    /// The grammar's text is longer than [`MAX_GRAMMAR_BYTES`].
    #[error("the {kind} is {bytes} bytes, over the {MAX_GRAMMAR_BYTES}-byte limit")]
    TooLarge {
        /// What the text is.
        kind: &'static str,
        /// Its length.
        bytes: usize,
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
    /// llguidance failed while following the grammar (a limit reached mid-way, say).
    #[error("the grammar engine failed: {0}")]
    Engine(String),
    /// The tokenizer spells no token as bytes.
    #[error(
        "the tokenizer spells no token as bytes (its decoder is neither byte-level BPE nor \
         SentencePiece), so no grammar can constrain it"
    )]
    NoTokenBytes,
}

/// The bytes of every token id, which ids end generation, and llguidance's token trie and
/// parser factory over them.
///
/// Cheap to clone (shared); build it once per tokenizer and pass it to every grammar.
#[derive(Clone)]
pub struct TokenVocab {
    inner: Arc<VocabInner>,
}

struct VocabInner {
    tokens: Vec<Option<Vec<u8>>>,
    /// End-of-generation ids, sorted, all within the vocabulary.
    eos: Vec<u32>,
    /// The id the trie calls end-of-sequence (the first of `eos`, or a marker past the ids).
    trie_eos: u32,
    factory: ParserFactory,
}

impl fmt::Debug for TokenVocab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenVocab")
            .field("len", &self.len())
            .field("eos", &self.inner.eos)
            .finish_non_exhaustive()
    }
}

impl TokenVocab {
    /// A vocabulary from the bytes of each id (`None` for special tokens) and the ids that end
    /// generation; ids outside `tokens` are dropped from `eos`.
    pub fn new(tokens: Vec<Option<Vec<u8>>>, eos_ids: &[u32]) -> Self {
        let mut eos: Vec<u32> = eos_ids
            .iter()
            .copied()
            .filter(|&id| usize::try_from(id).is_ok_and(|i| i < tokens.len()))
            .collect();
        eos.sort_unstable();
        eos.dedup();
        // Special and empty tokens go into the trie under llguidance's special marker (0xFF,
        // which no UTF-8 text contains), so text never spells them.
        let mut words: Vec<Vec<u8>> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| match t {
                Some(bytes) if !bytes.is_empty() && eos.binary_search(&(id as u32)).is_err() => {
                    bytes.clone()
                }
                _ => {
                    let mut special = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    special.extend(format!("<[{id}]>").bytes());
                    special
                }
            })
            .collect();
        let trie_eos = match eos.first() {
            Some(&id) => id,
            None => {
                // No end-of-generation id: one past the vocabulary, never in the logits.
                words.push(vec![TokTrie::SPECIAL_TOKEN_MARKER, b'<', b'/', b'>']);
                (words.len() - 1) as u32
            }
        };
        let info = TokRxInfo::new(words.len() as u32, trie_eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let caps = InferenceCapabilities {
            ff_tokens: false,
            backtrack: false,
            conditional_ff_tokens: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .expect("llguidance's built-in token slices compile");
        factory.quiet();
        Self {
            inner: Arc::new(VocabInner {
                tokens,
                eos,
                trie_eos,
                factory,
            }),
        }
    }

    /// The vocabulary of `tokenizer`: [`Tokenizer::token_bytes`] of every id, and its
    /// [`Tokenizer::stop_ids`] as the end-of-generation ids.
    ///
    /// # Errors
    /// [`GrammarError::NoTokenBytes`] when the tokenizer spells no token as bytes (a decoder
    /// other than byte-level BPE or SentencePiece).
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let tokens: Vec<Option<Vec<u8>>> = (0..tokenizer.vocab_size())
            .map(|id| {
                u32::try_from(id)
                    .ok()
                    .and_then(|id| tokenizer.token_bytes(id))
            })
            .collect();
        if tokens.iter().all(Option::is_none) {
            return Err(GrammarError::NoTokenBytes);
        }
        Ok(Self::new(tokens, tokenizer.stop_ids()))
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.inner.tokens.len()
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of `id`, or `None` for a special token or an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.inner.tokens.get(id as usize)?.as_deref()
    }

    /// The end-of-generation ids, sorted.
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos
    }

    fn is_eos(&self, id: u32) -> bool {
        self.inner.eos.binary_search(&id).is_ok()
    }
}

/// Where generation stands in a [`Grammar`]: llguidance's parser after the text so far.
pub struct GrammarState {
    matcher: Matcher,
}

impl fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarState")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Clone for GrammarState {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

/// A grammar bound to a vocabulary: which tokens may come next.
pub struct Grammar {
    vocab: TokenVocab,
    /// The parser before any text, cloned for each sequence.
    initial: Matcher,
    kind: &'static str,
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar")
            .field("kind", &self.kind)
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// The grammar of a regular expression, which the whole generated text must match.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] for a pattern that does not compile, [`GrammarError::TooLarge`]
    /// past [`MAX_GRAMMAR_BYTES`].
    pub fn regex(pattern: &str, vocab: &TokenVocab) -> Result<Self, GrammarError> {
        let kind = "regular expression";
        check_size(kind, pattern.len())?;
        Self::build(TopLevelGrammar::from_regex(pattern), kind, vocab)
    }

    /// The grammar of JSON text valid against `schema` (see the module notes for coverage).
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] for a schema llguidance refuses (malformed, unsatisfiable, a
    /// keyword it does not implement, past its limits), [`GrammarError::TooLarge`].
    pub fn json_schema(schema: &Value, vocab: &TokenVocab) -> Result<Self, GrammarError> {
        let kind = "JSON schema";
        check_size(kind, schema.to_string().len())?;
        let mut schema = schema.clone();
        if let Some(map) = schema.as_object_mut()
            && !map.contains_key("x-guidance")
        {
            // Fixed separators, no free whitespace: replies stay compact and cannot be padded.
            map.insert(
                "x-guidance".into(),
                serde_json::json!({
                    "item_separator": ", ",
                    "key_separator": ": ",
                    "whitespace_flexible": false,
                }),
            );
        }
        Self::build(TopLevelGrammar::from_json_schema(schema), kind, vocab)
    }

    /// The grammar of a Lark file (llguidance's dialect), whose `start` rule the whole
    /// generated text must match.
    ///
    /// # Errors
    /// [`GrammarError::Invalid`] for a grammar that does not compile, [`GrammarError::TooLarge`].
    pub fn lark(grammar: &str, vocab: &TokenVocab) -> Result<Self, GrammarError> {
        let kind = "Lark grammar";
        check_size(kind, grammar.len())?;
        Self::build(TopLevelGrammar::from_lark(grammar.to_owned()), kind, vocab)
    }

    fn build(
        top: TopLevelGrammar,
        kind: &'static str,
        vocab: &TokenVocab,
    ) -> Result<Self, GrammarError> {
        let parser = vocab.inner.factory.create_parser(top);
        let initial = Matcher::new(parser);
        if let Some(message) = initial.get_error() {
            return Err(GrammarError::Invalid { kind, message });
        }
        Ok(Self {
            vocab: vocab.clone(),
            initial,
            kind,
        })
    }

    /// The state before any text.
    pub fn start(&self) -> GrammarState {
        GrammarState {
            matcher: self.initial.deep_clone(),
        }
    }

    /// Whether the text so far is a complete match (an end-of-generation id may follow).
    pub fn is_complete(&self, state: &mut GrammarState) -> bool {
        state.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether nothing may follow but the end of generation.
    pub fn is_exhausted(&self, state: &GrammarState) -> bool {
        state.matcher.is_stopped()
    }

    /// Whether `text` as a whole matches the grammar, spelled with the vocabulary's tokens
    /// (greedily, as llguidance's trie tokenizes).
    pub fn accepts(&self, text: &[u8]) -> bool {
        let mut state = self.start();
        self.advance_text(&mut state, text).is_ok() && self.is_complete(&mut state)
    }

    /// Moves `state` past `text`, spelled with the vocabulary's tokens (greedy longest match, as
    /// llguidance's trie tokenizes), computing the mask before each token as a decode loop does:
    /// for tools and benches that start from a known prefix, so the state (and the lexer caches
    /// it carries) is the one generation would have reached.
    ///
    /// # Errors
    /// As [`Grammar::advance`], for the first token that cannot continue.
    pub fn advance_text(&self, state: &mut GrammarState, text: &[u8]) -> Result<(), GrammarError> {
        for token in self.vocab.inner.factory.tok_env().tokenize_bytes(text) {
            state
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| GrammarError::Engine(e.to_string()))?;
            self.advance(state, token)?;
        }
        Ok(())
    }

    /// Moves `state` past `token` (an end-of-generation id ends the text).
    ///
    /// # Errors
    /// [`GrammarError::TokenOutOfVocab`], or [`GrammarError::TokenNotAllowed`] when the token
    /// cannot continue the text (the logits were not masked).
    pub fn advance(&self, state: &mut GrammarState, token: u32) -> Result<(), GrammarError> {
        let vocab_size = self.vocab.len();
        if token as usize >= vocab_size {
            return Err(GrammarError::TokenOutOfVocab { token, vocab_size });
        }
        let eos = self.vocab.is_eos(token);
        if eos && state.matcher.is_stopped() {
            // The text is complete and the grammar has stopped: ending it is what is left.
            return Ok(());
        }
        let id = if eos {
            self.vocab.inner.trie_eos
        } else {
            token
        };
        // One check and step: llguidance validates the token against the parser (no full mask
        // is computed here; the caller's `mask` already did that) and consumes it only if it
        // can continue, so a refused token leaves the state as it was.
        match state.matcher.try_consume_tokens(&[id]) {
            Ok(1) => Ok(()),
            Ok(_) => Err(GrammarError::TokenNotAllowed { token }),
            Err(e) => Err(GrammarError::Engine(e.to_string())),
        }
    }

    /// Sets every logit the grammar does not allow in `state` to `-inf` and returns how many
    /// remain. `logits` covers ids `0..logits.len()`; ids past the vocabulary are disallowed.
    ///
    /// # Errors
    /// [`GrammarError::NoTokenAllowed`] when nothing in `logits` may follow;
    /// [`GrammarError::Engine`] when llguidance fails.
    pub fn mask(
        &self,
        state: &mut GrammarState,
        logits: &mut [f32],
    ) -> Result<usize, GrammarError> {
        let mask = state
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Engine(e.to_string()))?;
        let eos_allowed = mask.is_allowed(self.vocab.inner.trie_eos);
        let vocab_size = self.vocab.len().min(logits.len());
        let (ids, beyond) = logits.split_at_mut(vocab_size);
        beyond.fill(f32::NEG_INFINITY);
        // The model's logits of the end-of-generation ids, restored below where ending is
        // allowed (the trie knows only one of them; the others are special tokens to it).
        // (Saved only when ending is allowed, so a mask step inside the text allocates nothing.)
        let eos_logits: Vec<(u32, f32)> = if eos_allowed {
            self.vocab
                .inner
                .eos
                .iter()
                .filter_map(|&e| ids.get(e as usize).map(|&v| (e, v)))
                .collect()
        } else {
            Vec::new()
        };
        // A word of the mask at a time: all-clear words (most of them at structural points)
        // cost one fill, all-set words nothing.
        let mut allowed = 0;
        for (chunk, &word) in ids.chunks_mut(32).zip(mask.as_slice()) {
            match word {
                0 => chunk.fill(f32::NEG_INFINITY),
                u32::MAX if chunk.len() == 32 => allowed += 32,
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) != 0 {
                            allowed += 1;
                        } else {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // End-of-generation ids: all of them exactly when the text is complete.
        if eos_allowed {
            for (eos, value) in eos_logits {
                if !mask.is_allowed(eos) {
                    ids[eos as usize] = value;
                    allowed += 1;
                }
            }
        } else {
            for &eos in &self.vocab.inner.eos {
                if mask.is_allowed(eos)
                    && let Some(logit) = ids.get_mut(eos as usize)
                {
                    *logit = f32::NEG_INFINITY;
                    allowed -= 1;
                }
            }
        }
        if allowed == 0 {
            return Err(GrammarError::NoTokenAllowed {
                accepting: eos_allowed,
            });
        }
        Ok(allowed)
    }

    /// The ids allowed in `state`, in order (what [`Grammar::mask`] keeps).
    ///
    /// # Errors
    /// As [`Grammar::mask`].
    pub fn allowed_tokens(&self, state: &mut GrammarState) -> Result<Vec<u32>, GrammarError> {
        let mut logits = vec![0.0; self.vocab.len()];
        self.mask(state, &mut logits)?;
        Ok(logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, _)| i as u32)
            .collect())
    }
}

fn check_size(kind: &'static str, bytes: usize) -> Result<(), GrammarError> {
    if bytes > MAX_GRAMMAR_BYTES {
        return Err(GrammarError::TooLarge { kind, bytes });
    }
    Ok(())
}

/// The grammar a user asked for on the command line or in a chain file: a regular expression, a
/// JSON schema file or a Lark grammar file (at most one; `None` for none), over `tokenizer`'s
/// token bytes.
///
/// # Errors
/// More than one given, an unreadable or invalid file, or a [`GrammarError`].
pub fn from_request(
    regex: Option<&str>,
    json_schema: Option<&std::path::Path>,
    lark: Option<&std::path::Path>,
    tokenizer: &Tokenizer,
) -> Result<Option<Grammar>, Box<dyn std::error::Error + Send + Sync>> {
    let given = [regex.is_some(), json_schema.is_some(), lark.is_some()];
    match given.iter().filter(|&&g| g).count() {
        0 => return Ok(None),
        1 => {}
        _ => return Err("pass one of --regex, --json-schema and --grammar".into()),
    }
    let read =
        |path: &std::path::Path| -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
            let size = std::fs::metadata(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?
                .len();
            if size > MAX_GRAMMAR_BYTES as u64 {
                return Err(format!(
                    "{}: {size} bytes, over the {MAX_GRAMMAR_BYTES}-byte grammar limit",
                    path.display()
                )
                .into());
            }
            Ok(std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?)
        };
    let vocab = TokenVocab::from_tokenizer(tokenizer)?;
    let grammar = if let Some(pattern) = regex {
        Grammar::regex(pattern, &vocab)?
    } else if let Some(path) = json_schema {
        let schema: Value =
            serde_json::from_str(&read(path)?).map_err(|e| format!("{}: {e}", path.display()))?;
        Grammar::json_schema(&schema, &vocab)?
    } else if let Some(path) = lark {
        Grammar::lark(&read(path)?, &vocab).map_err(|e| format!("{}: {e}", path.display()))?
    } else {
        unreachable!("one of the three is given (counted above)")
    };
    Ok(Some(grammar))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 256 bytes, a few multi-byte tokens, a special and an end-of-generation id.
    fn vocab() -> TokenVocab {
        let mut tokens: Vec<Option<Vec<u8>>> = (0u8..=255).map(|b| Some(vec![b])).collect();
        for t in ["yes", "no", ", ", "{\"", "\": ", "\"}", "true", "12"] {
            tokens.push(Some(t.as_bytes().to_vec()));
        }
        tokens.push(None); // a special token
        tokens.push(None); // end of generation
        let eos = tokens.len() as u32 - 1;
        TokenVocab::new(tokens, &[eos])
    }

    fn token(v: &TokenVocab, text: &str) -> u32 {
        (0..v.len() as u32)
            .find(|&id| v.token_bytes(id) == Some(text.as_bytes()))
            .expect(text)
    }

    /// The ids allowed in `state`.
    fn allowed(g: &Grammar, state: &mut GrammarState) -> Vec<u32> {
        g.allowed_tokens(state).unwrap()
    }

    #[test]
    fn a_regex_allows_only_its_continuations_and_the_end_when_complete() {
        let v = vocab();
        let eos = *v.eos_ids().first().unwrap();
        let g = Grammar::regex("(yes|no), [0-9]{2}", &v).unwrap();
        let mut s = g.start();
        let first = allowed(&g, &mut s);
        assert!(first.contains(&token(&v, "yes")) && first.contains(&token(&v, "no")));
        assert!(first.contains(&(b'y' as u32)) && !first.contains(&(b'x' as u32)));
        assert!(!first.contains(&eos), "incomplete text cannot end");
        for t in ["no", ", ", "12"] {
            g.advance(&mut s, token(&v, t)).unwrap();
        }
        assert!(g.is_complete(&mut s));
        assert_eq!(allowed(&g, &mut s), [eos]);
        // The model's logit of an allowed end-of-generation id is kept, not replaced.
        let mut logits = vec![3.5; v.len()];
        assert_eq!(g.mask(&mut s, &mut logits).unwrap(), 1);
        assert_eq!(logits[eos as usize], 3.5);
        assert!(matches!(
            g.advance(&mut s, b'3' as u32),
            Err(GrammarError::TokenNotAllowed { .. })
        ));
        assert!(g.accepts(b"yes, 42") && !g.accepts(b"yes, 4") && !g.accepts(b"maybe"));
    }

    #[test]
    fn masks_set_disallowed_logits_to_minus_infinity() {
        let v = vocab();
        let g = Grammar::regex("yes|no", &v).unwrap();
        let mut s = g.start();
        let mut logits = vec![1.0; v.len() + 3];
        let n = g.mask(&mut s, &mut logits).unwrap();
        assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), n);
        assert!(logits[v.len()..].iter().all(|l| *l == f32::NEG_INFINITY));
        assert!(logits[token(&v, "yes") as usize].is_finite());
        // The special token is never allowed.
        assert_eq!(logits[v.len() - 2], f32::NEG_INFINITY);
    }

    /// JSON schema keywords the old regex converter refused: `$ref`, `oneOf`, `pattern`,
    /// numeric bounds, `additionalProperties` as a schema.
    #[test]
    fn json_schemas_with_refs_alternatives_patterns_and_bounds() {
        let v = vocab();
        let schema = serde_json::json!({
            "$defs": {"code": {"type": "string", "pattern": "^[a-c]{2}$"}},
            "type": "object",
            "properties": {
                "code": {"$ref": "#/$defs/code"},
                "n": {"type": "integer", "minimum": 10, "maximum": 12},
                "v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
                "extra": {"type": "object", "additionalProperties": {"type": "integer"}}
            },
            "required": ["code", "n", "v"],
            "additionalProperties": false
        });
        let g = Grammar::json_schema(&schema, &v).unwrap();
        assert!(g.accepts(br#"{"code": "ab", "n": 11, "v": true}"#));
        assert!(g.accepts(br#"{"code": "ca", "n": 12, "v": null, "extra": {"k": 3}}"#));
        assert!(
            !g.accepts(br#"{"code": "zz", "n": 11, "v": true}"#),
            "pattern"
        );
        assert!(
            !g.accepts(br#"{"code": "ab", "n": 13, "v": true}"#),
            "maximum"
        );
        assert!(!g.accepts(br#"{"code": "ab", "n": 11, "v": 1}"#), "oneOf");
        assert!(!g.accepts(br#"{"code": "ab", "n": 11}"#), "required");
        assert!(
            !g.accepts(br#"{"code":"ab","n":11,"v":true}"#),
            "fixed separators"
        );
    }

    #[test]
    fn lark_grammars() {
        let v = vocab();
        let g = Grammar::lark(
            "start: answer \", \" count\nanswer: \"yes\" | \"no\"\ncount: /[0-9]+/\n",
            &v,
        )
        .unwrap();
        assert!(g.accepts(b"yes, 12") && g.accepts(b"no, 7"));
        assert!(!g.accepts(b"yes 12") && !g.accepts(b"maybe, 1"));
        let e = Grammar::lark("start: undefined_rule\n", &v).unwrap_err();
        assert!(
            matches!(
                e,
                GrammarError::Invalid {
                    kind: "Lark grammar",
                    ..
                }
            ),
            "{e}"
        );
    }

    /// Hostile grammars end in errors (or compile, bounded), never in a hang or a crash: 24
    /// nested arrays (which once made a regex of gigabytes), a schema that is not a schema, a
    /// pattern of exploding repetitions, text over the size limit.
    #[test]
    fn hostile_grammars_are_bounded() {
        let v = vocab();
        let start = std::time::Instant::now();
        let mut nested = serde_json::json!({"type": "integer"});
        for _ in 0..24 {
            nested = serde_json::json!({"type": "array", "items": nested});
        }
        let g = Grammar::json_schema(&nested, &v).unwrap();
        assert!(g.accepts(format!("{}12{}", "[".repeat(24), "]".repeat(24)).as_bytes()));
        assert!(Grammar::json_schema(&serde_json::json!({"type": 7}), &v).is_err());
        let _ = Grammar::regex("((a{1,100}){1,100}){1,100}", &v);
        let huge = "a".repeat(MAX_GRAMMAR_BYTES + 1);
        assert!(matches!(
            Grammar::regex(&huge, &v),
            Err(GrammarError::TooLarge { .. })
        ));
        assert!(start.elapsed() < std::time::Duration::from_secs(20));
    }

    #[test]
    fn states_are_independent() {
        let v = vocab();
        let g = Grammar::regex("yes|no", &v).unwrap();
        let mut a = g.start();
        let b = a.clone();
        g.advance(&mut a, token(&v, "yes")).unwrap();
        let mut b = b;
        assert!(g.is_complete(&mut a) && !g.is_complete(&mut b));
    }
}

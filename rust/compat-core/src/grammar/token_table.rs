//! The model's vocabulary as llguidance sees it, and grammar compilation against it.
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::{Constraint, GrammarSpec};
use crate::error::CoreError;

/// JSON output is compact with single spaces after separators, like `json.dumps`:
/// free whitespace lets small models loop on newlines until `max_tokens`.
const JSON_LAYOUT: &str =
    r#"{"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}"#;

/// Token id → bytes for one model, plus the compiled-grammar factory over it.
pub struct TokenTable {
    factory: Arc<ParserFactory>,
    mask_words: usize,
}

impl std::fmt::Debug for TokenTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenTable")
            .field("vocab_size", &self.vocab_size())
            .field("mask_words", &self.mask_words)
            .finish_non_exhaustive()
    }
}

impl TokenTable {
    /// From the bytes of every token (`tokens[id]`); special tokens are given as
    /// `0xFF` followed by their name (llguidance's marker), so grammars can name them as
    /// `<|im_end|>`. `eos_ids` are the ids that end generation (the grammar allows them
    /// once it is complete). `logits_width` is the model's output width, which may
    /// exceed the vocabulary (ids past it are never allowed).
    pub fn from_token_bytes(
        tokens: &[Vec<u8>],
        eos_ids: &[u32],
        logits_width: usize,
    ) -> Result<Self, CoreError> {
        let Some(&first_eos) = eos_ids.first() else {
            return Err(CoreError::Grammar(
                "a token table needs an end-of-sequence id".into(),
            ));
        };
        if let Some(bad) = eos_ids.iter().find(|&&id| id as usize >= tokens.len()) {
            return Err(CoreError::Grammar(format!(
                "end-of-sequence id {bad} is outside the vocabulary of {} tokens",
                tokens.len()
            )));
        }
        let info = TokRxInfo::new(tokens.len() as u32, first_eos);
        let trie = TokTrie::from(&info, tokens).with_eos_tokens(eos_ids);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_error)?;
        factory.quiet();
        let width = logits_width.max(tokens.len());
        Ok(Self {
            factory: Arc::new(factory),
            mask_words: width.div_ceil(32),
        })
    }

    /// From a Hugging Face `tokenizer.json` (what `tokenizers.Tokenizer.to_str()` gives,
    /// for GGUF vocabularies too): byte-level and byte-fallback vocabularies decode to
    /// their exact bytes, special added tokens become addressable by name.
    pub fn from_tokenizer_json(
        tokenizer_json: &str,
        eos_ids: &[u32],
        logits_width: usize,
    ) -> Result<Self, CoreError> {
        let value: Value = serde_json::from_str(tokenizer_json)
            .map_err(|e| CoreError::Grammar(format!("tokenizer.json: {e}")))?;
        let tokens = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| CoreError::Grammar(format!("tokenizer.json: {e}")))?;
        Self::from_token_bytes(&tokens, eos_ids, logits_width)
    }

    /// Number of token ids the vocabulary defines.
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// `u32` words in one mask row (covers the wider of vocabulary and logits).
    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    /// The bytes token `id` stands for (special tokens: `0xFF` + name).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if id as usize >= trie.vocab_size() {
            return Vec::new();
        }
        trie.token(id).to_vec()
    }

    /// The id of the special token named `name` (e.g. `<|im_end|>`).
    pub fn special_token(&self, name: &str) -> Option<u32> {
        self.factory.tok_env().tok_trie().get_special_token(name)
    }

    /// Compiles `spec` into a fresh constraint; a bad schema or grammar is an error
    /// naming what is wrong.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, CoreError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(text) => {
                let mut schema: Value = serde_json::from_str(text)
                    .map_err(|e| CoreError::Grammar(format!("schema is not valid JSON: {e}")))?;
                with_json_layout(&mut schema)?;
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            GrammarSpec::Regex(text) => TopLevelGrammar::from_regex(text),
        };
        let parser = self.factory.create_parser(grammar).map_err(grammar_error)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(err) = matcher.get_error() {
            return Err(CoreError::Grammar(err));
        }
        Ok(Constraint::new(matcher, self.mask_words))
    }
}

/// Adds the compact layout to a schema that does not choose its own.
fn with_json_layout(schema: &mut Value) -> Result<(), CoreError> {
    match schema {
        Value::Object(map) => {
            if !map.contains_key("x-guidance") {
                let layout: Value = serde_json::from_str(JSON_LAYOUT).expect("constant layout");
                map.insert("x-guidance".into(), layout);
            }
            Ok(())
        }
        Value::Bool(_) => Ok(()),
        _ => Err(CoreError::Grammar(
            "schema must be a JSON object (or a boolean)".into(),
        )),
    }
}

fn grammar_error(err: impl std::fmt::Display) -> CoreError {
    CoreError::Grammar(err.to_string())
}

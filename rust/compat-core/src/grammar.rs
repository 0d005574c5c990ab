//! Constrained decoding: grammars (JSON schema, Lark, regex) compiled by llguidance
//! against the model's own vocabulary, one [`Constraint`] per request.
//!
//! A [`TokenTable`] is built once per model from its tokenizer; it compiles a
//! [`GrammarSpec`] into a [`Constraint`], which yields the allowed-token bitmask before
//! each sampled token and consumes the token after. Masks are plain `u32` words (bit `i`
//! of word `i / 32` = token `i` allowed), so the caller applies them with ordinary array
//! ops on any backend.
mod constraint;
mod token_table;

pub use constraint::{fill_masks, Constraint};
pub use token_table::TokenTable;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarSpec {
    /// A JSON schema (JSON text). Whitespace is not free: separators are `", "` and
    /// `": "` unless the schema's `x-guidance` object says otherwise.
    JsonSchema(String),
    /// An llguidance Lark grammar; `%json {...}` rules embed schemas, `<|name|>` names a
    /// special token.
    Lark(String),
    /// A regular expression the whole output must match.
    Regex(String),
}

impl GrammarSpec {
    /// `kind` is `"json_schema"`, `"lark"` or `"regex"`.
    pub fn new(kind: &str, source: String) -> Result<Self, crate::error::CoreError> {
        match kind {
            "json_schema" => Ok(Self::JsonSchema(source)),
            "lark" => Ok(Self::Lark(source)),
            "regex" => Ok(Self::Regex(source)),
            other => Err(crate::error::CoreError::Grammar(format!(
                "unknown grammar kind {other:?} (expected json_schema, lark or regex)"
            ))),
        }
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

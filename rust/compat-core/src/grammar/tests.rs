//! Grammar tests on a small hand-made vocabulary: single bytes, a few merges and two
//! special tokens, so every allowed-token decision can be checked by hand.
use serde_json::Value;

use super::{fill_masks, Constraint, GrammarSpec, TokenTable};
use crate::error::CoreError;

pub(super) const EOS: u32 = 256;
pub(super) const CALL: u32 = 257;

/// Ids 0..=254: the single bytes; 255: an unused placeholder; 256 `<|eos|>`,
/// 257 `<tool_call>` (specials); then a few multi-byte merges.
pub(super) fn toy_tokens() -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = (0u8..=254).map(|b| vec![b]).collect();
    tokens.push(b"<unused>".to_vec());
    tokens.push(b"\xFF<|eos|>".to_vec());
    tokens.push(b"\xFF<tool_call>".to_vec());
    for merge in [
        "{\"", "\": ", "\", \"", "true", "false", "name", "  ", "\n\n", "12",
    ] {
        tokens.push(merge.as_bytes().to_vec());
    }
    tokens
}

pub(super) fn toy_table() -> TokenTable {
    TokenTable::from_token_bytes(&toy_tokens(), &[EOS], 300).expect("toy table")
}

pub(super) fn allowed(constraint: &mut Constraint) -> Vec<u32> {
    let mut mask = vec![0u32; constraint.mask_words()];
    constraint.fill_mask(&mut mask).expect("mask");
    (0..mask.len() as u32 * 32)
        .filter(|&i| mask[i as usize / 32] >> (i % 32) & 1 == 1)
        .collect()
}

/// Forces `text` token by token (single-byte tokens), checking each is allowed.
fn force(table: &TokenTable, constraint: &mut Constraint, text: &str) {
    for b in text.bytes() {
        let token = u32::from(b);
        assert!(
            allowed(constraint).contains(&token),
            "{:?} not allowed",
            b as char
        );
        constraint.consume(token).expect("consume");
        assert_eq!(table.token_bytes(token), vec![b]);
    }
}

fn compile(table: &TokenTable, kind: &str, source: &str) -> Result<Constraint, CoreError> {
    table.compile(&GrammarSpec::new(kind, source.to_string())?)
}

#[test]
fn mask_covers_the_logits_width_and_never_allows_ids_past_the_vocabulary() {
    let table = toy_table();
    assert_eq!(table.mask_words(), 300usize.div_ceil(32));
    let mut c = compile(&table, "regex", "[a-z]+").unwrap();
    let ids = allowed(&mut c);
    assert_eq!(ids.first(), Some(&u32::from(b'a')));
    assert!(ids.iter().all(|&i| (i as usize) < toy_tokens().len()));
    assert!(!ids.contains(&EOS), "an empty output does not match [a-z]+");
}

#[test]
fn json_schema_output_is_compact_and_stops_after_the_closing_brace() {
    let table = toy_table();
    let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"}},
                     "required": ["ok"], "additionalProperties": false}"#;
    let mut c = compile(&table, "json_schema", schema).unwrap();
    force(&table, &mut c, r#"{"ok": true}"#);
    assert!(c.is_accepting());
    assert!(c.is_stopped(), "nothing may follow the object");
    assert_eq!(allowed(&mut c), vec![EOS]);
}

#[test]
fn json_whitespace_is_bounded() {
    let table = toy_table();
    let mut c = compile(&table, "json_schema", r#"{"type": "object"}"#).unwrap();
    force(&table, &mut c, "{");
    let ids = allowed(&mut c);
    for ws in [b' ', b'\n', b'\t'] {
        assert!(
            !ids.contains(&u32::from(ws)),
            "whitespace {ws} allowed after {{"
        );
    }
}

#[test]
fn a_schema_may_choose_its_own_layout() {
    let table = toy_table();
    let schema = r#"{"type": "array", "items": {"type": "integer"},
                     "x-guidance": {"item_separator": ",", "whitespace_flexible": false}}"#;
    let mut c = compile(&table, "json_schema", schema).unwrap();
    force(&table, &mut c, "[1,2]");
    assert!(c.is_stopped());
}

#[test]
fn lark_names_special_tokens_and_embeds_json() {
    let table = toy_table();
    assert_eq!(table.special_token("<tool_call>"), Some(CALL));
    let lark = r#"start: <tool_call> call
call: %json {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}"#;
    let mut c = compile(&table, "lark", lark).unwrap();
    assert_eq!(allowed(&mut c), vec![CALL]);
    c.consume(CALL).unwrap();
    force(&table, &mut c, r#"{"n":2}"#);
    assert!(c.is_stopped());
}

#[test]
fn a_disallowed_token_is_an_error_and_rollback_undoes_tokens() {
    let table = toy_table();
    let mut c = compile(&table, "regex", "ab|ac").unwrap();
    force(&table, &mut c, "a");
    let err = c.consume(u32::from(b'z')).unwrap_err();
    assert!(matches!(err, CoreError::Grammar(_)), "{err}");

    let mut c = compile(&table, "regex", "ab|ac").unwrap();
    force(&table, &mut c, "ab");
    c.rollback(1).unwrap();
    assert_eq!(c.consumed(), 1);
    force(&table, &mut c, "c");
    assert!(c.rollback(5).is_err());
    let mut c = compile(&table, "regex", "abc").unwrap();
    let abz: Vec<u32> = b"abz".iter().map(|&b| u32::from(b)).collect();
    assert_eq!(c.validate(&abz).unwrap(), 2, "accepts a, b; stops at z");
    assert_eq!(c.consumed(), 0, "validate does not advance");
}

#[test]
fn bad_grammars_are_errors_that_say_why() {
    let table = toy_table();
    for (kind, source, says) in [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        (
            "json_schema",
            r#"{"type": "integer", "minimum": 5, "maximum": 1}"#,
            "",
        ),
        ("json_schema", r#"{"type": "nosuchtype"}"#, ""),
        ("lark", "start: undefined_rule", ""),
        ("regex", "(unclosed", ""),
        ("yaml", "a: 1", "unknown grammar kind"),
    ] {
        let err = compile(&table, kind, source).expect_err(source);
        assert!(
            matches!(err, CoreError::Grammar(_)),
            "{kind} {source}: {err:?}"
        );
        assert!(err.to_string().contains(says), "{err}");
        assert!(!err.to_string().is_empty());
    }
}

#[test]
fn table_from_tokenizer_json_reads_byte_level_tokens_and_specials() {
    // A byte-level BPE vocabulary: "Ġ" stands for the space byte.
    let json = r#"{
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġa": 2, "ab": 3}, "merges": []},
      "decoder": {"type": "ByteLevel"},
      "pre_tokenizer": {"type": "ByteLevel"},
      "added_tokens": [{"id": 4, "content": "<|im_end|>", "special": true,
                        "single_word": false, "lstrip": false, "rstrip": false,
                        "normalized": false}]
    }"#;
    let table = TokenTable::from_tokenizer_json(json, &[4], 8).unwrap();
    assert_eq!(table.vocab_size(), 5);
    assert_eq!(table.token_bytes(2), b" a".to_vec());
    assert_eq!(table.special_token("<|im_end|>"), Some(4));
    let mut c = compile(&table, "regex", "ab").unwrap();
    assert_eq!(allowed(&mut c), vec![0, 3]);
    assert!(TokenTable::from_tokenizer_json("{}", &[0], 1).is_err());
    assert!(TokenTable::from_tokenizer_json(json, &[], 8).is_err());
    assert!(TokenTable::from_tokenizer_json(json, &[99], 8).is_err());
}

#[test]
fn fill_masks_allows_everything_on_unconstrained_rows() {
    let table = toy_table();
    let words = table.mask_words();
    let mut a = compile(&table, "regex", "x").unwrap();
    let mut out = vec![0u32; 2 * words];
    let errors = fill_masks(&mut [None, Some(&mut a)], &mut out, words);
    assert!(errors.iter().all(Option::is_none));
    assert!(out[..words].iter().all(|&w| w == u32::MAX));
    let second: Vec<u32> = (0..words as u32 * 32)
        .filter(|&i| out[words + i as usize / 32] >> (i % 32) & 1 == 1)
        .collect();
    assert_eq!(second, vec![u32::from(b'x')]);
    let value: Value = serde_json::json!(words);
    assert_eq!(value, serde_json::json!(10));
}

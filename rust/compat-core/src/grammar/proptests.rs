//! Property: under a random schema, every token sampled from the mask is accepted, the
//! walk ends with the grammar stopped, and the output validates against the schema.
use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::tests::{allowed, toy_table, EOS};
use super::GrammarSpec;

/// Schemas whose languages are finite (bounded strings, integers, arrays), so a random
/// walk always ends.
fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        (-50i64..50, 0i64..40).prop_map(|(lo, span)| json!({
            "type": "integer", "minimum": lo, "maximum": lo + span})),
        Just(json!({"type": "boolean"})),
        proptest::collection::vec("[a-z]{1,6}", 1..4).prop_map(|v| json!({"enum": v})),
        (0usize..6).prop_map(|n| json!({"type": "string", "maxLength": n, "pattern": "^[a-z ]*$"})),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            (inner.clone(), 0usize..3).prop_map(|(items, n)| json!({
                "type": "array", "items": items, "maxItems": n})),
            proptest::collection::btree_map("[a-z]{1,5}", inner, 1..4).prop_map(|props| {
                let required: Vec<&String> = props.keys().collect();
                json!({"type": "object", "properties": props, "required": required,
                       "additionalProperties": false})
            }),
        ]
    })
}

/// The subset of JSON-schema validation the generated schemas use.
fn validates(schema: &Value, value: &Value) -> bool {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        return options.contains(value);
    }
    match schema["type"].as_str() {
        // JSON Schema's integer is any number with no fractional part: `-0` is one
        // (serde_json reads it as the float -0.0; Python's json reads it as 0).
        Some("integer") => value.as_f64().is_some_and(|n| {
            n.fract() == 0.0
                && schema["minimum"].as_f64().is_none_or(|lo| n >= lo)
                && schema["maximum"].as_f64().is_none_or(|hi| n <= hi)
        }),
        Some("boolean") => value.is_boolean(),
        Some("string") => value.as_str().is_some_and(|s| {
            let max = schema["maxLength"].as_u64().unwrap_or(u64::MAX);
            s.chars().count() as u64 <= max && s.chars().all(|c| c.is_ascii_lowercase() || c == ' ')
        }),
        Some("array") => value.as_array().is_some_and(|items| {
            let max = schema["maxItems"].as_u64().unwrap_or(u64::MAX);
            items.len() as u64 <= max && items.iter().all(|v| validates(&schema["items"], v))
        }),
        Some("object") => value.as_object().is_some_and(|obj: &Map<String, Value>| {
            let props = schema["properties"].as_object().expect("properties");
            obj.len() == props.len()
                && props
                    .iter()
                    .all(|(k, s)| obj.get(k).is_some_and(|v| validates(s, v)))
        }),
        other => panic!("unexpected schema type {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn sampled_tokens_are_accepted_and_the_output_validates(
        schema in schema(),
        picks in proptest::collection::vec(any::<u32>(), 400),
    ) {
        let table = toy_table();
        let spec = GrammarSpec::JsonSchema(schema.to_string());
        let mut constraint = table.compile(&spec).expect("compiles");
        let mut out = Vec::new();
        for pick in &picks {
            if constraint.is_stopped() {
                break;
            }
            let ids = allowed(&mut constraint);
            prop_assert!(!ids.is_empty());
            // Prefer ending when allowed half the time, so walks stay short.
            let token = if ids.contains(&EOS) && pick % 2 == 0 { EOS } else {
                ids[*pick as usize % ids.len()]
            };
            if token == EOS {
                break;
            }
            constraint.consume(token).expect("a token from the mask is accepted");
            out.extend(table.token_bytes(token));
        }
        prop_assert!(constraint.is_accepting(), "walk did not finish: {}", String::from_utf8_lossy(&out));
        let text = String::from_utf8(out).expect("utf-8");
        let value: Value = serde_json::from_str(&text).expect("valid JSON");
        prop_assert!(validates(&schema, &value), "{text} vs {schema}");
    }
}

//! `json.dumps` as transformers' `tojson` filter calls it:
//! `json.dumps(x, ensure_ascii=..., indent=..., separators=..., sort_keys=...)`.
//! Unlike minijinja's builtin `tojson` there is no HTML escaping, the default
//! separators are Python's (`", "` / `": "`, or `","` when indenting), and keys keep
//! their insertion order unless `sort_keys` is set.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

use super::pyfmt::float_repr;

/// Options of one `json.dumps` call.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: single line. `Some(s)`: newline + `s` per nesting level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl DumpOptions {
    /// Python's defaults for a given `indent` and `separators`.
    pub fn new(indent: Option<String>, separators: Option<(String, String)>) -> Self {
        let (item_separator, key_separator) = separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_owned(), ": ".to_owned())
        });
        Self {
            ensure_ascii: false,
            indent,
            item_separator,
            key_separator,
            sort_keys: false,
        }
    }
}

/// Serializes `value` like Python's `json.dumps`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(value, opts, 0, &mut out)?;
    Ok(out)
}

fn not_serializable(value: &Value) -> Error {
    let type_name = match value.kind() {
        ValueKind::Undefined => "Undefined".to_owned(),
        kind => kind.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {type_name} is not JSON serializable"),
    )
}

fn newline(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_value(
    value: &Value,
    opts: &DumpOptions,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(value, out),
        ValueKind::String => {
            write_string(value.as_str().unwrap_or_default(), opts.ensure_ascii, out);
        }
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (idx, item) in items.iter().enumerate() {
                if idx > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(opts, level + 1, out);
                write_value(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                pairs.push((json_key(&key)?, item));
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (idx, (key, item)) in pairs.iter().enumerate() {
                if idx > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(opts, level + 1, out);
                write_string(key, opts.ensure_ascii, out);
                out.push_str(&opts.key_separator);
                write_value(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push('}');
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

fn write_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f < 0.0 { "-Infinity" } else { "Infinity" });
    } else {
        float_repr(f, out);
    }
}

/// Python coerces non-string keys: `True` -> `"true"`, `None` -> `"null"`,
/// numbers -> their repr.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Bool | ValueKind::None | ValueKind::Number => {
            let mut out = String::new();
            if key.is_none() {
                out.push_str("null");
            } else if key.kind() == ValueKind::Bool {
                out.push_str(if key.is_true() { "true" } else { "false" });
            } else {
                write_number(key, &mut out);
            }
            Ok(out)
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "keys must be str, int, float, bool or None, not {}",
                key.kind()
            ),
        )),
    }
}

/// Python's `encode_basestring` (or `_ascii` with `ensure_ascii`).
pub fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_json(s: &str) -> Value {
        crate::template::json_to_value(&serde_json::from_str::<serde_json::Value>(s).unwrap())
    }

    fn dump(s: &str, opts: &DumpOptions) -> String {
        dumps(&from_json(s), opts).unwrap()
    }

    #[test]
    fn default_separators_and_order() {
        let opts = DumpOptions::new(None, None);
        assert_eq!(
            dump(r#"{"z": 1, "a": [true, null, 1.5, "x"], "m": {}}"#, &opts),
            r#"{"z": 1, "a": [true, null, 1.5, "x"], "m": {}}"#
        );
    }

    #[test]
    fn indent_uses_comma_without_space() {
        let opts = DumpOptions::new(Some("  ".into()), None);
        assert_eq!(
            dump(r#"{"a": [1, {"b": []}], "c": "d"}"#, &opts),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ],\n  \"c\": \"d\"\n}"
        );
        let zero = DumpOptions::new(Some(String::new()), None);
        assert_eq!(dump("[1,2]", &zero), "[\n1,\n2\n]");
    }

    #[test]
    fn explicit_separators_and_sort_keys() {
        let mut opts = DumpOptions::new(None, Some((",".into(), ":".into())));
        opts.sort_keys = true;
        assert_eq!(
            dump(r#"{"b": 1, "a": [1, 2]}"#, &opts),
            r#"{"a":[1,2],"b":1}"#
        );
    }

    #[test]
    fn strings_are_not_html_escaped() {
        let opts = DumpOptions::new(None, None);
        assert_eq!(
            dump(r#""<a href='x'>&é😀\u0001\"\\\n""#, &opts),
            "\"<a href='x'>&é😀\\u0001\\\"\\\\\\n\""
        );
        let mut ascii = opts.clone();
        ascii.ensure_ascii = true;
        assert_eq!(dump(r#""é😀""#, &ascii), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn floats_and_keys_like_python() {
        let opts = DumpOptions::new(None, None);
        assert_eq!(
            dump("[1e-05, 1e20, 2.0, -0.5]", &opts),
            "[1e-05, 1e+20, 2.0, -0.5]"
        );
        let map = Value::from_pairs([
            (Value::from(true), Value::from(1)),
            (Value::from(2), Value::from(())),
        ]);
        assert_eq!(dumps(&map, &opts).unwrap(), r#"{"true": 1, "2": null}"#);
    }

    #[test]
    fn undefined_is_an_error() {
        let err = dumps(&Value::UNDEFINED, &DumpOptions::new(None, None)).unwrap_err();
        assert!(err.to_string().contains("not JSON serializable"));
    }
}

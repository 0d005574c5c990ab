//! Python's `str()` / `repr()` for template values, so `{{ x }}` and `x|string`
//! print what jinja2 prints (`True`, `None`, `{'a': 1}`, `1e-05`).

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};

/// Python's `str(x)`: strings verbatim, everything else as `repr`.
pub fn py_str(value: &Value, out: &mut String) {
    match value.kind() {
        // jinja2's `Undefined.__str__` is the empty string.
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => py_repr(value, out),
    }
}

/// Convenience wrapper around [`py_str`].
pub fn to_py_str(value: &Value) -> String {
    let mut out = String::new();
    py_str(value, &mut out);
    out
}

/// Python's `repr(x)` for the value types a chat template can hold.
pub fn py_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN), out);
            }
        }
        ValueKind::String => string_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (idx, key) in keys.enumerate() {
                    if idx > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&key, out);
                    out.push_str(": ");
                    py_repr(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for item in items {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    py_repr(&item, out);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        // Bytes, functions, macros and other objects: minijinja's own rendering.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text holds `'` but no `"`,
/// non-printable characters escaped as `\xNN`, `\uNNNN` or `\UNNNNNNNN`.
pub fn string_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_printable(c) => {
                let cp = u32::from(c);
                let _ = if cp < 0x100 {
                    write!(out, "\\x{cp:02x}")
                } else if cp < 0x1_0000 {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable()` for one character: false for the general
/// categories Cc, Cf, Co, Zl, Zp and Zs (except the ASCII space). Unassigned
/// code points (Cn) are treated as printable except the noncharacters: the
/// full Unicode table is not worth a dependency for text that never holds them.
pub fn is_printable(c: char) -> bool {
    let cp = u32::from(c);
    if cp < 0x7f {
        return cp >= 0x20;
    }
    if cp <= 0xa0 {
        return false; // DEL, C1 controls, NO-BREAK SPACE
    }
    if (cp & 0xfffe) == 0xfffe || (0xfdd0..=0xfdef).contains(&cp) {
        return false; // noncharacters (Cn)
    }
    !NON_PRINTABLE
        .iter()
        .any(|&(lo, hi)| (lo..=hi).contains(&cp))
}

/// Cf, Co, Zl, Zp and Zs ranges above U+00A0 (Unicode 14, Python 3.11).
const NON_PRINTABLE: &[(u32, u32)] = &[
    (0x00ad, 0x00ad),
    (0x0600, 0x0605),
    (0x061c, 0x061c),
    (0x06dd, 0x06dd),
    (0x070f, 0x070f),
    (0x0890, 0x0891),
    (0x08e2, 0x08e2),
    (0x1680, 0x1680),
    (0x180e, 0x180e),
    (0x2000, 0x200f),
    (0x2028, 0x202f),
    (0x205f, 0x2064),
    (0x2066, 0x206f),
    (0x3000, 0x3000),
    (0xe000, 0xf8ff),
    (0xfeff, 0xfeff),
    (0xfff9, 0xfffb),
    (0x110bd, 0x110bd),
    (0x110cd, 0x110cd),
    (0x13430, 0x13438),
    (0x1bca0, 0x1bca3),
    (0x1d173, 0x1d17a),
    (0xe0001, 0xe0001),
    (0xe0020, 0xe007f),
    (0xf0000, 0xffffd),
    (0x10_0000, 0x10_fffd),
];

/// Python's `repr(float)`: the shortest round-tripping digits, positional
/// when the decimal exponent is in `-4..16`, else `d.ddde+XX`.
pub fn float_repr(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("nan");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f < 0.0 { "-inf" } else { "inf" });
        return;
    }
    // Rust's `{:e}` yields the same shortest digits as Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

/// Python's `str.isspace()` for one character. Rust's `char::is_whitespace`
/// lacks the information separators U+001C..U+001F.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(v: &Value) -> String {
        let mut s = String::new();
        py_repr(v, &mut s);
        s
    }

    fn float(f: f64) -> String {
        let mut s = String::new();
        float_repr(f, &mut s);
        s
    }

    #[test]
    fn floats_like_python() {
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(-0.0), "-0.0");
        assert_eq!(float(0.1), "0.1");
        assert_eq!(float(1.5), "1.5");
        assert_eq!(float(123_456.789), "123456.789");
        assert_eq!(float(1e15), "1000000000000000.0");
        assert_eq!(float(1e16), "1e+16");
        assert_eq!(float(1.5e20), "1.5e+20");
        assert_eq!(float(0.0001), "0.0001");
        assert_eq!(float(0.00001), "1e-05");
        assert_eq!(float(-2.5e-7), "-2.5e-07");
        assert_eq!(float(1e100), "1e+100");
        assert_eq!(float(f64::INFINITY), "inf");
        assert_eq!(float(f64::NAN), "nan");
        assert_eq!(float(0.1 + 0.2), "0.30000000000000004");
    }

    #[test]
    fn scalars_like_python() {
        assert_eq!(repr(&Value::from(true)), "True");
        assert_eq!(repr(&Value::from(())), "None");
        assert_eq!(repr(&Value::from(42)), "42");
        assert_eq!(repr(&Value::from(2.0)), "2.0");
        assert_eq!(to_py_str(&Value::UNDEFINED), "");
        assert_eq!(to_py_str(&Value::from("it's")), "it's");
    }

    #[test]
    fn strings_like_python() {
        assert_eq!(repr(&Value::from("a")), "'a'");
        assert_eq!(repr(&Value::from("it's")), "\"it's\"");
        assert_eq!(repr(&Value::from("'\"")), "'\\'\"'");
        assert_eq!(repr(&Value::from("a\nb\\")), "'a\\nb\\\\'");
        assert_eq!(repr(&Value::from("\u{7}\u{a0}é")), "'\\x07\\xa0é'");
        assert_eq!(repr(&Value::from("👨\u{200d}👩")), "'👨\\u200d👩'");
        assert_eq!(repr(&Value::from("\u{e0001}")), "'\\U000e0001'");
    }

    #[test]
    fn containers_like_python() {
        let v: Value = serde_json::from_str::<serde_json::Value>(
            r#"{"b": [1, 2.5, null, true], "a": {"x": "y"}, "c": []}"#,
        )
        .map(|j| crate::template::json_to_value(&j))
        .unwrap();
        assert_eq!(
            repr(&v),
            "{'b': [1, 2.5, None, True], 'a': {'x': 'y'}, 'c': []}"
        );
        let one = Value::from(minijinja::value::Tuple::from([Value::from("k")]));
        assert_eq!(repr(&one), "('k',)");
    }

    #[test]
    fn python_whitespace() {
        assert!(is_py_space('\u{1f}'));
        assert!(is_py_space('\u{3000}'));
        assert!(!is_py_space('\u{200b}'));
    }
}

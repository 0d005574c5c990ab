//! The filters, globals and Python methods of transformers' jinja2 environment,
//! where minijinja's own differ from what jinja2 does.

use std::fmt::{self, Write};

use chrono::format::{Fixed, Item, StrftimeItems};
use chrono::NaiveDateTime;
use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind, State};

use super::json::{dumps, DumpOptions};
use super::mutable::{is_mutator, PyList};
use super::pyfmt::{is_py_space, py_str, to_py_str};

/// Marks an error raised by the template itself through `raise_exception`, so
/// the message can be handed back verbatim.
#[derive(Debug, Clone)]
pub struct RaisedByTemplate(pub String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// `raise_exception(message)`: transformers raises `TemplateError(message)`.
pub fn raise_exception(message: &Value) -> Result<Value, Error> {
    let message = to_py_str(message);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

/// `strftime_now(format)`: `datetime.now().strftime(format)`, or a fixed instant.
/// Python's `datetime.now()` is naive, so `%Z` and `%z` print nothing.
pub fn make_strftime_now(
    fixed: Option<NaiveDateTime>,
) -> impl Fn(&str) -> Result<String, Error> + Send + Sync + 'static {
    move |format: &str| {
        let mut items: Vec<Item<'_>> = Vec::new();
        for item in StrftimeItems::new(format) {
            match item {
                Item::Error => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("invalid strftime format {format:?}"),
                    ))
                }
                Item::Fixed(
                    Fixed::TimezoneName
                    | Fixed::TimezoneOffset
                    | Fixed::TimezoneOffsetColon
                    | Fixed::TimezoneOffsetDoubleColon
                    | Fixed::TimezoneOffsetTripleColon
                    | Fixed::TimezoneOffsetColonZ
                    | Fixed::TimezoneOffsetZ,
                ) => {}
                item => items.push(item),
            }
        }
        let now = fixed.unwrap_or_else(|| chrono::Local::now().naive_local());
        let mut out = String::new();
        write!(out, "{}", now.format_with_items(items.into_iter())).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot format date with {format:?}"),
            )
        })?;
        Ok(out)
    }
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// positional arguments in that order, as transformers defines it.
pub fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    tojson_args(value, &args.into_values())
}

fn tojson_args(value: &Value, args: &[Value]) -> Result<Value, Error> {
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<&Value>,
        Option<&Value>,
        Option<&Value>,
        Option<&Value>,
        Kwargs,
    ) = from_args(args)?;
    let pick = |positional: Option<&Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named
            .or_else(|| positional.cloned())
            .filter(|v| !v.is_none()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(to_py_str(&v)),
        Some(v) => {
            let width = i64::try_from(v)?;
            Some(" ".repeat(usize::try_from(width).unwrap_or(0)))
        }
    };
    let separators = match pick(separators, "separators")? {
        None => None,
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => Some((to_py_str(item), to_py_str(key))),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be an (item_separator, key_separator) pair",
                    ))
                }
            }
        }
    };
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let mut opts = DumpOptions::new(indent, separators);
    opts.ensure_ascii = ensure_ascii;
    opts.sort_keys = sort_keys;
    dumps(value, &opts).map(Value::from)
}

/// Applied to every `for` loop's iterable (see `source`): jinja2 raises on
/// `None`, minijinja would iterate it as empty.
pub fn py_iter(value: Value) -> Result<Value, Error> {
    if value.is_none() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "'NoneType' object is not iterable",
        ));
    }
    Ok(value)
}

/// `is iterable`: Python's `iter(x)` succeeds (undefined iterates as empty).
pub fn is_iterable(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
    )
}

/// `is sequence`: has `len()` and `[]` in Python, so strings and dicts too.
pub fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

/// `is number`: `isinstance(x, numbers.Number)`, which includes `bool`.
pub fn is_number(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::Number | ValueKind::Bool)
}

/// `length` / `count`: Python's `len()`; jinja2's `Undefined` has length 0.
pub fn length(value: &Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Value::from(0));
    }
    if let Some(len) = value.len() {
        return Ok(Value::from(len));
    }
    if value.kind() == ValueKind::Iterable {
        return Ok(Value::from(value.try_iter()?.count()));
    }
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("object of type '{}' has no len()", value.kind()),
    ))
}

/// `string`: Python's `str()`.
pub fn string(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    Value::from(to_py_str(value))
}

/// `join(d="", attribute=None)`: `d.join(str(x) for x in value)`.
pub fn join(
    value: &Value,
    joiner: Option<&Value>,
    attribute: Option<&Value>,
) -> Result<Value, Error> {
    let joiner = joiner.map(to_py_str).unwrap_or_default();
    let mut out = String::new();
    if value.is_undefined() {
        return Ok(Value::from(out));
    }
    let value = py_iter(value.clone())?;
    if let Some(s) = value.as_str() {
        // Python iterates a string's characters.
        let parts: Vec<String> = s.chars().map(String::from).collect();
        return Ok(Value::from(parts.join(&joiner)));
    }
    for (idx, item) in value.try_iter()?.enumerate() {
        if idx > 0 {
            out.push_str(&joiner);
        }
        let item = match attribute {
            Some(attr) => lookup_path(&item, attr)?,
            None => item,
        };
        py_str(&item, &mut out);
    }
    Ok(Value::from(out))
}

/// jinja2's `make_attrgetter`: dotted paths, integer parts index sequences.
fn lookup_path(item: &Value, path: &Value) -> Result<Value, Error> {
    if path.is_integer() {
        return item.get_item(path);
    }
    let mut current = item.clone();
    for part in to_py_str(path).split('.') {
        current = match part.parse::<i64>() {
            Ok(idx) => current.get_item(&Value::from(idx))?,
            Err(_) => current.get_attr(part)?,
        };
    }
    Ok(current)
}

/// `trim(chars=None)`: Python's `str.strip(chars)`.
pub fn trim(value: &Value, chars: Option<&Value>) -> Value {
    let s = to_py_str(value);
    let chars = chars.filter(|c| !c.is_none()).map(to_py_str);
    keep_markup(value, py_strip(&s, chars.as_deref(), true, true).to_owned())
}

/// Filters applied to Markup return Markup, as markupsafe's methods do.
fn keep_markup(input: &Value, output: String) -> Value {
    if input.is_safe() {
        Value::from_safe_string(output)
    } else {
        Value::from(output)
    }
}

/// `indent(width=4, first=False, blank=False)`, jinja2's algorithm: the text
/// gets a newline appended before `splitlines()`, so a trailing newline survives.
pub fn indent(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    indent_args(value, &args.into_values())
}

fn indent_args(value: &Value, args: &[Value]) -> Result<Value, Error> {
    let (width, first, blank, kwargs): (Option<&Value>, Option<bool>, Option<bool>, Kwargs) =
        from_args(args)?;
    let width = match kwargs
        .get::<Option<Value>>("width")?
        .or_else(|| width.cloned())
    {
        None => "    ".to_owned(),
        Some(w) if w.kind() == ValueKind::String => to_py_str(&w),
        Some(w) => " ".repeat(usize::try_from(i64::try_from(w)?).unwrap_or(0)),
    };
    let first = kwargs
        .get::<Option<bool>>("first")?
        .or(first)
        .unwrap_or(false);
    let blank = kwargs
        .get::<Option<bool>>("blank")?
        .or(blank)
        .unwrap_or(false);
    kwargs.assert_all_used()?;

    let mut text = to_py_str(value);
    text.push('\n');
    let lines = py_splitlines(&text);
    let mut out = String::new();
    for (idx, line) in lines.iter().enumerate() {
        if idx > 0 {
            out.push('\n');
        }
        let indented = if idx == 0 {
            false
        } else {
            blank || !line.is_empty()
        };
        if indented {
            out.push_str(&width);
        }
        out.push_str(line);
    }
    if first {
        out.insert_str(0, &width);
    }
    Ok(keep_markup(value, out))
}

/// Python's `str.splitlines()` (without `keepends`).
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((idx, ch)) = chars.next() {
        let is_break = matches!(
            ch,
            '\n' | '\r'
                | '\u{b}'
                | '\u{c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        );
        if is_break {
            lines.push(&s[start..idx]);
            let mut end = idx + ch.len_utf8();
            if ch == '\r' {
                if let Some(&(_, '\n')) = chars.peek() {
                    chars.next();
                    end += 1;
                }
            }
            start = end;
        }
    }
    if start < s.len() {
        lines.push(&s[start..]);
    }
    lines
}

/// Python's `str.strip` / `lstrip` / `rstrip`.
fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    out
}

/// Python's `str.split(sep=None, maxsplit=-1)`.
fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    let limit = usize::try_from(maxsplit).ok();
    let Some(sep) = sep else {
        let mut parts = Vec::new();
        let mut rest = py_strip(s, None, true, false);
        while !rest.is_empty() {
            if limit.is_some_and(|n| parts.len() == n) {
                parts.push(rest.to_owned());
                break;
            }
            let end = rest.find(is_py_space).unwrap_or(rest.len());
            parts.push(rest[..end].to_owned());
            rest = py_strip(&rest[end..], None, true, false);
        }
        return Ok(parts);
    };
    if sep.is_empty() {
        return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
    }
    Ok(match limit {
        Some(n) => s.splitn(n + 1, sep).map(str::to_owned).collect(),
        None => s.split(sep).map(str::to_owned).collect(),
    })
}

/// Python methods on values: str `strip`/`lstrip`/`rstrip`/`split` with Python's
/// whitespace rules here, everything else from minijinja-contrib's `pycompat`.
pub fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<&Value>,) = from_args(args)?;
                let chars = chars.filter(|c| !c.is_none()).map(to_py_str);
                let (left, right) = (method != "rstrip", method != "lstrip");
                return Ok(Value::from(py_strip(s, chars.as_deref(), left, right)));
            }
            "split" => {
                let (sep, maxsplit, kwargs): (Option<&Value>, Option<i64>, Kwargs) =
                    from_args(args)?;
                let sep = kwargs.get::<Option<Value>>("sep")?.or_else(|| sep.cloned());
                let maxsplit = kwargs.get::<Option<i64>>("maxsplit")?.or(maxsplit);
                kwargs.assert_all_used()?;
                let sep = sep.filter(|v| !v.is_none()).map(|v| to_py_str(&v));
                let parts = py_split(s, sep.as_deref(), maxsplit.unwrap_or(-1))?;
                // A Python list: a mutating template may change it in place.
                return Ok(PyList::new_value(
                    parts.into_iter().map(Value::from).collect(),
                ));
            }
            _ => {}
        }
    }
    // Lists and dicts a template may change are `PyList`/`PyDict` objects,
    // which handle their mutators before this callback runs. What reaches it
    // is a value Python would not let change either (a tuple, `range()`, the
    // generator of `|map`), or one minijinja built that we do not convert.
    if matches!(value.kind(), ValueKind::Seq | ValueKind::Map) && is_mutator(method) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "'{}' object has no method '{method}' here: only lists and dicts of the \
                 context, literals, `+`, `|list`, `|sort`, `|dictsort`, `dict()` and \
                 `str.split()` can be changed in place",
                py_type_name(value)
            ),
        ));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn py_type_name(value: &Value) -> &'static str {
    match value.kind() {
        ValueKind::Map => "dict",
        ValueKind::Seq if value.is_tuple() => "tuple",
        ValueKind::Seq => "list",
        _ => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_like_python() {
        let split = |s: &str, sep: Option<&str>, n: i64| py_split(s, sep, n).unwrap();
        assert_eq!(split("  a  b c ", None, -1), ["a", "b", "c"]);
        assert_eq!(split("  a  b c ", None, 1), ["a", "b c "]);
        assert_eq!(split("   ", None, -1), Vec::<String>::new());
        assert_eq!(split("a,,b", Some(","), -1), ["a", "", "b"]);
        assert_eq!(split("a,b,c", Some(","), 1), ["a", "b,c"]);
        assert_eq!(split("", Some(","), -1), [""]);
        assert!(py_split("a", Some(""), -1).is_err());
    }

    #[test]
    fn strip_like_python() {
        assert_eq!(py_strip("\u{1f} x \n", None, true, true), "x");
        assert_eq!(py_strip("xxaxx", Some("x"), true, false), "axx");
        assert_eq!(py_strip("xxaxx", Some("x"), false, true), "xxa");
    }

    #[test]
    fn indent_like_jinja2() {
        let ind = |s: &str, args: &[Value]| indent_args(&Value::from(s), args).unwrap().to_string();
        assert_eq!(ind("{\n", &[Value::from(4), Value::from(true)]), "    {\n");
        assert_eq!(ind("a\nb\n\nc", &[Value::from(2)]), "a\n  b\n\n  c");
        assert_eq!(
            ind(
                "a\n\nb",
                &[Value::from(2), Value::from(false), Value::from(true)]
            ),
            "a\n  \n  b"
        );
        assert_eq!(ind("a\r\nb", &[Value::from("> ")]), "a\n> b");
    }

    #[test]
    fn splitlines_like_python() {
        assert_eq!(py_splitlines("a\r\nb\rc\u{2028}d\n"), ["a", "b", "c", "d"]);
        assert_eq!(py_splitlines("a\n\n"), ["a", ""]);
    }

    #[test]
    fn tojson_arguments() {
        let v = crate::template::json_to_value(&serde_json::json!({"b": [1, "é"], "a": null}));
        let kw = |pairs: &[(&str, Value)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect::<Kwargs>()
        };
        assert_eq!(
            tojson_args(&v, &[]).unwrap().to_string(),
            r#"{"b": [1, "é"], "a": null}"#
        );
        let sorted =
            tojson_args(&v, &[Value::from(kw(&[("sort_keys", Value::from(true))]))]).unwrap();
        assert_eq!(sorted.to_string(), r#"{"a": null, "b": [1, "é"]}"#);
        let ascii = tojson_args(&v, &[Value::from(true)]).unwrap();
        assert_eq!(ascii.to_string(), r#"{"b": [1, "\u00e9"], "a": null}"#);
        let indented = tojson_args(&v, &[Value::from(kw(&[("indent", Value::from(1))]))]).unwrap();
        assert_eq!(
            indented.to_string(),
            "{\n \"b\": [\n  1,\n  \"é\"\n ],\n \"a\": null\n}"
        );
    }

    #[test]
    fn raise_exception_keeps_message() {
        let err = raise_exception(&Value::from("Only user roles!")).unwrap_err();
        let source = std::error::Error::source(&err).unwrap();
        assert_eq!(source.to_string(), "Only user roles!");
    }

    #[test]
    fn strftime_with_fixed_clock() {
        let at = chrono::NaiveDate::from_ymd_opt(2025, 3, 7)
            .unwrap()
            .and_hms_opt(8, 9, 10)
            .unwrap();
        let f = make_strftime_now(Some(at));
        assert_eq!(f("%d %b %Y").unwrap(), "07 Mar 2025");
        assert_eq!(f("%Y-%m-%dT%H:%M:%S").unwrap(), "2025-03-07T08:09:10");
        assert_eq!(f("[%Z%z]").unwrap(), "[]");
        assert!(f("%Q").is_err());
    }
}

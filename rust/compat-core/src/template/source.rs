//! Source-level desugaring applied before minijinja compiles a template, for
//! the two jinja2 behaviours minijinja has no hook for. Both rewrites are
//! tag-local and keep whitespace-control markers, so output is unchanged:
//!
//! - `{% generation %}` / `{% endgeneration %}` (transformers' `AssistantTracker`
//!   tag, which renders its body unchanged and only records where assistant text
//!   lands) become `{% if true %}` / `{% endif %}`.
//! - `{% for x in ITER ... %}` becomes `{% for x in (ITER)|__py_iter ... %}`:
//!   minijinja iterates `none` as an empty sequence, jinja2 raises `TypeError`;
//!   the filter restores the error and passes everything else through.
//!
//! The scanner understands comments, `{% raw %}` blocks and string literals, so it
//! never rewrites text that is not a tag.

use std::borrow::Cow;

/// Name of the filter that rejects non-iterable values in `for` loops.
pub const ITER_FILTER: &str = "__py_iter";

/// Applies both rewrites; borrows when nothing changes.
pub fn desugar(source: &str) -> Cow<'_, str> {
    if !source.contains("{%") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 64);
    let mut changed = false;
    let mut pos = 0;
    while let Some(rel) = source[pos..].find('{') {
        let start = pos + rel;
        let rest = &source[start..];
        let close = if rest.starts_with("{#") {
            "#}"
        } else if rest.starts_with("{{") {
            "}}"
        } else if rest.starts_with("{%") {
            "%}"
        } else {
            out.push_str(&source[pos..=start]);
            pos = start + 1;
            continue;
        };
        out.push_str(&source[pos..start]);
        let Some(inner_len) = find_close(&rest[2..], close, close != "#}") else {
            // Unterminated: leave it to the parser to report.
            out.push_str(rest);
            return if changed {
                Cow::Owned(out)
            } else {
                Cow::Borrowed(source)
            };
        };
        let end = start + 2 + inner_len + 2;
        let tag = &source[start..end];
        if close == "%}" {
            let inner = &tag[2..tag.len() - 2];
            let (open_marker, body) = split_marker_front(inner);
            let (body, close_marker) = split_marker_back(body);
            let keyword = first_word(body);
            if keyword == "raw" {
                // Copy the raw block verbatim up to and including its endraw tag.
                let raw_end = find_endraw(&source[end..]).map_or(source.len(), |n| end + n);
                out.push_str(&source[start..raw_end]);
                pos = raw_end;
                continue;
            }
            if let Some(new_body) = rewrite_statement(keyword, body) {
                changed = true;
                out.push_str("{%");
                out.push_str(open_marker);
                out.push_str(&new_body);
                out.push_str(close_marker);
                out.push_str("%}");
                pos = end;
                continue;
            }
        }
        out.push_str(tag);
        pos = end;
    }
    out.push_str(&source[pos..]);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(source)
    }
}

fn rewrite_statement(keyword: &str, body: &str) -> Option<String> {
    match keyword {
        "generation" if body.trim() == "generation" => Some(" if true ".to_owned()),
        "endgeneration" if body.trim() == "endgeneration" => Some(" endif ".to_owned()),
        "for" => rewrite_for(body),
        _ => None,
    }
}

/// `for TARGET in ITER [if COND] [recursive]`: jinja2 parses ITER without a
/// conditional expression, so the first top-level `if` / `recursive` ends it.
fn rewrite_for(body: &str) -> Option<String> {
    let words = top_level_words(body);
    let in_pos = words.iter().find(|(_, w)| *w == "in").map(|(i, _)| *i)?;
    let iter_start = in_pos + 2;
    let iter_end = words
        .iter()
        .find(|(i, w)| *i > in_pos && (*w == "if" || *w == "recursive"))
        .map_or(body.len(), |(i, _)| *i);
    let iter = body[iter_start..iter_end].trim();
    if iter.is_empty() {
        return None;
    }
    Some(format!(
        "{} ({iter})|{ITER_FILTER} {}",
        &body[..iter_start],
        &body[iter_end..]
    ))
}

/// Identifier-like words outside string literals and brackets, with offsets.
fn top_level_words(s: &str) -> Vec<(usize, &str)> {
    let bytes = s.as_bytes();
    let mut words = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\'' | b'"' => i = skip_string(bytes, i),
            b'(' | b'[' | b'{' => {
                depth += 1;
                i += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            _ if b.is_ascii_alphabetic() || b == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                // `x.in` is an attribute, not the keyword.
                let after_dot = start > 0 && bytes[start - 1] == b'.';
                if depth == 0 && !after_dot {
                    words.push((start, &s[start..i]));
                }
            }
            _ => i += 1,
        }
    }
    words
}

/// Index just past the string literal starting at `start`.
fn skip_string(bytes: &[u8], start: usize) -> usize {
    let quote = bytes[start];
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b if b == quote => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Length of the tag body before `close`, skipping string literals in code tags.
fn find_close(s: &str, close: &str, code: bool) -> Option<usize> {
    if !code {
        return s.find(close);
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\'' | b'"' => i = skip_string(bytes, i),
            _ if s[i..].starts_with(close) => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// Offset just past the `{% endraw %}` tag (any markers) in `s`.
fn find_endraw(s: &str) -> Option<usize> {
    let mut pos = 0;
    while let Some(rel) = s[pos..].find("{%") {
        let start = pos + rel;
        let end = start + 2 + s[start + 2..].find("%}")? + 2;
        let (_, body) = split_marker_front(&s[start + 2..end - 2]);
        let (body, _) = split_marker_back(body);
        if body.trim() == "endraw" {
            return Some(end);
        }
        pos = start + 2;
    }
    None
}

fn first_word(s: &str) -> &str {
    let s = s.trim_start();
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

fn split_marker_front(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => s.split_at(1),
        _ => ("", s),
    }
}

fn split_marker_back(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => s.split_at(s.len() - 1),
        _ => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_if_true() {
        assert_eq!(
            desugar("{%- generation -%}x{% endgeneration %}"),
            "{%- if true -%}x{% endif %}"
        );
        assert_eq!(desugar("{%+ generation%}"), "{%+ if true %}");
    }

    #[test]
    fn for_iterables_are_guarded() {
        assert_eq!(
            desugar("{%- for m in messages -%}"),
            "{%- for m in (messages)|__py_iter -%}"
        );
        assert_eq!(
            desugar("{% for k, v in d.items() if k != 'in' %}"),
            "{% for k, v in (d.items())|__py_iter if k != 'in' %}"
        );
        assert_eq!(
            desugar("{% for x in (a if b else c) recursive %}"),
            "{% for x in ((a if b else c))|__py_iter recursive %}"
        );
        assert_eq!(
            desugar("{% for x in xs[1:]|selectattr('in') %}"),
            "{% for x in (xs[1:]|selectattr('in'))|__py_iter %}"
        );
    }

    #[test]
    fn non_tags_are_untouched() {
        let src =
            "{{ '{% for x in y %}' }}{# {% for a in b %} #}{% raw %}{% for q in r %}{% endraw %}";
        assert!(matches!(desugar(src), Cow::Borrowed(_)));
        assert_eq!(desugar("{ {x} {%- if a %}"), "{ {x} {%- if a %}");
    }

    #[test]
    fn string_literals_with_close_markers() {
        assert_eq!(
            desugar("{% for x in ['%}'] %}{{ x }}{% endfor %}"),
            "{% for x in (['%}'])|__py_iter %}{{ x }}{% endfor %}"
        );
    }
}

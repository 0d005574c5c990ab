//! Hugging Face chat templates rendered with minijinja, matching transformers'
//! jinja2 environment byte for byte:
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[loopcontrols, AssistantTracker])` with the globals
//! `raise_exception` and `strftime_now` and transformers' `tojson` filter.
//!
//! Where minijinja and jinja2 differ, this module supplies jinja2's behaviour:
//! - printing (`{{ x }}`, `|string`, `|join`) uses Python's `str()`
//!   ([`pyfmt`]): `True`, `None`, `{'a': 1}`, `1e-05`;
//! - `tojson` is `json.dumps` with transformers' arguments ([`json`]);
//! - `indent` and `trim` follow jinja2's algorithms, and `str.strip`/`split`
//!   use Python's whitespace rules ([`builtins`]);
//! - methods that mutate (`list.append`, `dict.update`, ...) raise, as the
//!   immutable sandbox does;
//! - transformers' `{% generation %}` block (which only records where assistant
//!   text lands and renders its body unchanged) is rewritten to an always-true
//!   `{% if %}` block before compiling ([`desugar_generation`]).

mod builtins;
mod json;
mod pyfmt;

use std::borrow::Cow;

use chrono::NaiveDateTime;
use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, UndefinedBehavior};

use crate::error::CoreError;

pub use pyfmt::{py_repr, py_str, to_py_str};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template. Cheap to share across threads (`Send + Sync`).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors become [`CoreError::Template`].
    pub fn new(source: &str) -> Result<Self, CoreError> {
        Self::with_clock(source, None)
    }

    /// Like [`ChatTemplate::new`], but `strftime_now` reports `now` instead of
    /// the local wall clock (reproducible prompts; tests).
    pub fn with_clock(source: &str, now: Option<NaiveDateTime>) -> Result<Self, CoreError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .map_err(|e| CoreError::Template(e.to_string()))?,
        );
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_debug(false);
        env.set_formatter(|out, _state, value| {
            let mut text = String::new();
            pyfmt::py_str(value, &mut text);
            out.write_str(&text).map_err(minijinja::Error::from)
        });
        env.set_unknown_method_callback(builtins::unknown_method);
        env.add_function("raise_exception", builtins::raise_exception);
        env.add_function("strftime_now", builtins::make_strftime_now(now));
        env.add_filter("tojson", builtins::tojson);
        env.add_filter("string", builtins::string);
        env.add_filter("join", builtins::join);
        env.add_filter("trim", builtins::trim);
        env.add_filter("indent", builtins::indent);
        env.add_template_owned(TEMPLATE_NAME, desugar_generation(source).into_owned())
            .map_err(|e| template_error(&e))?;
        Ok(Self { env })
    }

    /// Renders with `ctx`, a JSON object of template variables (`messages`,
    /// `tools`, `add_generation_prompt`, `bos_token`, ..., extra kwargs).
    pub fn render(&self, ctx: &serde_json::Value) -> Result<String, CoreError> {
        if !ctx.is_object() {
            return Err(CoreError::InvalidInput(
                "template context must be a JSON object".to_owned(),
            ));
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_error(&e))?;
        template.render(json_to_value(ctx)).map_err(|e| template_error(&e))
    }
}

/// Converts JSON into a template value, keeping object key order.
pub fn json_to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (Value::from(k.as_str()), json_to_value(v))))
        }
    }
}

/// Errors from `raise_exception` keep the template's message verbatim; any
/// other error carries minijinja's description.
fn template_error(err: &minijinja::Error) -> CoreError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<builtins::RaisedByTemplate>() {
            return CoreError::TemplateRaised(raised.0.clone());
        }
        source = current.source();
    }
    CoreError::Template(err.to_string())
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` tags
/// (whitespace-control markers kept) into `{% if true %}` / `{% endif %}`.
/// transformers' `AssistantTracker` renders the body unchanged; only its
/// assistant-token mask, which we do not produce, depends on the tag.
pub fn desugar_generation(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return Cow::Owned(out);
        };
        let inner = &tag[2..end];
        let (open_marker, body) = split_marker_front(inner);
        let (body, close_marker) = split_marker_back(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(keyword) => {
                out.push_str("{%");
                out.push_str(open_marker);
                out.push(' ');
                out.push_str(keyword);
                out.push(' ');
                out.push_str(close_marker);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn split_marker_front(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some('-' | '+') => s.split_at(1),
        _ => ("", s),
    }
}

fn split_marker_back(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some('-' | '+') => s.split_at(s.len() - 1),
        _ => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: &serde_json::Value) -> Result<String, CoreError> {
        ChatTemplate::new(src)?.render(ctx)
    }

    #[test]
    fn prints_like_python() {
        let ctx = json!({"d": {"a": 1, "b": [true, null, 1.5, "x"]}, "f": 1e-5, "n": null});
        assert_eq!(
            render("{{ d }}|{{ f }}|{{ n }}|{{ d.b|string }}|{{ missing }}", &ctx).unwrap(),
            "{'a': 1, 'b': [True, None, 1.5, 'x']}|1e-05|None|[True, None, 1.5, 'x']|"
        );
    }

    #[test]
    fn whitespace_options_match_transformers() {
        let src = "{% for m in messages %}\n  {% if m %}\n{{ m }}\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(render(src, &json!({"messages": ["a", "b"]})).unwrap(), "a\nb\n");
    }

    #[test]
    fn loop_controls_enabled() {
        let src = "{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}";
        assert_eq!(render(src, &json!({"xs": [1, 2, 3, 4, 5]})).unwrap(), "13");
    }

    #[test]
    fn tojson_keeps_key_order_without_escaping() {
        let ctx = json!({"t": {"z": "<b>&'é", "a": {"y": 1, "b": 2}}});
        assert_eq!(
            render("{{ t|tojson }}", &ctx).unwrap(),
            r#"{"z": "<b>&'é", "a": {"y": 1, "b": 2}}"#
        );
    }

    #[test]
    fn raise_exception_message_verbatim() {
        let err = render("{{ raise_exception('Roles must alternate!') }}", &json!({})).unwrap_err();
        match err {
            CoreError::TemplateRaised(msg) => assert_eq!(msg, "Roles must alternate!"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn syntax_error_is_template_error() {
        assert!(matches!(ChatTemplate::new("{% if %}"), Err(CoreError::Template(_))));
    }

    #[test]
    fn python_methods_available() {
        let ctx = json!({"s": "  a b  ", "d": {"k": "v"}});
        let out = render(
            "{{ s.strip() }}|{{ s.split() }}|{{ d.get('k') }}|{{ d.get('x', 1) }}|{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}",
            &ctx,
        )
        .unwrap();
        assert_eq!(out, "a b|['a', 'b']|v|1|k=v");
    }

    #[test]
    fn mutation_is_refused_like_the_immutable_sandbox() {
        let err = render("{% set xs = [] %}{{ xs.append(1) }}", &json!({})).unwrap_err();
        assert!(err.to_string().contains("unsafe"), "{err}");
    }

    #[test]
    fn generation_block_renders_its_body() {
        let src = "{% for m in messages %}{%- generation -%} {{ m }} {%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, &json!({"messages": ["a", "b"]})).unwrap(), "ab");
        assert_eq!(desugar_generation("{%+ generation%}"), "{%+ if true %}");
    }

    #[test]
    fn context_must_be_object() {
        let tpl = ChatTemplate::new("x").unwrap();
        assert!(matches!(tpl.render(&json!([])), Err(CoreError::InvalidInput(_))));
    }

    #[test]
    fn fixed_clock() {
        let at = chrono::NaiveDate::from_ymd_opt(2024, 12, 31).unwrap().and_hms_opt(0, 0, 0).unwrap();
        let tpl = ChatTemplate::with_clock("{{ strftime_now('%d %B %Y') }}", Some(at)).unwrap();
        assert_eq!(tpl.render(&json!({})).unwrap(), "31 December 2024");
    }

    #[test]
    fn is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}

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
//! - methods that mutate (`list.append`, `dict.update`, ...) work as in
//!   jinja2's `SandboxedEnvironment` (transformers' immutable sandbox refuses
//!   them; llama.cpp and jinja2's default sandbox render them): a template that
//!   calls one renders with mutable lists and dicts ([`mutable`]);
//! - `~` joins Python `str()`s; `safe`/`escape` create Markup, and
//!   `Markup + str` escapes the string ([`ops`]);
//! - the tests `iterable`, `sequence` and `number` follow Python's types;
//! - `for` loops over `none` raise, and transformers' `{% generation %}` tag is
//!   supported, through a tag-level rewrite before compiling ([`source`]).

mod builtins;
mod json;
mod mutable;
mod ops;
mod pyfmt;
mod source;

use chrono::NaiveDateTime;
use minijinja::filters;
use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, State, UndefinedBehavior};

use crate::error::CoreError;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template. Cheap to share across threads (`Send + Sync`).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template mutates lists or dicts: its context is made of
    /// [`mutable`] values (other templates keep minijinja's cheaper ones).
    mutable: bool,
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors become [`CoreError::Template`].
    pub fn new(source: &str) -> Result<Self, CoreError> {
        Self::with_clock(source, None)
    }

    /// Like [`ChatTemplate::new`], but `strftime_now` reports `now` instead of
    /// the local wall clock (reproducible prompts; tests).
    pub fn with_clock(source: &str, now: Option<NaiveDateTime>) -> Result<Self, CoreError> {
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| CoreError::Template(e.to_string()))?;
        let desugared = source::desugar(source);
        let rewritten = ops::rewrite_operators(&desugared, syntax.clone());
        let mutable = rewritten.mutable;
        let compiled_source = rewritten.source.unwrap_or_else(|| desugared.into_owned());
        let mut env = Environment::new();
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_debug(false);
        env.set_formatter(|out, _state, value| {
            if let Some(s) = value.as_str() {
                return out.write_str(s).map_err(minijinja::Error::from);
            }
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
        env.add_filter("length", builtins::length);
        env.add_filter("count", builtins::length);
        env.add_filter(source::ITER_FILTER, builtins::py_iter);
        env.add_test("iterable", builtins::is_iterable);
        env.add_test("sequence", builtins::is_sequence);
        env.add_test("number", builtins::is_number);
        env.add_function(ops::ADD_FUNCTION, ops::py_add);
        env.add_function(ops::CONCAT_FUNCTION, ops::py_concat);
        env.add_filter("escape", ops::escape);
        env.add_filter("e", ops::escape);
        env.add_filter("forceescape", ops::forceescape);
        if mutable {
            // The functions and filters that return a new Python list or dict.
            env.add_function(ops::MUTABLE_FUNCTION, mutable::to_mutable);
            env.add_function("dict", mutable::py_dict);
            env.add_filter("list", |state: &State, value: Value| {
                filters::list(state, value).map(mutable::to_mutable)
            });
            env.add_filter("sort", |state: &State, value: Value, kwargs: Kwargs| {
                filters::sort(state, value, kwargs).map(mutable::to_mutable)
            });
            env.add_filter("dictsort", |value: &Value, kwargs: Kwargs| {
                filters::dictsort(value, kwargs).map(mutable::to_mutable)
            });
        }
        env.add_template_owned(TEMPLATE_NAME, compiled_source)
            .map_err(|e| template_error(&e))?;
        Ok(Self { env, mutable })
    }

    /// Renders with `ctx`, a JSON object of template variables (`messages`,
    /// `tools`, `add_generation_prompt`, `bos_token`, ..., extra kwargs).
    pub fn render(&self, ctx: &serde_json::Value) -> Result<String, CoreError> {
        if !ctx.is_object() {
            return Err(CoreError::InvalidInput(
                "template context must be a JSON object".to_owned(),
            ));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        let ctx = if self.mutable {
            mutable::json_to_mutable(ctx)
        } else {
            json_to_value(ctx)
        };
        template.render(ctx).map_err(|e| template_error(&e))
    }
}

/// Converts JSON into a template value, keeping object key order.
pub(crate) fn json_to_value(json: &serde_json::Value) -> Value {
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
        serde_json::Value::Array(items) => {
            Value::from(items.iter().map(json_to_value).collect::<Vec<_>>())
        }
        serde_json::Value::Object(map) => Value::from_pairs(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v))),
        ),
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
            render(
                "{{ d }}|{{ f }}|{{ n }}|{{ d.b|string }}|{{ missing }}",
                &ctx
            )
            .unwrap(),
            "{'a': 1, 'b': [True, None, 1.5, 'x']}|1e-05|None|[True, None, 1.5, 'x']|"
        );
    }

    #[test]
    fn whitespace_options_match_transformers() {
        let src = "{% for m in messages %}\n  {% if m %}\n{{ m }}\n  {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, &json!({"messages": ["a", "b"]})).unwrap(),
            "a\nb\n"
        );
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
        assert!(matches!(
            ChatTemplate::new("{% if %}"),
            Err(CoreError::Template(_))
        ));
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
    fn generation_block_renders_its_body() {
        let src =
            "{% for m in messages %}{%- generation -%} {{ m }} {%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, &json!({"messages": ["a", "b"]})).unwrap(), "ab");
    }

    #[test]
    fn none_is_not_iterable() {
        let src = "{% for t in tools %}{{ t }}{% endfor %}";
        assert!(render(src, &json!({"tools": null})).is_err());
        assert_eq!(render(src, &json!({})).unwrap(), "");
        assert_eq!(render("{{ missing|length }}", &json!({})).unwrap(), "0");
        assert!(render("{{ tools|length }}", &json!({"tools": null})).is_err());
        let tests = "{{ tools is iterable }} {{ missing is iterable }} {{ 'ab' is sequence }} \
                     {{ {} is sequence }} {{ true is number }}";
        assert_eq!(
            render(tests, &json!({"tools": null})).unwrap(),
            "False True True True True"
        );
    }

    #[test]
    fn filter_keyword_arguments() {
        let ctx = json!({"t": {"a": [1]}});
        assert_eq!(
            render(
                "{{ t|tojson(indent=2, sort_keys=true)|indent(2, first=true) }}",
                &ctx
            )
            .unwrap(),
            "  {\n    \"a\": [\n      1\n    ]\n  }"
        );
        assert_eq!(
            render("{{ t|tojson(separators=(',', ':')) }}", &ctx).unwrap(),
            r#"{"a":[1]}"#
        );
    }

    #[test]
    fn markup_addition_escapes_like_jinja2() {
        let src = r#"{{ "'"|safe + name + "'"|safe + t|tojson }}|{{ "<"|safe ~ name }}"#;
        let ctx = json!({"name": "a&b", "t": {"k": "v"}});
        assert_eq!(
            render(src, &ctx).unwrap(),
            "'a&amp;b'{&#34;k&#34;: &#34;v&#34;}|<a&b"
        );
    }

    #[test]
    fn context_must_be_object() {
        let tpl = ChatTemplate::new("x").unwrap();
        assert!(matches!(
            tpl.render(&json!([])),
            Err(CoreError::InvalidInput(_))
        ));
    }

    #[test]
    fn fixed_clock() {
        let at = chrono::NaiveDate::from_ymd_opt(2024, 12, 31)
            .unwrap()
            .and_hms_opt(0, 0, 0)
            .unwrap();
        let tpl = ChatTemplate::with_clock("{{ strftime_now('%d %B %Y') }}", Some(at)).unwrap();
        assert_eq!(tpl.render(&json!({})).unwrap(), "31 December 2024");
    }

    #[test]
    fn is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}

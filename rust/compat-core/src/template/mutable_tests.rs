//! Tests of [`super`]: templates that change lists and dicts, against jinja2.
use serde_json::json;

use super::super::ChatTemplate;
use crate::error::CoreError;

fn render(src: &str, ctx: &serde_json::Value) -> Result<String, CoreError> {
    ChatTemplate::new(src)?.render(ctx)
}

// Expected strings are jinja2 3.1.6 `SandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True)` renderings of the same sources.

#[test]
fn namespace_queue_like_kimi_k2() {
    let src = "{% set ns = namespace(ids=[]) %}{% set _ = ns.ids.append('a') %}\
               {% set _ = ns.ids.append('b') %}{{ ns.ids }}|{{ ns.ids.pop(0) }}|\
               {{ ns.ids|tojson }}|{{ ns.ids|length }}";
    assert_eq!(render(src, &json!({})).unwrap(), r#"['a', 'b']|a|["b"]|1"#);
}

#[test]
fn list_mutators() {
    let src = "{% set xs = [3, 1, 2] %}{{ xs.append(4) }}{% set _ = xs.insert(-1, 9) %}\
               {% set _ = xs.extend([7, 8]) %}{{ xs }}{% set _ = xs.remove(9) %}\
               {{ xs.pop() }}{{ xs.pop(-2) }}{{ xs }}{% set _ = xs.sort() %}{{ xs }}\
               {% set _ = xs.sort(reverse=true) %}{{ xs }}{% set _ = xs.reverse() %}\
               {{ xs }}{{ xs.index(3) }}{% set _ = xs.clear() %}{{ xs }}{{ xs|length }}";
    assert_eq!(
        render(src, &json!({})).unwrap(),
        "None[3, 1, 2, 9, 4, 7, 8]84[3, 1, 2, 7][1, 2, 3, 7][7, 3, 2, 1][1, 2, 3, 7]2[]0"
    );
}

#[test]
fn indices_clamp_or_raise_like_python() {
    let src = "{% set xs = [1, 2] %}{% set _ = xs.insert(100, 'e') %}\
               {% set _ = xs.insert(-100, 's') %}{{ xs }}{{ xs.pop(-4) }}{{ xs }}";
    assert_eq!(
        render(src, &json!({})).unwrap(),
        "['s', 1, 2, 'e']s[1, 2, 'e']"
    );
    assert!(render("{% set xs = [1] %}{{ xs.pop(1) }}", &json!({})).is_err());
    assert!(render("{% set xs = [1] %}{{ xs.pop(-2) }}", &json!({})).is_err());
}

#[test]
fn literals_are_fresh_on_every_evaluation() {
    let src = "{% for i in range(2) %}{% set xs = [] %}{% set _ = xs.append(i) %}\
               {{ xs }}{% endfor %}";
    assert_eq!(render(src, &json!({})).unwrap(), "[0][1]");
    // And on every render of one compiled template.
    let tpl = ChatTemplate::new("{% set xs = [] %}{% set _ = xs.append(1) %}{{ xs }}").unwrap();
    assert_eq!(tpl.render(&json!({})).unwrap(), "[1]");
    assert_eq!(tpl.render(&json!({})).unwrap(), "[1]");
}

#[test]
fn dict_mutators() {
    let src = "{% set d = {'a': 1} %}{% set _ = d.update({'b': 2}, c=3) %}\
               {% set _ = d.update(a=0) %}{{ d }}{{ d.setdefault('e', []) }}\
               {% set _ = d.setdefault('e').append(5) %}{{ d.pop('b') }}\
               {{ d.pop('zz', 'dflt') }}{{ d.popitem() }}{{ d|tojson }}\
               {% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ 'a' in d }}\
               {{ d|length }}{% set _ = d.clear() %}{{ d }}";
    assert_eq!(
        render(src, &json!({})).unwrap(),
        r#"{'a': 0, 'b': 2, 'c': 3}[]2dflt('e', [5]){"a": 0, "c": 3}a=0;c=3;True2{}"#
    );
}

#[test]
fn context_lists_and_dicts_are_mutable() {
    let src = "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}\
               {% set _ = messages[0].update(content='changed') %}\
               {% for m in messages %}{{ m.role }}:{{ m['content'] }};{% endfor %}\
               {{ messages|length }}{{ messages[-1] }}";
    let ctx = json!({"messages": [{"role": "system", "content": "s"}]});
    assert_eq!(
        render(src, &ctx).unwrap(),
        "system:changed;user:x;2{'role': 'user', 'content': 'x'}"
    );
}

#[test]
fn mutable_lists_behave_like_lists() {
    let src = "{% set xs = [1] %}{% set ys = xs + [2] %}{% set _ = xs.append(3) %}\
               {% set _ = ys.append(4) %}{{ xs }}{{ ys }}{{ xs == [1, 3] }}{{ [1, 3] == xs }}\
               {{ 3 in xs }}{{ xs[-1] }}{{ xs[0:1] }}{{ xs|join(',') }}{{ xs|first }}\
               {{ xs|last }}{{ xs is sequence }}{{ xs is iterable }}{{ xs is mapping }}\
               {{ xs|tojson }}";
    assert_eq!(
        render(src, &json!({})).unwrap(),
        "[1, 3][1, 2, 4]TrueTrueTrue3[1]1,313TrueTrueFalse[1, 3]"
    );
    let truth = "{% set xs = [] %}{% if xs %}T{% else %}F{% endif %}\
                 {% set _ = xs.append(none) %}{% if xs %}T{% else %}F{% endif %}{{ xs }}";
    assert_eq!(render(truth, &json!({})).unwrap(), "FT[None]");
    let shared = "{% macro add(q, x) %}{% set _ = q.append(x) %}{% endmacro %}\
                  {% set q = [] %}{{ add(q, 1) }}{{ add(q, 2) }}{{ q }}";
    assert_eq!(render(shared, &json!({})).unwrap(), "[1, 2]");
}

#[test]
fn new_lists_from_filters_and_methods_are_mutable() {
    let src = "{% set parts = 'a b c'.split() %}{% set _ = parts.pop(0) %}{{ parts }}\
               {% set l = 'xy'|list %}{% set _ = l.append('z') %}{{ l }}\
               {% set s = [2, 1]|sort %}{% set _ = s.append(0) %}{{ s }}\
               {% set d = dict(a=1) %}{% set _ = d.update(b=2) %}{{ d }}\
               {% set c = d.copy() %}{% set _ = c.clear() %}{{ d }}{{ c }}";
    assert_eq!(
        render(src, &json!({})).unwrap(),
        "['b', 'c']['x', 'y', 'z'][1, 2, 0]{'a': 1, 'b': 2}{'a': 1, 'b': 2}{}"
    );
}

#[test]
fn python_errors_raise() {
    for src in [
        "{% set xs = [1, 'a'] %}{% set _ = xs.sort() %}",
        "{% set xs = [] %}{{ xs.pop() }}",
        "{% set xs = [1] %}{{ xs.remove(2) }}",
        "{% set d = {} %}{{ d.pop('k') }}",
        "{% set d = {} %}{{ d.popitem() }}",
        "{% set d = {} %}{{ d.setdefault([1], 2) }}",
        // A container that holds itself (Python allows it; we refuse).
        "{% set xs = [] %}{{ xs.append(xs) }}",
        "{% set xs = [] %}{% set d = {'x': xs} %}{{ xs.append(d) }}{{ xs.extend([(1, d)]) }}",
        "{% set d = {} %}{{ d.update(me=[d]) }}",
        "{% set d = {} %}{{ d.setdefault('k', {'d': d}) }}",
        // A tuple cannot change in Python either.
        "{% set t = (1, 2) %}{{ t.append(3) }}",
    ] {
        assert!(render(src, &json!({})).is_err(), "{src}");
    }
}

#[test]
fn templates_that_do_not_mutate_keep_minijinja_values() {
    assert!(
        !ChatTemplate::new("{{ [1] + xs }}{{ d.get('a') }}")
            .unwrap()
            .mutable
    );
    assert!(
        ChatTemplate::new("{% set _ = xs.append(1) %}")
            .unwrap()
            .mutable
    );
}

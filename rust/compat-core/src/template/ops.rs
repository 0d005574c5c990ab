//! Python semantics for the operators `~` and `+`, and for templates that
//! mutate lists and dicts, applied by rewriting the source at the spans
//! minijinja's own parser reports.
//!
//! - `a ~ b` is `str(a) + str(b)` in jinja2; minijinja formats operands its own
//!   way (`1e-07` prints as `0.0000001`). Every `~` becomes `__py_concat(a, b)`.
//! - Even with autoescape off, `x|safe` (and `escape`) produce a
//!   `markupsafe.Markup`, and `Markup + str` HTML-escapes the plain operand:
//!   `"'"|safe + '"a"'` renders `'&#34;a&#34;`. minijinja's `+` ignores string
//!   safety, so in templates that can create Markup (they use `safe`, `escape`,
//!   `e` or `forceescape`) every `a + b` becomes `__py_add(a, b)`. Markup is
//!   represented by minijinja's safe strings. Templates without those filters
//!   keep minijinja's `+`, which agrees with Python's on plain values.
//! - A template that calls a list or dict mutator (`xs.append(x)`, ...) renders
//!   with mutable values ([`super::mutable`]): every list or dict literal
//!   becomes `__py_mutable([...])` (a fresh object per evaluation; minijinja
//!   folds constant literals into one shared value) and every `a + b` becomes
//!   `__py_add(a, b)`, which builds a new list where minijinja's `+` would keep
//!   a lazy view of both operands. Templates that never mutate are unchanged.

use minijinja::machinery::ast::{BinOpKind, CallArg, Expr, Stmt};
use minijinja::machinery::parse;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

use super::mutable::{self, PyList};
use super::pyfmt::{py_str, to_py_str};

/// Name of the Python-semantics `+` function.
pub const ADD_FUNCTION: &str = "__py_add";
/// Name of the Python-semantics `~` function.
pub const CONCAT_FUNCTION: &str = "__py_concat";
/// Name of the function that turns a literal into a mutable list or dict.
pub const MUTABLE_FUNCTION: &str = "__py_mutable";

const MARKUP_FILTERS: &[&str] = &["safe", "escape", "e", "forceescape"];

/// The source to compile and whether the template mutates lists or dicts.
#[derive(Debug, Default)]
pub struct Rewritten {
    /// `None` when the source compiles as it is.
    pub source: Option<String>,
    /// The template calls a mutator: render with mutable lists and dicts.
    pub mutable: bool,
}

/// Rewrites `a ~ b` to `__py_concat(a, b)`, `a + b` to `__py_add(a, b)` if the
/// template can create Markup or mutates, and wraps literals in mutating
/// templates. A source that does not parse comes back unchanged (compiling it
/// then reports the error).
pub fn rewrite_operators(source: &str, syntax: SyntaxConfig) -> Rewritten {
    let may_concat = source.contains('~');
    let may_markup = MARKUP_FILTERS.iter().any(|f| source.contains(f)) && source.contains('+');
    let may_mutate = mutable::LIST_MUTATORS
        .iter()
        .chain(mutable::DICT_MUTATORS)
        .any(|m| source.contains(m));
    if !may_concat && !may_markup && !may_mutate {
        return Rewritten::default();
    }
    let Ok(ast) = parse(source, "chat_template", syntax) else {
        return Rewritten::default();
    };
    let mut found = Found::default();
    found.stmt(&ast);
    let mutable = found.mutates;
    Rewritten {
        source: apply_edits(source, &found),
        mutable,
    }
}

fn apply_edits(source: &str, found: &Found) -> Option<String> {
    let ops: Vec<&Op> = found
        .ops
        .iter()
        .filter(|op| op.symbol == '~' || found.markup || found.mutates)
        .collect();
    let literals: &[(usize, usize)] = if found.mutates { &found.literals } else { &[] };
    if ops.is_empty() && literals.is_empty() {
        return None;
    }
    // (offset, phase, order, text, bytes replaced). At one offset: closes
    // (inner first), then an operator, then opens (outer first).
    let mut edits: Vec<(usize, u8, usize, &str, usize)> = Vec::new();
    for op in ops {
        let gap = source.get(op.left_end..op.right_start)?;
        let at = op.left_end + gap.find(op.symbol)?;
        let len = op.end - op.start;
        let open = if op.symbol == '~' {
            "__py_concat("
        } else {
            "__py_add("
        };
        edits.push((op.end, 0, len, ")", 0));
        edits.push((at, 1, 0, ",", 1));
        edits.push((op.start, 2, usize::MAX - len, open, 0));
    }
    for &(start, end) in literals {
        let len = end - start;
        edits.push((end, 0, len, ")", 0));
        edits.push((start, 2, usize::MAX - len, "__py_mutable(", 0));
    }
    edits.sort_unstable_by_key(|&(pos, phase, order, _, _)| (pos, phase, order));
    let mut out = String::with_capacity(source.len() + edits.len() * 8);
    let mut pos = 0;
    for (at, _, _, text, replaced) in edits {
        out.push_str(source.get(pos..at)?);
        out.push_str(text);
        pos = at + replaced;
    }
    out.push_str(&source[pos..]);
    Some(out)
}

/// One `+` or `~`: its node span and the gap holding the operator.
struct Op {
    symbol: char,
    start: usize,
    end: usize,
    left_end: usize,
    right_start: usize,
}

/// The operators to rewrite, whether a Markup-producing filter occurs, and
/// for mutating templates the spans of list and dict literals.
#[derive(Default)]
struct Found {
    ops: Vec<Op>,
    markup: bool,
    mutates: bool,
    literals: Vec<(usize, usize)>,
    /// Inside an assignment target (`for a, b in`), where a literal is a pattern.
    in_target: bool,
}

impl Found {
    fn stmts(&mut self, stmts: &[Stmt<'_>]) {
        for stmt in stmts {
            self.stmt(stmt);
        }
    }

    fn stmt(&mut self, stmt: &Stmt<'_>) {
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::ForLoop(f) => {
                self.target(&f.target);
                self.expr(&f.iter);
                self.opt(f.filter_expr.as_ref());
                self.stmts(&f.body);
                self.stmts(&f.else_body);
            }
            Stmt::IfCond(i) => {
                self.expr(&i.expr);
                self.stmts(&i.true_body);
                self.stmts(&i.false_body);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.target(target);
                    self.expr(value);
                }
                self.stmts(&w.body);
            }
            Stmt::Set(s) => {
                self.target(&s.target);
                self.expr(&s.expr);
            }
            Stmt::SetBlock(s) => {
                self.opt(s.filter.as_ref());
                self.stmts(&s.body);
            }
            Stmt::AutoEscape(a) => {
                self.expr(&a.enabled);
                self.stmts(&a.body);
            }
            Stmt::FilterBlock(f) => {
                self.expr(&f.filter);
                self.stmts(&f.body);
            }
            Stmt::Block(b) => self.stmts(&b.body),
            Stmt::Import(i) => {
                self.expr(&i.expr);
                self.expr(&i.name);
            }
            Stmt::FromImport(i) => self.expr(&i.expr),
            Stmt::Extends(e) => self.expr(&e.name),
            Stmt::Include(i) => self.expr(&i.name),
            Stmt::Macro(m) => {
                self.exprs(&m.defaults);
                self.stmts(&m.body);
            }
            Stmt::CallBlock(c) => {
                self.expr(&c.call.expr);
                self.args(&c.call.args);
                self.exprs(&c.macro_decl.defaults);
                self.stmts(&c.macro_decl.body);
            }
            Stmt::Do(d) => {
                self.expr(&d.call.expr);
                self.args(&d.call.args);
            }
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
        }
    }

    fn target(&mut self, expr: &Expr<'_>) {
        self.in_target = true;
        self.expr(expr);
        self.in_target = false;
    }

    fn literal(&mut self, expr: &Expr<'_>) {
        if !self.in_target {
            let span = expr.span();
            self.literals
                .push((span.start_offset as usize, span.end_offset as usize));
        }
    }

    fn opt(&mut self, expr: Option<&Expr<'_>>) {
        if let Some(expr) = expr {
            self.expr(expr);
        }
    }

    fn exprs(&mut self, exprs: &[Expr<'_>]) {
        for expr in exprs {
            self.expr(expr);
        }
    }

    fn args(&mut self, args: &[CallArg<'_>]) {
        for arg in args {
            match arg {
                CallArg::Pos(e)
                | CallArg::Kwarg(_, e)
                | CallArg::PosSplat(e)
                | CallArg::KwargSplat(e) => {
                    self.expr(e);
                }
            }
        }
    }

    fn expr(&mut self, expr: &Expr<'_>) {
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                self.opt(s.start.as_ref());
                self.opt(s.stop.as_ref());
                self.opt(s.step.as_ref());
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                let symbol = match b.op {
                    BinOpKind::Add => Some('+'),
                    BinOpKind::Concat => Some('~'),
                    _ => None,
                };
                if let Some(symbol) = symbol {
                    let span = expr.span();
                    self.ops.push(Op {
                        symbol,
                        start: span.start_offset as usize,
                        end: span.end_offset as usize,
                        left_end: b.left.span().end_offset as usize,
                        right_start: b.right.span().start_offset as usize,
                    });
                }
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                self.opt(i.false_expr.as_ref());
            }
            Expr::Filter(f) => {
                self.markup |= MARKUP_FILTERS.contains(&f.name);
                self.opt(f.expr.as_ref());
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(c) => {
                if let Expr::GetAttr(g) = &c.expr {
                    self.mutates |= mutable::is_mutator(g.name);
                }
                self.expr(&c.expr);
                self.args(&c.args);
            }
            Expr::List(l) => {
                self.literal(expr);
                self.exprs(&l.items);
            }
            Expr::Tuple(t) => self.exprs(&t.items),
            Expr::Map(m) => {
                self.literal(expr);
                self.exprs(&m.keys);
                self.exprs(&m.values);
            }
        }
    }
}

/// `markupsafe.escape(str(value))`.
pub fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `escape` / `e`: Markup stays as it is, anything else is escaped into Markup.
pub fn escape(value: &Value) -> Value {
    if value.is_safe() {
        return value.clone();
    }
    forceescape(value)
}

/// `forceescape`: escapes even Markup.
pub fn forceescape(value: &Value) -> Value {
    Value::from_safe_string(html_escape(&to_py_str(value)))
}

/// jinja2's `a ~ b`: `str(a) + str(b)`, a plain string.
pub fn py_concat(a: &Value, b: &Value) -> Value {
    let mut out = String::new();
    py_str(a, &mut out);
    py_str(b, &mut out);
    Value::from(out)
}

/// Python's `a + b`, with `Markup + str` escaping the plain string.
pub fn py_add(a: &Value, b: &Value) -> Result<Value, Error> {
    if a.is_undefined() || b.is_undefined() {
        return Err(Error::from(ErrorKind::UndefinedError));
    }
    match (a.kind(), b.kind()) {
        (ValueKind::String, ValueKind::String) => {
            let (sa, sb) = (
                a.as_str().unwrap_or_default(),
                b.as_str().unwrap_or_default(),
            );
            Ok(match (a.is_safe(), b.is_safe()) {
                (false, false) => Value::from([sa, sb].concat()),
                (true, true) => Value::from_safe_string([sa, sb].concat()),
                (true, false) => Value::from_safe_string([sa, &html_escape(sb)].concat()),
                (false, true) => Value::from_safe_string([&html_escape(sa), sb].concat()),
            })
        }
        (ValueKind::Number | ValueKind::Bool, ValueKind::Number | ValueKind::Bool) => {
            if is_int(a) && is_int(b) {
                let (x, y) = (int(a)?, int(b)?);
                return x
                    .checked_add(y)
                    .map(Value::from)
                    .ok_or_else(|| unsupported(a, b));
            }
            Ok(Value::from(float(a)? + float(b)?))
        }
        (ValueKind::Seq, ValueKind::Seq) if a.is_tuple() == b.is_tuple() => {
            let items: Vec<Value> = a.try_iter()?.chain(b.try_iter()?).collect();
            Ok(if a.is_tuple() {
                Value::from(minijinja::value::Tuple::from(items))
            } else {
                PyList::new_value(items)
            })
        }
        _ => Err(unsupported(a, b)),
    }
}

fn is_int(v: &Value) -> bool {
    v.kind() == ValueKind::Bool || v.is_integer()
}

fn int(v: &Value) -> Result<i128, Error> {
    if v.kind() == ValueKind::Bool {
        return Ok(i128::from(v.is_true()));
    }
    i128::try_from(v.clone())
}

fn float(v: &Value) -> Result<f64, Error> {
    if v.kind() == ValueKind::Bool {
        return Ok(if v.is_true() { 1.0 } else { 0.0 });
    }
    f64::try_from(v.clone())
}

fn unsupported(a: &Value, b: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "unsupported operand type(s) for +: '{}' and '{}'",
            a.kind(),
            b.kind()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite(src: &str) -> Option<String> {
        rewrite_operators(src, SyntaxConfig::default()).source
    }

    #[test]
    fn templates_without_markup_keep_plus() {
        assert_eq!(rewrite("{{ a + b }}"), None);
        assert_eq!(rewrite("{{ a|safe }}"), None);
        assert_eq!(rewrite("{{ '~' + b }}"), None);
    }

    #[test]
    fn concatenations_become_calls() {
        assert_eq!(
            rewrite("{{ a ~ b ~ (c + d) }}").as_deref(),
            Some("{{ __py_concat(__py_concat(a , b) , (c + d)) }}")
        );
        assert_eq!(
            py_concat(&Value::from(1e-7), &Value::UNDEFINED).as_str(),
            Some("1e-07")
        );
        assert_eq!(
            py_concat(&Value::from("x"), &Value::from(vec![Value::from(true)])).as_str(),
            Some("x[True]")
        );
    }

    #[test]
    fn additions_become_calls() {
        assert_eq!(
            rewrite("{{ 'x'|safe + a + (b + c) }}{% set d = [1] + [2] %}").as_deref(),
            Some("{{ __py_add(__py_add('x'|safe , a) , (__py_add(b , c))) }}{% set d = __py_add([1] , [2]) %}")
        );
        assert_eq!(
            rewrite("{{ (a)+(b)|safe }}").as_deref(),
            Some("{{ __py_add((a),(b)|safe) }}")
        );
    }

    #[test]
    fn mutating_templates_wrap_literals_and_additions() {
        let src =
            "{% for a, b in [[1], {'k': []}] %}{% set _ = ns.q.append([a] + b) %}{% endfor %}";
        let rewritten = rewrite_operators(src, SyntaxConfig::default());
        assert!(rewritten.mutable);
        assert_eq!(
            rewritten.source.as_deref(),
            Some(
                "{% for a, b in __py_mutable([__py_mutable([1]), __py_mutable({'k': __py_mutable([])})]) %}\
                 {% set _ = ns.q.append(__py_add(__py_mutable([a]) , b)) %}{% endfor %}"
            )
        );
        // Without a mutator call nothing changes.
        let plain = rewrite_operators("{{ [1] + {'append': 1}.append }}", SyntaxConfig::default());
        assert!(!plain.mutable);
        assert_eq!(plain.source, None);
    }

    #[test]
    fn markup_plus_str_escapes() {
        let safe = Value::from_safe_string("'".into());
        let plain = Value::from("\"a\" & <b>");
        let sum = py_add(&safe, &plain).unwrap();
        assert!(sum.is_safe());
        assert_eq!(sum.as_str(), Some("'&#34;a&#34; &amp; &lt;b&gt;"));
        assert_eq!(
            py_add(&plain, &safe).unwrap().as_str(),
            Some("&#34;a&#34; &amp; &lt;b&gt;'")
        );
        assert!(!py_add(&plain, &plain).unwrap().is_safe());
    }

    #[test]
    fn python_addition() {
        assert_eq!(
            py_add(&Value::from(1), &Value::from(true)).unwrap(),
            Value::from(2)
        );
        assert_eq!(
            py_add(&Value::from(1), &Value::from(0.5)).unwrap(),
            Value::from(1.5)
        );
        let list = py_add(&Value::from(vec![1]), &Value::from(vec![2])).unwrap();
        assert_eq!(list.to_string(), "[1, 2]");
        assert!(py_add(&Value::from("a"), &Value::from(1)).is_err());
        assert!(py_add(&Value::UNDEFINED, &Value::from("a")).is_err());
        assert!(py_add(&Value::from(()), &Value::from("a")).is_err());
    }

    #[test]
    fn escape_like_markupsafe() {
        assert_eq!(
            escape(&Value::from("<'&\">")).as_str(),
            Some("&lt;&#39;&amp;&#34;&gt;")
        );
        let safe = Value::from_safe_string("<b>".into());
        assert_eq!(escape(&safe).as_str(), Some("<b>"));
        assert_eq!(forceescape(&safe).as_str(), Some("&lt;b&gt;"));
    }
}

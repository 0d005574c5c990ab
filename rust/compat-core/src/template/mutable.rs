//! Python lists and dicts that a template can change in place, as jinja2's
//! `SandboxedEnvironment` allows (`list.append`, `dict.update`, ...).
//!
//! minijinja's own sequences and maps are immutable, so a template that calls a
//! mutating method renders with these objects instead (see [`super::ops`]):
//! the context's lists and dicts, list and dict literals, `+` of two lists,
//! `|list`, `dict(...)` and `str.split()` produce them. Each holds its items
//! behind a mutex (values must be `Send + Sync`) and otherwise behaves like a
//! minijinja sequence or map: iteration, length, indexing, `in`, equality,
//! `tojson` and printing all go through the [`Object`] trait.
//!
//! The lock is never held while other template values are compared, iterated
//! or hashed: methods copy the items out, work on the copy, and write back.
//! A list or dict may not come to hold itself (Python allows `xs.append(xs)`
//! and prints `[[...]]`): printing, `tojson` and comparisons would recurse
//! without end, so such an insertion raises instead.

use std::cmp::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use minijinja::value::{from_args, Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

/// The list methods jinja2's sandbox lets a template call (`_mutable_spec`).
pub const LIST_MUTATORS: &[&str] = &[
    "append", "clear", "pop", "reverse", "insert", "sort", "extend", "remove",
];
/// The dict methods jinja2's sandbox lets a template call (`_mutable_spec`).
pub const DICT_MUTATORS: &[&str] = &["clear", "pop", "popitem", "setdefault", "update"];

/// Whether `method` mutates a list or a dict.
pub fn is_mutator(method: &str) -> bool {
    LIST_MUTATORS.contains(&method) || DICT_MUTATORS.contains(&method)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn py_error(kind: &str, message: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("{kind}: {message}"))
}

/// Most values a reference check visits before giving up (shared substructure
/// can make a small value expensive to walk).
const REACH_LIMIT: usize = 100_000;

/// Raises if inserting `value` into `target` would make `target` hold itself.
fn check_no_cycle<T: Object + 'static>(target: &Arc<T>, value: &Value) -> Result<(), Error> {
    let cycle = || {
        py_error(
            "ValueError",
            "a list or dict cannot contain itself in a chat template",
        )
    };
    let mut stack = vec![value.clone()];
    let mut visited = 0usize;
    while let Some(item) = stack.pop() {
        if item
            .downcast_object_ref::<T>()
            .is_some_and(|obj| std::ptr::eq(obj, Arc::as_ptr(target)))
        {
            return Err(cycle());
        }
        visited += 1;
        if visited > REACH_LIMIT {
            return Err(cycle());
        }
        match item.kind() {
            ValueKind::Seq => stack.extend(item.try_iter()?),
            ValueKind::Map => {
                for key in item.try_iter()? {
                    stack.push(item.get_item(&key).unwrap_or_default());
                    stack.push(key);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A Python `list`.
#[derive(Debug, Default)]
pub struct PyList {
    items: Mutex<Vec<Value>>,
}

impl PyList {
    pub fn new_value(items: Vec<Value>) -> Value {
        Value::from_object(Self {
            items: Mutex::new(items),
        })
    }

    fn snapshot(&self) -> Vec<Value> {
        lock(&self.items).clone()
    }
}

/// Python's index into a list of `len` (negative counts from the end), `None`
/// when out of range (`pop`).
fn checked_index(index: i64, len: usize) -> Option<usize> {
    let len = i64::try_from(len).ok()?;
    let at = if index < 0 { index + len } else { index };
    if (0..len).contains(&at) {
        usize::try_from(at).ok()
    } else {
        None
    }
}

/// Python's `list.insert` position: out-of-range indices clamp to the ends.
fn insert_position(index: i64, len: usize) -> usize {
    let signed = i64::try_from(len).unwrap_or(i64::MAX);
    let at = if index < 0 {
        index.saturating_add(signed)
    } else {
        index
    };
    usize::try_from(at.clamp(0, signed)).unwrap_or(len)
}

/// Python's ordering for `list.sort()`: values of one kind compare, mixed
/// kinds raise `TypeError` instead of using minijinja's cross-kind order.
fn py_compare(a: &Value, b: &Value) -> Result<Ordering, Error> {
    let number = |v: &Value| matches!(v.kind(), ValueKind::Number | ValueKind::Bool);
    let comparable = (number(a) && number(b))
        || (a.kind() == b.kind() && matches!(a.kind(), ValueKind::String | ValueKind::Seq));
    if !comparable {
        return Err(py_error(
            "TypeError",
            format!(
                "'<' not supported between instances of '{}' and '{}'",
                a.kind(),
                b.kind()
            ),
        ));
    }
    Ok(a.cmp(b))
}

impl Object for PyList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let index = key.as_usize()?;
        lock(&self.items).get(index).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(lock(&self.items).len())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(lock(&self.items).len())
    }

    fn call_method(
        self: &Arc<Self>,
        _state: &mut State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, Error> {
        match method {
            "append" => {
                let (item,): (Value,) = from_args(args)?;
                check_no_cycle(self, &item)?;
                lock(&self.items).push(item);
            }
            "extend" => {
                let (other,): (Value,) = from_args(args)?;
                let extra: Vec<Value> = other.try_iter()?.collect();
                for item in &extra {
                    check_no_cycle(self, item)?;
                }
                lock(&self.items).extend(extra);
            }
            "insert" => {
                let (index, item): (i64, Value) = from_args(args)?;
                check_no_cycle(self, &item)?;
                let mut items = lock(&self.items);
                let at = insert_position(index, items.len());
                items.insert(at, item);
            }
            "pop" => {
                let (index,): (Option<i64>,) = from_args(args)?;
                let mut items = lock(&self.items);
                if items.is_empty() {
                    return Err(py_error("IndexError", "pop from empty list"));
                }
                let Some(at) = checked_index(index.unwrap_or(-1), items.len()) else {
                    return Err(py_error("IndexError", "pop index out of range"));
                };
                return Ok(items.remove(at));
            }
            "remove" => {
                let (item,): (Value,) = from_args(args)?;
                let Some(at) = self.snapshot().iter().position(|x| *x == item) else {
                    return Err(py_error("ValueError", "list.remove(x): x not in list"));
                };
                lock(&self.items).remove(at);
            }
            "clear" => lock(&self.items).clear(),
            "reverse" => lock(&self.items).reverse(),
            "sort" => {
                let (kwargs,): (Kwargs,) = from_args(args)?;
                let reverse = kwargs.get::<Option<bool>>("reverse")?.unwrap_or(false);
                kwargs.assert_all_used()?;
                let mut items = self.snapshot();
                let mut failure = None;
                // Stable, and `reverse` keeps equal items in their order, as in Python.
                items.sort_by(|a, b| {
                    let (a, b) = if reverse { (b, a) } else { (a, b) };
                    py_compare(a, b).unwrap_or_else(|err| {
                        failure.get_or_insert(err);
                        Ordering::Equal
                    })
                });
                if let Some(err) = failure {
                    return Err(err);
                }
                *lock(&self.items) = items;
            }
            "index" => {
                let (item,): (Value,) = from_args(args)?;
                return match self.snapshot().iter().position(|x| *x == item) {
                    Some(at) => Ok(Value::from(at)),
                    None => Err(py_error("ValueError", "item is not in list")),
                };
            }
            "copy" => {
                let () = from_args(args)?;
                return Ok(Self::new_value(self.snapshot()));
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        }
        Ok(Value::from(()))
    }
}

/// A Python `dict`: insertion-ordered pairs. Chat-template dicts are small
/// (message fields, a schema's properties), so a linear scan beats hashing.
#[derive(Debug, Default)]
pub struct PyDict {
    pairs: Mutex<Vec<(Value, Value)>>,
}

impl PyDict {
    pub fn new_value(pairs: Vec<(Value, Value)>) -> Value {
        Value::from_object(Self {
            pairs: Mutex::new(pairs),
        })
    }

    /// Sets `key` like `d[key] = value`: an existing key keeps its position.
    fn insert(pairs: &mut Vec<(Value, Value)>, key: Value, value: Value) {
        match pairs.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => pairs.push((key, value)),
        }
    }

    fn position(&self, key: &Value) -> Option<usize> {
        lock(&self.pairs).iter().position(|(k, _)| k == key)
    }
}

/// Lists and dicts are unhashable in Python; refusing them as keys also keeps
/// a dict from comparing against itself under its own lock.
fn check_hashable(key: &Value) -> Result<(), Error> {
    if matches!(key.kind(), ValueKind::Map) || (key.kind() == ValueKind::Seq && !key.is_tuple()) {
        return Err(py_error(
            "TypeError",
            format!("unhashable type: '{}'", key.kind()),
        ));
    }
    Ok(())
}

fn is_hashable(key: &Value) -> bool {
    check_hashable(key).is_ok()
}

impl Object for PyDict {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        if !is_hashable(key) {
            return None;
        }
        lock(&self.pairs)
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        lock(&self.pairs)
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(lock(&self.pairs).iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(lock(&self.pairs).len())
    }

    fn call_method(
        self: &Arc<Self>,
        _state: &mut State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, Error> {
        match method {
            "update" => {
                let (other, kwargs): (Option<Value>, Kwargs) = from_args(args)?;
                let mut updates = Vec::new();
                if let Some(other) = other {
                    updates = pairs_of(&other)?;
                }
                for key in kwargs.args() {
                    updates.push((Value::from(key), kwargs.get::<Value>(key)?));
                }
                for (key, value) in &updates {
                    check_hashable(key)?;
                    check_no_cycle(self, value)?;
                }
                let mut pairs = lock(&self.pairs);
                for (key, value) in updates {
                    Self::insert(&mut pairs, key, value);
                }
            }
            "setdefault" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                check_hashable(&key)?;
                if let Some(found) = self.get_value(&key) {
                    return Ok(found);
                }
                let value = default.unwrap_or(Value::from(()));
                check_no_cycle(self, &value)?;
                lock(&self.pairs).push((key, value.clone()));
                return Ok(value);
            }
            "pop" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                check_hashable(&key)?;
                return match (self.position(&key), default) {
                    (Some(at), _) => Ok(lock(&self.pairs).remove(at).1),
                    (None, Some(default)) => Ok(default),
                    (None, None) => Err(py_error("KeyError", key.to_string())),
                };
            }
            "popitem" => {
                let () = from_args(args)?;
                return match lock(&self.pairs).pop() {
                    Some((key, value)) => {
                        Ok(Value::from(minijinja::value::Tuple::from([key, value])))
                    }
                    None => Err(py_error("KeyError", "'popitem(): dictionary is empty'")),
                };
            }
            "clear" => {
                let () = from_args(args)?;
                lock(&self.pairs).clear();
            }
            "copy" => {
                let () = from_args(args)?;
                return Ok(Self::new_value(lock(&self.pairs).clone()));
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        }
        Ok(Value::from(()))
    }
}

/// `dict(other)` / `d.update(other)`: a mapping's pairs, or an iterable of pairs.
fn pairs_of(other: &Value) -> Result<Vec<(Value, Value)>, Error> {
    if other.kind() == ValueKind::Map {
        return Ok(other
            .try_iter()?
            .map(|key| {
                let value = other.get_item(&key).unwrap_or_default();
                (key, value)
            })
            .collect());
    }
    let mut pairs = Vec::new();
    for item in other.try_iter()? {
        let parts: Vec<Value> = item.try_iter()?.collect();
        let [key, value]: [Value; 2] = parts.try_into().map_err(|_| {
            py_error(
                "ValueError",
                "dictionary update sequence element has the wrong length; 2 is required",
            )
        })?;
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// A shallow mutable copy of a fresh list or dict (a literal, a filter's
/// result); anything else (strings, tuples, namespaces, mutable values)
/// passes through unchanged, so identity is kept where Python keeps it.
pub fn to_mutable(value: Value) -> Value {
    if value.downcast_object_ref::<PyList>().is_some()
        || value.downcast_object_ref::<PyDict>().is_some()
    {
        return value;
    }
    match value.kind() {
        ValueKind::Seq if !value.is_tuple() => match value.try_iter() {
            Ok(items) => PyList::new_value(items.collect()),
            Err(_) => value,
        },
        ValueKind::Map if !value.is_kwargs() => match pairs_of(&value) {
            Ok(pairs) => PyDict::new_value(pairs),
            Err(_) => value,
        },
        _ => value,
    }
}

/// `dict(mapping_or_pairs=None, **kwargs)`, a mutable dict.
#[allow(clippy::needless_pass_by_value)] // minijinja passes keyword arguments by value
pub fn py_dict(other: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut pairs = Vec::new();
    if let Some(other) = other {
        for (key, value) in pairs_of(&other)? {
            check_hashable(&key)?;
            PyDict::insert(&mut pairs, key, value);
        }
    }
    for key in kwargs.args() {
        PyDict::insert(&mut pairs, Value::from(key), kwargs.get::<Value>(key)?);
    }
    Ok(PyDict::new_value(pairs))
}

/// Converts JSON into mutable template values, keeping object key order.
pub fn json_to_mutable(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Array(items) => {
            PyList::new_value(items.iter().map(json_to_mutable).collect())
        }
        serde_json::Value::Object(map) => PyDict::new_value(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_mutable(v)))
                .collect(),
        ),
        scalar => super::json_to_value(scalar),
    }
}

#[cfg(test)]
#[path = "mutable_tests.rs"]
mod tests;

//! Python objects -> JSON, once per render. Mirrors transformers'
//! `_plain_template_data`: exact JSON types pass, str/int/float subclasses are
//! reduced to the base type, mappings and lists/tuples recurse, pydantic models
//! are dumped, and anything else becomes a `"<TypeName>"` placeholder.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};
use serde_json::{Map, Number, Value};

const MAX_DEPTH: usize = 256;

pub fn to_json(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    convert(obj, 0)
}

fn convert(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err("template data is nested too deeply"));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_str()?.to_owned()));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        if let Ok(v) = i.extract::<i64>() {
            return Ok(Value::from(v));
        }
        if let Ok(v) = i.extract::<u64>() {
            return Ok(Value::from(v));
        }
        return Err(PyValueError::new_err(
            "integer out of the 64-bit range in template data",
        ));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Number::from_f64(f.value())
            .map(Value::Number)
            .ok_or_else(|| {
                PyValueError::new_err("NaN and infinity are not allowed in template data")
            });
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = Map::with_capacity(d.len());
        for (k, v) in d.iter() {
            map.insert(key(&k)?, convert(&v, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .map(|v| convert(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|v| convert(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(m) = obj.cast::<PyMapping>() {
        let mut map = Map::new();
        for item in m.items()?.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            map.insert(key(&k)?, convert(&v, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if obj.hasattr("model_dump")? {
        let dumped = obj.call_method0("model_dump")?;
        return convert(&dumped, depth + 1);
    }
    Ok(Value::String(format!("<{}>", obj.get_type().name()?)))
}

/// JSON object keys are strings; like `json.dumps`, scalar keys are stringified.
fn key(k: &Bound<'_, PyAny>) -> PyResult<String> {
    match convert(k, 0)? {
        Value::String(s) => Ok(s),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Null => Ok("null".to_owned()),
        Value::Number(n) => Ok(n.to_string()),
        _ => Err(PyValueError::new_err("template data keys must be strings")),
    }
}

//! The decode kernels of compat-kernels over Python buffers (MLX arrays, numpy arrays).
//! Weights are read in place; inputs are copied (a few rows); the GIL is released while a
//! kernel runs.
#![allow(unsafe_code)]

use compat_kernels::{CachedHeads, DecodeShape, ShapeError, SwigluWeights};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A C-contiguous float32 buffer seen as a matrix (all leading axes are rows).
#[derive(Debug)]
pub(crate) struct Matrix {
    pub(crate) buf: PyBuffer<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Matrix {
    pub(crate) fn get(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let buf = PyBuffer::<f32>::get(obj)
            .map_err(|e| PyValueError::new_err(format!("{name} must be a float32 buffer: {e}")))?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name} must be C-contiguous"
            )));
        }
        let Some((&cols, leading)) = buf.shape().split_last() else {
            return Err(PyValueError::new_err(format!(
                "{name} must have at least one axis"
            )));
        };
        let rows = leading.iter().product();
        Ok(Self { buf, rows, cols })
    }

    pub(crate) fn expect(&self, name: &str, rows: usize, cols: usize) -> PyResult<()> {
        if (self.rows, self.cols) == (rows, cols) {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "{name} is {:?}, expected {rows} x {cols}",
            self.buf.shape()
        )))
    }

    /// The numbers in place, for as long as `self` (which holds the buffer) lives.
    pub(crate) fn in_place(&self) -> &[f32] {
        // A C-contiguous buffer holds exactly `item_count` elements in order.
        leading_f32s(&self.buf, self.buf.item_count())
    }

    /// Writes `values` into a writable buffer (the output array).
    pub(crate) fn fill(&self, py: Python<'_>, values: &[f32]) -> PyResult<()> {
        if self.buf.readonly() {
            return Err(PyValueError::new_err("out must be writable"));
        }
        self.buf.copy_from_slice(py, values)
    }
}

/// The first `len` f32s of `buf`'s memory, read in place for as long as `buf` lives.
/// Callers pass a `len` no larger than the extent the buffer's shape and strides reach.
fn leading_f32s(buf: &PyBuffer<f32>, len: usize) -> &[f32] {
    if len == 0 {
        return &[];
    }
    // SAFETY: `buf` keeps the exporting object alive and its memory valid for the lifetime
    // of `&buf`; `PyBuffer::<f32>::get` checked the element type, and every caller bounds
    // `len` by the elements the buffer's shape and (non-negative) strides reach from its
    // first one. The memory is not written while we read it: MLX arrays (weights, KV
    // cache) are immutable, and the engine thread (their only user) is inside this call.
    unsafe { std::slice::from_raw_parts(buf.buf_ptr().cast::<f32>(), len) }
}

/// Runs `kernel` on `inputs` with the GIL released and writes its result into `out`.
fn compute_into<F>(py: Python<'_>, out: &Matrix, inputs: &[f32], kernel: F) -> PyResult<()>
where
    F: FnOnce(&[f32], &mut [f32]) -> Result<(), ShapeError> + Send,
{
    let mut result = vec![0.0f32; out.rows * out.cols];
    py.detach(|| kernel(inputs, &mut result))
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
    out.fill(py, &result)
}

/// `out[m, n] = Σ_k x[m, k] · w[n, k]` for float32 `x` `[.., depth]`, `w` `[cols, depth]`,
/// writing a float32 `out` `[.., cols]` with as many rows as `x`.
#[pyfunction]
pub fn matmul_nt(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (x, w, out) = (
        Matrix::get("x", x)?,
        Matrix::get("w", w)?,
        Matrix::get("out", out)?,
    );
    w.expect("w", w.rows, x.cols)?;
    out.expect("out", x.rows, w.rows)?;
    let weights = w.in_place();
    compute_into(py, &out, &x.buf.to_vec(py)?, |inputs, result| {
        compat_kernels::matmul_nt(inputs, weights, result, x.rows, x.cols, w.rows)
    })
}

/// The `SwiGLU` block `(silu(x · w_gateᵀ) ⊙ (x · w_upᵀ)) · w_downᵀ` in one call, for float32
/// `x` `[.., hidden]`, `w_gate`/`w_up` `[inter, hidden]`, `w_down` `[hidden, inter]`,
/// writing `out` shaped like `x`.
#[pyfunction]
pub fn swiglu_mlp(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w_gate: &Bound<'_, PyAny>,
    w_up: &Bound<'_, PyAny>,
    w_down: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = Matrix::get("x", x)?;
    let gate = Matrix::get("w_gate", w_gate)?;
    let (up, down) = (Matrix::get("w_up", w_up)?, Matrix::get("w_down", w_down)?);
    let out = Matrix::get("out", out)?;
    let (hidden, inter) = (x.cols, gate.rows);
    gate.expect("w_gate", inter, hidden)?;
    up.expect("w_up", inter, hidden)?;
    down.expect("w_down", hidden, inter)?;
    out.expect("out", x.rows, hidden)?;
    let weights = SwigluWeights {
        gate: gate.in_place(),
        up: up.in_place(),
        down: down.in_place(),
    };
    compute_into(py, &out, &x.buf.to_vec(py)?, |inputs, result| {
        compat_kernels::swiglu_mlp(inputs, weights, result, x.rows, hidden, inter)
    })
}

/// A 4-D float32 buffer `[batch, heads, positions, dim]` read in place through its
/// strides (a view of a larger KV cache buffer); the last axis must be contiguous.
pub(crate) struct Strided4 {
    buf: PyBuffer<f32>,
    pub(crate) shape: [usize; 4],
    strides: [usize; 3],
}

impl Strided4 {
    pub(crate) fn get(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let buf = PyBuffer::<f32>::get(obj)
            .map_err(|e| PyValueError::new_err(format!("{name} must be a float32 buffer: {e}")))?;
        let bad =
            || PyValueError::new_err(format!("{name} must be 4-D with a contiguous last axis"));
        let shape: [usize; 4] = buf.shape().try_into().map_err(|_| bad())?;
        let item: isize = 4; // bytes per f32
        let strides = buf.strides();
        if strides.len() != 4
            || strides[3] != item
            || strides.iter().any(|s| *s < 0 || s % item != 0)
        {
            return Err(bad());
        }
        let strides = [0, 1, 2].map(|i| (strides[i] / item) as usize);
        Ok(Self {
            buf,
            shape,
            strides,
        })
    }

    /// The numbers from the first element to the last one the view reaches.
    pub(crate) fn heads(&self) -> CachedHeads<'_> {
        let extent = if self.shape.contains(&0) {
            0
        } else {
            (0..3)
                .map(|i| (self.shape[i] - 1) * self.strides[i])
                .sum::<usize>()
                + self.shape[3]
        };
        CachedHeads {
            // `extent` is one past the furthest element the view reaches (strides were
            // checked non-negative, in whole f32s).
            data: leading_f32s(&self.buf, extent),
            batch_stride: self.strides[0],
            head_stride: self.strides[1],
            position_stride: self.strides[2],
        }
    }
}

/// Attention of one decode step: `queries` `[batch, heads, 1, dim]` (contiguous),
/// `keys`/`values` `[batch, kv_heads, positions, dim]` (strided views are read in place),
/// `mask` None or uint8 `[batch, 1, 1, positions]` (nonzero = visible), `out` like `queries`.
#[pyfunction]
pub fn attention_decode(
    py: Python<'_>,
    queries: &Bound<'_, PyAny>,
    keys: &Bound<'_, PyAny>,
    values: &Bound<'_, PyAny>,
    mask: Option<&Bound<'_, PyAny>>,
    scale: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (keys, values) = (
        Strided4::get("keys", keys)?,
        Strided4::get("values", values)?,
    );
    let [batch, kv_heads, positions, head_dim] = keys.shape;
    if values.shape != keys.shape {
        return Err(PyValueError::new_err(format!(
            "values {:?} do not match keys {:?}",
            values.shape, keys.shape
        )));
    }
    let (queries, out) = (Matrix::get("queries", queries)?, Matrix::get("out", out)?);
    let heads = queries.rows / batch.max(1);
    queries.expect("queries", batch * heads, head_dim)?;
    out.expect("out", batch * heads, head_dim)?;
    let visible = visible_positions(py, mask, batch, positions)?;
    let shape = DecodeShape {
        batch,
        heads,
        kv_heads,
        positions,
        head_dim,
        scale,
    };
    let (k, v) = (keys.heads(), values.heads());
    compute_into(py, &out, &queries.buf.to_vec(py)?, |inputs, result| {
        compat_kernels::attention_decode(&shape, inputs, k, v, visible.as_deref(), result)
    })
}

/// A decode mask from Python: None (every position visible) or a contiguous uint8
/// `[batch, 1, 1, positions]` buffer, nonzero = visible.
pub(crate) fn visible_positions(
    py: Python<'_>,
    mask: Option<&Bound<'_, PyAny>>,
    batch: usize,
    positions: usize,
) -> PyResult<Option<Vec<bool>>> {
    let Some(mask) = mask else {
        return Ok(None);
    };
    let buf = PyBuffer::<u8>::get(mask)
        .map_err(|e| PyValueError::new_err(format!("mask must be a uint8 buffer: {e}")))?;
    if !buf.is_c_contiguous() || buf.item_count() != batch * positions {
        return Err(PyValueError::new_err(format!(
            "mask is {:?}, expected {batch} x 1 x 1 x {positions} contiguous",
            buf.shape()
        )));
    }
    Ok(Some(buf.to_vec(py)?.into_iter().map(|v| v != 0).collect()))
}

/// Name of the kernel `matmul_nt` uses on this CPU: `"avx512"` or `"scalar"`.
#[pyfunction]
pub fn matmul_kernel() -> &'static str {
    compat_kernels::kernel_name()
}

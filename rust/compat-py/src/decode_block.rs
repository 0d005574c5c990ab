//! `DecodeBlock`: one llama-style decoder block's decode step in two calls, around the KV
//! cache update that stays in Python (the cache is mlx-lm's). Weights are held as buffers
//! of the model's MLX arrays (read in place) and their shapes are checked once, here.

use compat_kernels::{DecodeShape, DecoderBlock, RmsNorm, Rope, SwigluWeights};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{visible_positions, Matrix, Strided4};

/// The weights of one decoder block (norm → attention → residual → norm → `SwiGLU` →
/// residual), ready for decode steps of one new position per row.
#[pyclass(frozen, module = "compat_serve._native")]
#[derive(Debug)]
pub struct DecodeBlock {
    input_norm: Matrix,
    input_eps: f32,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    post_norm: Matrix,
    post_eps: f32,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    rope: Rope,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn bad(message: String) -> PyErr {
    PyValueError::new_err(message)
}

// pyo3 extracts tuples and lists by value; borrowing them is not an option.
#[allow(clippy::needless_pass_by_value)]
#[pymethods]
impl DecodeBlock {
    /// `norms` = (input norm weight, its eps, post-attention norm weight, its eps);
    /// `attention` = (q, k, v, o) projection weights `[out, in]`; `mlp` = (gate, up, down);
    /// `rope` = (dims, base, scale, traditional) as `mlx.nn.RoPE` holds them.
    #[new]
    fn new(
        norms: (Bound<'_, PyAny>, f32, Bound<'_, PyAny>, f32),
        attention: (
            Bound<'_, PyAny>,
            Bound<'_, PyAny>,
            Bound<'_, PyAny>,
            Bound<'_, PyAny>,
        ),
        mlp: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
        head_dim: usize,
        rope: (usize, f32, f32, bool),
    ) -> PyResult<Self> {
        let input_norm = Matrix::get("input norm", &norms.0)?;
        let post_norm = Matrix::get("post-attention norm", &norms.2)?;
        let hidden = input_norm.cols;
        input_norm.expect("input norm", 1, hidden)?;
        post_norm.expect("post-attention norm", 1, hidden)?;
        let q = Matrix::get("q_proj", &attention.0)?;
        let (k, v) = (
            Matrix::get("k_proj", &attention.1)?,
            Matrix::get("v_proj", &attention.2)?,
        );
        let o = Matrix::get("o_proj", &attention.3)?;
        if head_dim == 0 || q.rows % head_dim != 0 || k.rows % head_dim != 0 {
            return Err(bad(format!(
                "q_proj ({} outputs) and k_proj ({}) are not whole heads of {head_dim}",
                q.rows, k.rows
            )));
        }
        let (heads, kv_heads) = (q.rows / head_dim, k.rows / head_dim);
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(bad(format!(
                "{heads} query heads cannot share {kv_heads} key/value heads"
            )));
        }
        q.expect("q_proj", heads * head_dim, hidden)?;
        k.expect("k_proj", kv_heads * head_dim, hidden)?;
        v.expect("v_proj", kv_heads * head_dim, hidden)?;
        o.expect("o_proj", hidden, heads * head_dim)?;
        let gate = Matrix::get("gate_proj", &mlp.0)?;
        let (up, down) = (
            Matrix::get("up_proj", &mlp.1)?,
            Matrix::get("down_proj", &mlp.2)?,
        );
        let inter = gate.rows;
        gate.expect("gate_proj", inter, hidden)?;
        up.expect("up_proj", inter, hidden)?;
        down.expect("down_proj", hidden, inter)?;
        let (dims, base, scale, traditional) = rope;
        if dims % 2 != 0 || dims > head_dim {
            return Err(bad(format!(
                "RoPE over {dims} of {head_dim} features (must be even and fit)"
            )));
        }
        Ok(Self {
            input_norm,
            input_eps: norms.1,
            q,
            k,
            v,
            o,
            post_norm,
            post_eps: norms.3,
            gate,
            up,
            down,
            rope: Rope {
                dims,
                base,
                scale,
                traditional,
            },
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// Before the cache update: queries, keys and values of one new position per row of
    /// `x` `[rows, 1, hidden]`, row `r` at `positions[r]`, written into `queries`
    /// `[rows, heads, 1, head_dim]` and `keys`/`values` `[rows, kv_heads, 1, head_dim]`.
    fn project(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        positions: Vec<i64>,
        outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
    ) -> PyResult<()> {
        let x = Matrix::get("x", x)?;
        let rows = positions.len();
        x.expect("x", rows, self.input_norm.cols)?;
        let queries = Matrix::get("queries", &outputs.0)?;
        let (keys, values) = (
            Matrix::get("keys", &outputs.1)?,
            Matrix::get("values", &outputs.2)?,
        );
        queries.expect("queries", rows * self.heads, self.head_dim)?;
        keys.expect("keys", rows * self.kv_heads, self.head_dim)?;
        values.expect("values", rows * self.kv_heads, self.head_dim)?;
        let inputs = x.buf.to_vec(py)?;
        let block = self.block();
        let new = py
            .detach(|| block.project(&inputs, &positions, self.head_dim))
            .map_err(|err| bad(err.to_string()))?;
        queries.fill(py, &new.queries)?;
        keys.fill(py, &new.keys)?;
        values.fill(py, &new.values)
    }

    /// After the cache update: attention of `queries` over the cached `keys`/`values`
    /// (`[rows, kv_heads, positions, head_dim]`, strided views read in place; `mask` None
    /// or uint8 `[rows, 1, 1, positions]`), then the output projection, the feed-forward
    /// and both residual adds onto `x`, written into `out` shaped like `x`.
    #[allow(clippy::too_many_arguments)] // the operands of one attention, named as in MLX
    #[pyo3(signature = (x, queries, keys, values, mask, scale, out))]
    fn finish(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        queries: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        mask: Option<&Bound<'_, PyAny>>,
        scale: f32,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (x, queries, out) = self.finish_operands(x, queries, "queries", out)?;
        let rows = x.rows;
        let (keys, values) = (
            Strided4::get("keys", keys)?,
            Strided4::get("values", values)?,
        );
        let [batch, kv_heads, positions, head_dim] = keys.shape;
        if values.shape != keys.shape
            || (batch, kv_heads, head_dim) != (rows, self.kv_heads, self.head_dim)
        {
            return Err(bad(format!(
                "keys {:?} / values {:?} do not fit {rows} rows of {} heads of {}",
                keys.shape, values.shape, self.kv_heads, self.head_dim
            )));
        }
        let visible = visible_positions(py, mask, rows, positions)?;
        let shape = DecodeShape {
            batch: rows,
            heads: self.heads,
            kv_heads,
            positions,
            head_dim,
            scale,
        };
        let (inputs, query_values) = (x.buf.to_vec(py)?, queries.buf.to_vec(py)?);
        let (cached_keys, cached_values) = (keys.heads(), values.heads());
        let block = self.block();
        let mut result = vec![0.0f32; rows * self.input_norm.cols];
        py.detach(|| {
            let mut attention = vec![0.0f32; query_values.len()];
            compat_kernels::attention_decode(
                &shape,
                &query_values,
                cached_keys,
                cached_values,
                visible.as_deref(),
                &mut attention,
            )?;
            block.finish(&inputs, &attention, &mut result)
        })
        .map_err(|err| bad(err.to_string()))?;
        out.fill(py, &result)
    }

    /// After an attention computed elsewhere (MLX's quantized attention over a quantized
    /// cache): `attention` `[rows, heads, 1, head_dim]`, then the output projection, the
    /// feed-forward and both residual adds onto `x`, written into `out` shaped like `x`.
    fn finish_attended(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        attention: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (x, attention, out) = self.finish_operands(x, attention, "attention", out)?;
        let rows = x.rows;
        let (inputs, attended) = (x.buf.to_vec(py)?, attention.buf.to_vec(py)?);
        let block = self.block();
        let mut result = vec![0.0f32; rows * self.input_norm.cols];
        py.detach(|| block.finish(&inputs, &attended, &mut result))
            .map_err(|err| bad(err.to_string()))?;
        out.fill(py, &result)
    }
}

impl DecodeBlock {
    /// The second call's operands, checked: `x` and `out` `[rows, hidden]`, and per-head
    /// vectors (queries or an attention result) `[rows * heads, head_dim]`.
    fn finish_operands(
        &self,
        x: &Bound<'_, PyAny>,
        per_head: &Bound<'_, PyAny>,
        per_head_name: &str,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<(Matrix, Matrix, Matrix)> {
        let hidden = self.input_norm.cols;
        let (x, out) = (Matrix::get("x", x)?, Matrix::get("out", out)?);
        let rows = x.rows;
        x.expect("x", rows, hidden)?;
        out.expect("out", rows, hidden)?;
        let per_head = Matrix::get(per_head_name, per_head)?;
        per_head.expect(per_head_name, rows * self.heads, self.head_dim)?;
        Ok((x, per_head, out))
    }

    fn block(&self) -> DecoderBlock<'_> {
        DecoderBlock {
            input_norm: RmsNorm {
                weight: self.input_norm.in_place(),
                eps: self.input_eps,
            },
            q: self.q.in_place(),
            k: self.k.in_place(),
            v: self.v.in_place(),
            o: self.o.in_place(),
            rope: self.rope,
            post_norm: RmsNorm {
                weight: self.post_norm.in_place(),
                eps: self.post_eps,
            },
            mlp: SwigluWeights {
                gate: self.gate.in_place(),
                up: self.up.in_place(),
                down: self.down.in_place(),
            },
        }
    }
}

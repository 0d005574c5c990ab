//! pyo3 glue: thin wrappers over compat-core, exposed as `compat_serve._native`.
use pyo3::prelude::*;

mod convert;
mod decode_block;
mod error;
mod grammar;
mod kernels;
mod prefix_cache;
mod scheduler;
mod template;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    error::register(m)?;
    m.add_class::<template::ChatTemplate>()?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<scheduler::StepPlan>()?;
    m.add_class::<prefix_cache::PrefixCache>()?;
    m.add_class::<prefix_cache::Admission>()?;
    m.add_class::<prefix_cache::NewBlock>()?;
    m.add_class::<prefix_cache::PrefixCacheStats>()?;
    m.add_class::<decode_block::DecodeBlock>()?;
    m.add_class::<grammar::TokenTable>()?;
    m.add_class::<grammar::GrammarMatcher>()?;
    m.add_function(wrap_pyfunction!(grammar::fill_masks, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_cache::image_hash, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::matmul_nt, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::swiglu_mlp, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::attention_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::matmul_kernel, m)?)?;
    Ok(())
}

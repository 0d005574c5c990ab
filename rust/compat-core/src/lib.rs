//! Pure-Rust core of compat-serve. Knows nothing of Python.
pub mod error;
pub mod grammar;
pub mod prefix_cache;
pub mod scheduler;
pub mod template;

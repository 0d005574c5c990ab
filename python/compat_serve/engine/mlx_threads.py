"""What MLX keeps per thread, released by the thread itself before it ends.

MLX (0.32) keeps a stream and a compile cache per thread. The cache holds Python objects
(the functions mlx-lm compiles, such as its activations), and C++ frees it in the
thread's `thread_local` destructors, which run after Python has already let `join()`
return. If the process is exiting by then, the destructor asks for the GIL of a
finalizing interpreter, the thread is unwound inside a `noexcept` destructor, and the
process aborts ("terminate called without an active exception", exit 134) after all of
its work is done. MLX's maintainers ask each thread to call `mx.clear_streams()` (it also
empties the compile cache) before it ends, the main thread included (ml-explore/mlx
#3395, #4327).
"""

from __future__ import annotations


def release_thread_mlx() -> None:
    """Free this thread's MLX streams and compile cache; call it last on a thread that
    ran MLX work (its arrays must all be evaluated or dropped). mlx is imported here, not
    at the top: importing this module must not load mlx before models/blas.py has."""
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()

"""A kernel's source for ``triton.compile`` with the specialization the JIT gives a launch's arguments
(shared by the static report, :mod:`.aot`, and the flash comparison, :mod:`.compare`)."""

from __future__ import annotations

from typing import Any


def jit_source(fn: Any, args: list[Any], kwargs: dict[str, Any], arch: int) -> Any:
    """``ASTSource`` of ``fn`` for ``args`` with the specialization the JIT gives them on a launch
    (its own binder: the signature types, integers divisible by 16, aligned pointers, constants 1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    _opts, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)

"""Triton's JIT compiles while a CompileLog is active (bench/gpu_decode.offline reports them; a
compile in the middle of a run is a step that stalls for the compiler)."""
from __future__ import annotations

import time


class CompileLog:
    """Triton's JIT compiles while active (knobs.runtime.jit_post_compile_hook, where this Triton
    has it): [(seconds since entering, kernel name, its specialisation)]. A compile mid-run is a
    step that stalls."""

    def __enter__(self):
        import triton
        self.events: list[tuple[float, str]] = []
        self.runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        self.t0 = time.perf_counter()
        if self.runtime is not None and hasattr(self.runtime, "jit_post_compile_hook"):
            self.prev = prev = self.runtime.jit_post_compile_hook

            def hook(*args, **kwargs):
                if prev is not None:
                    prev(*args, **kwargs)
                fn = kwargs.get("fn")
                comp = kwargs.get("compile") or {}
                spec = comp.get("specialization_data") if isinstance(comp, dict) else None
                self.events.append((round(time.perf_counter() - self.t0, 3), str(getattr(fn, "name", fn)),
                                    str(spec or kwargs.get("key", ""))[:3000]))
                return False
            self.runtime.jit_post_compile_hook = hook
        else:
            self.runtime = None
        return self

    def __exit__(self, *exc):
        if self.runtime is not None:
            self.runtime.jit_post_compile_hook = self.prev
        return False

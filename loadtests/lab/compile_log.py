"""Triton kernel compilations recorded while a benchmark runs, through Triton's JIT hooks: which
kernels missed the in-memory cache, how long each took, and which parameters' specialisation
made a kernel compile again (the cause of a stall inside a serving round)."""

from __future__ import annotations

import time


def _variant_of(compile_info: dict, arg_names: list[str]) -> dict[str, str]:
    """Parameter name -> its specialisation in one compiled variant: the type, '/16' where
    Triton assumed divisibility by 16, '=value' for constants (constexprs and ints equal to 1)."""
    signature = compile_info.get("signature") or {}
    names = list(signature.keys()) if signature else list(arg_names)
    names = [
        n if isinstance(n, str) else (arg_names[n] if n < len(arg_names) else str(n)) for n in names
    ]

    def name_of(key) -> str:
        idx = key[0] if isinstance(key, tuple) and key else key
        if isinstance(idx, int) and idx < len(names):
            return names[idx]
        return str(key)

    out = {name: str(ty) for name, ty in zip(names, signature.values())}
    configs = compile_info.get("configs") or [{}]
    attrs = configs[0] if isinstance(configs, (list, tuple)) and configs else {}
    for key, values in attrs.items() if isinstance(attrs, dict) else ():
        if any("divisibility" in str(a) for a in values):
            out[name_of(key)] = out.get(name_of(key), "") + "/16"
    for key, value in (compile_info.get("constants") or {}).items():
        out[name_of(key)] = out.get(name_of(key), "") + f"={value}"
    return out


class CompileLog:
    """Records Triton kernel compilations while installed, through Triton's JIT hooks
    (`triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook` on current versions,
    `JITFunction.cache_hook` on older ones). A hook call means a kernel variant missed the
    in-memory cache: it was compiled, or loaded from the on-disk cache (then it is fast)."""

    def __init__(self):
        self.events: list[dict] = []  # kernel, seconds (None without a post hook), variant
        self.method = "none"
        self.stage = ""  # what the probe is doing (recorded with each compilation)
        self.errors: list[str] = []  # hook failures (never raised into Triton)
        self._started: dict[str, float] = {}
        self._undo: list = []

    def install(self) -> CompileLog:
        try:
            import triton
        except ImportError:
            self.method = "triton not installed"
            return self
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_cache_hook"):
            prev_pre = runtime.jit_cache_hook
            prev_post = getattr(runtime, "jit_post_compile_hook", None)
            runtime.jit_cache_hook = self._chain(self.on_compile_start, prev_pre)
            if hasattr(runtime, "jit_post_compile_hook"):
                runtime.jit_post_compile_hook = self._chain(self.on_compile_done, prev_post)
            self._undo.append(lambda: setattr(runtime, "jit_cache_hook", prev_pre))
            if hasattr(runtime, "jit_post_compile_hook"):
                self._undo.append(lambda: setattr(runtime, "jit_post_compile_hook", prev_post))
            self.method = "triton.knobs.runtime.jit_cache_hook"
            return self
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            self.method = "no Triton JIT hook found"
            return self
        prev = getattr(JITFunction, "cache_hook", None)
        JITFunction.cache_hook = self._chain(self.on_compile_start, prev)
        self._undo.append(lambda: setattr(JITFunction, "cache_hook", prev))
        self.method = "triton.runtime.jit.JITFunction.cache_hook"
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _chain(self, mine, previous):
        def hook(**kwargs):
            try:
                mine(**kwargs)
            except Exception as e:  # recording must never fail a kernel launch
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
            # a truthy answer would make Triton skip the compilation: only a previous hook's
            return previous(**kwargs) if previous is not None else None

        return hook

    def on_compile_start(self, **kwargs) -> None:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0]
        jit_fn = getattr(fn, "jit_function", None)
        arg_names = list(getattr(jit_fn, "arg_names", []) or [])
        try:
            variant = _variant_of(kwargs.get("compile") or {}, arg_names)
        except (TypeError, ValueError, AttributeError, IndexError):
            variant = {"repr": str(kwargs.get("repr", ""))[:400]}
        key = str(kwargs.get("key"))
        self._started[key] = time.perf_counter()
        self.events.append(
            {"kernel": name, "stage": self.stage, "seconds": None, "key": key, "variant": variant}
        )

    def on_compile_done(self, **kwargs) -> None:
        key = str(kwargs.get("key"))
        t0 = self._started.pop(key, None)
        if t0 is None:
            return
        for ev in reversed(self.events):
            if ev["key"] == key and ev["seconds"] is None:
                ev["seconds"] = round(time.perf_counter() - t0, 4)
                break

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> dict:
        """Compilations after `mark`: count, seconds (known ones), kernel names, and per
        compilation its kernel and specialisation (what a start-up compile missed)."""
        evs = self.events[mark:]
        return {
            "count": len(evs),
            "seconds": round(sum(e["seconds"] or 0.0 for e in evs), 3),
            "kernels": sorted({e["kernel"] for e in evs}),
            "variants": [{"kernel": e["kernel"], **e["variant"]} for e in evs],
        }

    def summary(self) -> list[dict]:
        """Per kernel: variants compiled, seconds, and the parameters whose specialisation
        differs between its variants (what made Triton compile it again)."""
        by_kernel: dict[str, list[dict]] = {}
        for ev in self.events:
            by_kernel.setdefault(ev["kernel"], []).append(ev)
        out = []
        for name, evs in sorted(by_kernel.items(), key=lambda kv: -len(kv[1])):
            variants = [e["variant"] for e in evs]
            params = sorted({p for v in variants for p in v})
            differs = {
                p: sorted({v.get(p, "-") for v in variants})
                for p in params
                if len({v.get(p, "-") for v in variants}) > 1
            }
            out.append(
                {
                    "kernel": name,
                    "variants": len(evs),
                    "seconds": round(sum(e["seconds"] or 0.0 for e in evs), 3),
                    "differs_in": differs,
                }
            )
        return out

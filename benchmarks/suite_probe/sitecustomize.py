"""The suite profile's probe (`benchmarks/suite_profile.py` puts this folder on ``PYTHONPATH``): in every Python
process of the run that imports jax (the pytest workers and every CLI / server / notebook / two-process child), one
line per XLA backend compile, per load from the persistent compilation cache, and per trace / lowering to
``$V41CP_SUITE_PROBE_LOG``, with the test that was running (``PYTEST_CURRENT_TEST``, inherited by the children);
a compile or load line also carries the program's persistent-cache key (the last one jax computed in its thread,
read by wrapping `compilation_cache.get_cache_key`, whose result it returns unchanged), so a run's distinct
programs and the tests that share one can be counted; and one ``runner`` line per `ModelRunner` built (an engine's
layout: the model config's digest, capacity, topology and options), so a run's engine layouts can be counted.
Inactive unless that variable is set; it only listens (`jax.monitoring`, a wrapper around the runner's
constructor), it changes nothing the run computes."""

import os
import sys

_LOG = os.environ.get("V41CP_SUITE_PROBE_LOG")

if _LOG:
    import importlib.abc
    import importlib.machinery

    _EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
               "/jax/core/compile/jaxpr_trace_duration": "trace",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}

    import threading

    _KEY = threading.local()                         # the last persistent-cache key computed in this thread

    def _write(kind: str, name: str, seconds: float) -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        key = f"\t{getattr(_KEY, 'key', '-')}" if kind in ("compile", "hit") else ""
        with open(_LOG, "a") as f:                   # one short line per append: whole lines across processes
            f.write(f"{os.getpid()}\t{kind}\t{name}\t{seconds:.4f}\t{test}{key}\n")

    def _register() -> None:
        from jax import monitoring
        from jax._src import compilation_cache

        inner = compilation_cache.get_cache_key

        def get_cache_key(*args, **kwargs):
            _KEY.key = key = inner(*args, **kwargs)
            return key

        compilation_cache.get_cache_key = get_cache_key

        def on_duration(event, duration, **kw):
            if event in _EVENTS:
                _write(_EVENTS[event], str(kw.get("fun_name", "?")), duration)

        def on_event(event, **kw):
            if event == "/jax/compilation_cache/cache_hits":     # the next "compile" line of this process is a load
                _write("hit", "-", 0.0)

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def _register_runner(module) -> None:
        """One ``runner`` line per `ModelRunner` built (an engine's programs are its runner's): the model config's
        digest and name, capacity, topology and options — the layouts a run's engines use, to find the ones files
        could share."""
        import hashlib

        cls = module.ModelRunner
        inner = cls.__init__

        def __init__(self, params, cfg, capacity, mesh=None, parallel=None, speculative=None, devices=None,
                     record_logits=False, grammars=None):
            inner(self, params, cfg, capacity, mesh=mesh, parallel=parallel, speculative=speculative, devices=devices,
                  record_logits=record_logits, grammars=grammars)
            digest = hashlib.sha1(repr(cfg).encode()).hexdigest()[:8]
            desc = (f"cfg={digest} layers={cfg.num_hidden_layers} cap={capacity!r} parallel={parallel!r} "
                    f"mesh={None if mesh is None else dict(mesh.shape)} spec={speculative!r} "
                    f"record={record_logits} grammars={grammars is not None}")
            _write("runner", desc.replace("\t", " ").replace("\n", " "), 0.0)

        cls.__init__ = __init__

    _HOOKS = {"jax": lambda module: _register(), "v41cp.serving.runner.model_runner": _register_runner}

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, hook):
            self.inner, self.hook = inner, hook

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            self.hook(module)

    class _Finder(importlib.abc.MetaPathFinder):
        """Wraps the first import of ``jax`` (the listeners are registered right after it) and of the model runner
        (its constructor logs each runner's layout); no import here: a process that never imports them pays
        nothing."""

        def find_spec(self, name, path, target=None):
            if name not in _HOOKS or name in _DONE:
                return None
            _DONE.add(name)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, _HOOKS[name])
            return spec

    _DONE: set = set()

    sys.meta_path.insert(0, _Finder())

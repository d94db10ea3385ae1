"""jax's monitoring events that suite_compile_time counts, as its table's columns: shared by the
plugin (pytest workers) and sitecustomize.py (the processes tests start)."""

EVENTS = {"backend_compile_duration": "compile", "jaxpr_trace_duration": "trace",
          "jaxpr_to_mlir_module_duration": "lower"}


def column(event: str):
  """The table column a jax monitoring event adds to, or None."""
  return EVENTS.get(event.rsplit("/", 1)[-1])

"""Full train state -> parameters only, optionally cast (for sampling, evaluation or a new run).

Layout written (and read by `common.load_params`):
  <out>/config.yml     the source run's resolved config, unchanged
  <out>/params/        an orbax StandardCheckpointer folder holding the params tree only
  <out>/convert.json   {"source": run dir, "step": N, "dtype": "float32" | "bfloat16" | "as saved",
                       "checksums": {"params/<name>": 16 hex digits} of the arrays written,
                       "config": the config they were saved with, as a checkpoint saves it: a
                       config.yml edited after in a key of the model is refused on reading}
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp

from nanotext.convert.common import load_run
from nanotext.integrity import checksums
from nanotext.outputs import check_out, staged_dir
from nanotext.errors import UserError
from nanotext.rundir import check_no_glob
from nanotext.trees import cast_checked, path_name

DTYPES = ("float32", "bfloat16")


OWN = ("params", "convert.json", "config.yml")  # what --force may replace: an earlier output


def params_only(run: str, out: str, *, step: int = -1, dtype: str = "", force: bool = False,
                log=print) -> str:
  """Write the params of `run`'s checkpoint (cast to `dtype` if given) as a params-only folder."""
  import orbax.checkpoint as ocp
  if dtype and dtype not in DTYPES:
    raise UserError(f"--dtype={dtype} is not one of {', '.join(DTYPES)}")
  check_no_glob(os.path.abspath(out), "--out")  # orbax writes params/ there
  check_out(os.path.abspath(out), force=force, protect=(run,), own=OWN)
  cfg, step, params = load_run(run, step)
  params = jax.tree.map(jnp.asarray, params)
  if dtype:
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: cast_checked(x, dtype, path_name(p), f"--dtype={dtype}"), params)
  out_abs = os.path.abspath(out)
  with staged_dir(out_abs, force=force, protect=(run,), own=OWN) as tmp:
    shutil.copyfile(os.path.join(run, "config.yml"), os.path.join(tmp, "config.yml"))
    # Synchronous: the async StandardCheckpointer's close() after a failed save (a full disk)
    # raised again before draining its metadata writer, whose thread then wrote into the
    # staged folder while staged_dir removed it (a '.out.tmp-*' left behind, now and then).
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
      ckptr.save(os.path.join(tmp, "params"), ocp.args.StandardSave(params))
    finally:
      ckptr.close()
    with open(os.path.join(tmp, "convert.json"), "w") as f:
      json.dump({"source": os.path.abspath(run), "step": int(step),
                 "dtype": dtype or "as saved", "checksums": checksums({"params": params}),
                 "config": cfg.to_dict()},
                f, indent=2)
  log(f"wrote {out_abs} (params of step {step} of {run}{f', as {dtype}' if dtype else ''})")
  return out_abs

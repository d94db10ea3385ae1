"""Test helper: hold one checkpoint save while its step is still under its temporary name.

`python tests/pause_in_save.py STEP MARKER CONFIG [key=value ...]` runs
`python -m nanotext.train CONFIG [key=value ...]` in this process; the save of STEP writes MARKER
(this pid) and waits, up to ten minutes or until MARKER.go exists, so a test's signal or kill lands
inside a save without polling for it. The production save carries no hook: the data item's
handler is wrapped from here.
"""

import os
import sys
import time


def install(step: int, marker: str) -> None:
  """Wrap the data item's save (written by every process in every step) with the pause."""
  from nanotext import checkpoint
  real = checkpoint.ProcessJsonHandler.save

  def save(self, directory, args):
    real(self, directory, args)
    if not os.path.basename(os.path.dirname(str(directory))).startswith(f"{step}."):
      return
    with open(marker, "w") as f:
      f.write(str(os.getpid()))
    deadline = time.time() + 600  # a loaded machine's test may take minutes to get there
    while not os.path.exists(marker + ".go") and time.time() < deadline:
      time.sleep(0.05)

  checkpoint.ProcessJsonHandler.save = save


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  step, marker, path, *rest = sys.argv[1:]
  install(int(step), marker)
  from nanotext import cli, train
  train.define_flags()
  cli.run(train.main, train.USAGE, train.__doc__, argv=["nanotext.train", path, *rest], jax=True)

"""A signal at a training run's edges: at its start, which writes nothing (the watching thread
stops it, whatever library code the main thread is in), and after its last step (one line,
exit 0: the run is complete and saved)."""

import os
import signal

import pytest

from conftest import BASE, TINY
from nanotext import signals
from test_faults_exit import signalled


TRAIN_SAMPLE = """
import signal, sys, time
from nanotext import train
from nanotext.data import tokenizer
def stuck(*a, **k):  # the end-of-run sample: a decode compiled and run in the main thread
  signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
  open(sys.argv[1], "w").close()
  time.sleep(600)
tokenizer.known_vocab_size = lambda name: 512  # TINY has no tokenizer: it would not sample
tokenizer.get_tokenizer = lambda name: None
train.sample_text = stuck
train.encode_prompt = lambda tokenizer, prompt: [1]
train.cli.run(train.main, train.USAGE, argv=["train", *sys.argv[2:]], jax=True)
"""


def test_a_signal_during_the_end_of_run_sample_skips_it(tmp_path):
  """The run is complete and saved: the sample is extra. A signal there exited 143 (after the
  grace period, with the decode in one call) as if the run had failed."""
  out = tmp_path / "run"
  status, stdout, err = signalled(TRAIN_SAMPLE, [str(tmp_path / "m"), BASE, *TINY,
                                                 f"output_dir={out}", "sample.max_new_tokens=4"],
                                  signal.SIGTERM, tmp_path / "m")
  assert status == 0 and err.strip() == "", err
  assert stdout.splitlines()[-1] == ("received SIGTERM during the end-of-run sample: skipped "
                                     "it; the run is complete, its final checkpoint saved")
  assert sorted(os.listdir(out / "checkpoints")) == ["4"]


TRAIN_PHASES = """
import signal, sys, time
from nanotext import train, wiring
from nanotext.data import pipeline
marker, phase = sys.argv[1], sys.argv[2]
def swallowing(*a, **k):  # the start: library code that swallows what is raised into it
  open(marker, "w").close()
  for _ in range(600):
    try:
      time.sleep(1)
    except BaseException:  # as jax's plugin loader and its gc callback do
      pass
def closing(self):  # the run's end, inside its own signal handling: workers being stopped
  open(marker, "w").close()
  time.sleep(3)
def reporting(*a, **k):  # after the run gave the signals back
  open(marker, "w").close()
  time.sleep(600)
if phase == "start":
  wiring.from_config = swallowing
elif phase == "closing":
  pipeline.TrainIter.close = closing
else:
  train.report = reporting
train.cli.run(train.main, train.USAGE, argv=["train", *sys.argv[3:]], jax=True,
              at_once="stopped by {} before the first step: nothing to save, nothing written")
"""


@pytest.mark.fast
@pytest.mark.parametrize("signum", signals.SIGNALS)  # every signal the tools honour
def test_a_signal_at_the_start_stops_the_run_even_where_libraries_swallow_it(tmp_path, signum):
  """Raised in the main thread during jax's start (its plugin loader, a gc callback), the
  signal was swallowed: the run trained on and exited 0, or said it was a bug."""
  out = tmp_path / "run"
  status, _, err = signalled(TRAIN_PHASES, [str(tmp_path / "m"), "start", BASE, *TINY,
                                            f"output_dir={out}"], signum, tmp_path / "m")
  name = signal.Signals(signum).name
  assert (status, err) == (128 + signum, f"nanotext: error: stopped by {name} before the first "
                           "step: nothing to save, nothing written\n")
  assert not out.exists()


@pytest.mark.parametrize("phase", ["closing", "reporting"])
def test_a_signal_as_the_run_ends_says_the_final_checkpoint_is_saved(tmp_path, phase):
  """While the run closed its workers and saves, a signal was taken with no word (exit 0, no
  line); once it gave the signals back, one would have ended it as a failure."""
  out = tmp_path / "run"
  status, stdout, err = signalled(TRAIN_PHASES, [str(tmp_path / "m"), phase, BASE, *TINY,
                                                 f"output_dir={out}"], signal.SIGTERM,
                                  tmp_path / "m")
  assert (status, err) == (0, ""), err
  assert stdout.splitlines()[-1] == ("received SIGTERM after the last step: the final "
                                     "checkpoint is saved")
  assert sorted(os.listdir(out / "checkpoints")) == ["4"]


READ_ONLY = """
import runpy, sys, time
from nanotext import cli
marker = sys.argv[1]
def swallowing(*a, **k):  # the tool's start, in library code that swallows what is raised into it
  open(marker, "w").close()
  for _ in range(600):
    try:
      time.sleep(1)
    except BaseException:
      pass
cli.parse = swallowing
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.fast
@pytest.mark.parametrize("tool,signum", [("nanotext.verify", signal.SIGINT),
                                         ("nanotext.evaluate", signal.SIGTERM),
                                         ("nanotext.generate", signal.SIGTERM)])
def test_a_tool_that_only_reads_stops_at_once_on_a_signal(tmp_path, tool, signum):
  """verify, evaluate and generate write nothing: a signal ends them where it lands, in one
  line. Raised into the main thread it could land in library code that swallows it (the tool
  went on, or exited 0 as if done)."""
  status, _, err = signalled(READ_ONLY, [str(tmp_path / "m"), tool, str(tmp_path)], signum,
                             tmp_path / "m")
  name = signal.Signals(signum).name
  assert (status, err) == (128 + signum, f"nanotext: error: stopped by {name}; this tool only "
                           "reads, nothing was changed\n")

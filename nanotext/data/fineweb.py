"""Download the pre-tokenized GPT-2 FineWeb-10B `.bin` shards the modded-nanogpt speedrun uses."""

import glob
import logging
import os
import shutil
import time

from absl import flags

from nanotext import fileio
from nanotext.data import binfile
from nanotext.errors import UserError

REPO_ID = "kjj0/fineweb10B-gpt2"  # Hugging Face dataset repo (repo_type='dataset')
DEFAULT_OUT = os.path.join("data", "fineweb10B")  # where configs/speedrun.yml looks
VAL_FILE = "fineweb_val_000000.bin"
# The repo holds fineweb_train_000001.bin ... fineweb_train_000103.bin (numbering starts at 1
# because index 0 is the val shard), 100M tokens (~200 MB) each: the whole ~10.3B-token sample.
MAX_TRAIN_SHARDS = 103
# configs/speedrun.yml trains 1770 steps x 393,216 tokens ~= 696M tokens, i.e. 7 shards; one
# more for headroom (modded-nanogpt's README also suggests 8 for the record).
DEFAULT_TRAIN_SHARDS = 8
# The record's validation loss is measured on the first 10,485,760 tokens (10 x 2^20) of
# fineweb_val_000000.bin, so losses compare with its logs; speedrun.yml's data.val_tokens matches.
VAL_TOKENS = 10_485_760
# Inside out_dir (same file system: the final rename is atomic), named for this tool; a folder of
# that name is deleted when done only where it holds MARK (this tool made it, now or in a run
# that a later one resumes): a user's '.download' in --out, notes and all, was deleted.
TMP_DIR = ".fineweb-download"
MARK = ".made-by-nanotext-fineweb"


def train_file(index: int) -> str:
  """The repo file name of training shard `index` (1-based)."""
  return f"fineweb_train_{index:06d}.bin"


def file_names(train_shards: int) -> list[str]:
  """The val shard, then the first `train_shards` training shards."""
  return [VAL_FILE] + [train_file(i) for i in range(1, train_shards + 1)]


def check_train_shards(train_shards) -> int:
  """`train_shards` as an int in [1, MAX_TRAIN_SHARDS], else UserError."""
  if isinstance(train_shards, bool) or not isinstance(train_shards, int):
    raise UserError(f"--train-shards must be an integer, got {train_shards!r}")
  if not 1 <= train_shards <= MAX_TRAIN_SHARDS:
    raise UserError(
        f"--train-shards must be in [1, {MAX_TRAIN_SHARDS}] (the repo {REPO_ID} has "
        f"{MAX_TRAIN_SHARDS} training shards of 100M tokens), got {train_shards}")
  return train_shards


def hf_fetch(filename: str, tmp_dir: str) -> str:
  """Download `filename` from REPO_ID into tmp_dir with huggingface_hub; returns its path."""
  # Its retries on a failed connection were 22 warnings on stderr, each twice (its own handler
  # and absl's): the download says once what failed. Its modules set their level from this
  # variable as they load (lazily, later); the level below is for a hub loaded already.
  os.environ.setdefault("HF_HUB_VERBOSITY", "error")
  try:  # Lazy: importing this module (and the tests) must not need huggingface_hub.
    import huggingface_hub
    from huggingface_hub import errors
  except ImportError:
    raise UserError("downloading FineWeb needs huggingface_hub: pip install huggingface_hub"
                    ) from None
  where = f"'{filename}' from the Hugging Face dataset {REPO_ID}"
  logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
  try:
    # local_dir keeps one copy (no second one in ~/.cache/huggingface) and lets an
    # interrupted download resume from tmp_dir/.cache on the next run.
    return huggingface_hub.hf_hub_download(REPO_ID, filename, repo_type="dataset",
                                           local_dir=tmp_dir)
  except errors.LocalEntryNotFoundError:  # Before its base class EntryNotFoundError.
    # Its own message is a generic paragraph: name the likely causes instead.
    raise UserError(f"cannot download {where}: the Hub is unreachable (check the network, "
                    "HF_ENDPOINT and HF_HUB_OFFLINE)") from None
  except (errors.EntryNotFoundError, errors.RepositoryNotFoundError,
          errors.RevisionNotFoundError) as e:
    raise UserError(f"cannot download {where}: not found in the repo "
                    f"({type(e).__name__})") from None
  except Exception as e:  # noqa: BLE001 - HTTP, connection, disk: all one failed download.
    raise UserError(f"cannot download {where}: {type(e).__name__}: {e}") from None


def _valid_tokens(path: str) -> int | None:
  """The token count of a valid non-empty shard at `path`, else None."""
  try:
    count = binfile.read_header(path)
  except (UserError, OSError, ValueError):
    return None
  return count if count > 0 else None


def _validate(path: str, filename: str) -> int:
  """The token count of the downloaded shard at `path`; UserError naming `filename` if bad."""
  try:
    count = binfile.read_header(path)
  except (OSError, ValueError) as e:
    raise UserError(f"downloaded '{filename}' cannot be read: {e}") from None
  except UserError as e:
    raise UserError(f"downloaded '{filename}' is not a valid shard: {e}") from None
  if count <= 0:
    raise UserError(f"downloaded '{filename}' is not a valid shard: it holds no tokens")
  return count


def _fetch_one(fetch, filename: str, tmp_dir: str, final: str) -> int:
  """Fetch `filename`, validate it and rename it to `final`; returns its token count."""
  staged = os.path.join(tmp_dir, filename)
  try:
    local = fetch(filename, tmp_dir)
    if os.path.realpath(local) != os.path.realpath(staged):
      # A fetch that returns a file elsewhere (a cache, another disk) keeps it: copy it next to
      # `final` so the rename below stays atomic.
      shutil.copyfile(local, staged)
    count = _validate(staged, filename)
    fileio.replace_synced(staged, final)
  except OSError as e:
    raise UserError(f"cannot download '{filename}' into '{os.path.dirname(final)}': {e}") from None
  finally:
    # Never leave a bad or half-written shard behind, even in the staging folder.
    if os.path.exists(staged):
      os.remove(staged)
  return count


def _mb(nbytes: int) -> str:
  """A byte count in MB, for progress lines."""
  return f"{nbytes / 1e6:,.1f} MB"


def _log(line: str) -> None:
  """Print a progress line now: stdout may be a pipe, and hf's bars go to stderr between."""
  print(line, flush=True)


def download(train_shards: int, out_dir: str | None = None, fetch=None, log=_log) -> dict:
  """Put the val shard and the first `train_shards` train shards in out_dir; skip valid ones.

  `fetch(filename, tmp_dir) -> local_path` downloads one repo file into tmp_dir (default:
  `hf_fetch`; tests pass a local stand-in). Each file is validated before it is renamed to its
  final name, so out_dir only ever holds whole, valid shards. Returns the folder, the shard
  globs, the token counts per split (of every valid shard the globs match: `extra` names the
  training shards beyond those asked for, `invalid` those that are not valid shards) and the
  files downloaded and skipped.
  """
  train_shards = check_train_shards(train_shards)
  out_dir = os.path.abspath(os.path.expanduser(out_dir or DEFAULT_OUT))
  fetch = fetch or hf_fetch
  tmp_dir = os.path.join(out_dir, TMP_DIR)
  if not _ours(tmp_dir):
    raise UserError(f"--out '{out_dir}' holds '{TMP_DIR}', which this tool did not make (it "
                    "stages its downloads in a folder of that name and deletes it when done): "
                    "move it or choose another --out")
  made, missing = [], tmp_dir  # the folders this download makes, innermost first
  while not os.path.lexists(missing):
    made.append(missing)
    missing = os.path.dirname(missing)
  try:
    os.makedirs(tmp_dir, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create '{tmp_dir}' ({e}): choose another --out") from None
  try:
    try:
      with open(os.path.join(tmp_dir, MARK), "a"):
        pass
    except OSError as e:
      raise UserError(f"cannot write in '{tmp_dir}' ({e.strerror}): choose another --out") \
          from None
    return _download_all(train_shards, out_dir, tmp_dir, fetch, log)
  except BaseException:
    if not _resumable(tmp_dir):  # nothing a next run resumes: the folders as they were
      if tmp_dir in made:
        shutil.rmtree(tmp_dir, ignore_errors=True)
      for folder in made[1:]:
        if not _rmdir(folder):
          break
    raise


def _ours(tmp_dir: str) -> bool:
  """Whether the staging folder is absent, empty, or marked as this tool's."""
  if not os.path.lexists(tmp_dir):
    return True
  if os.path.islink(tmp_dir) or not os.path.isdir(tmp_dir):
    return False
  try:
    return os.path.isfile(os.path.join(tmp_dir, MARK)) or not os.listdir(tmp_dir)
  except OSError:  # unreadable: not known to be ours
    return False


def _resumable(tmp_dir: str) -> bool:
  """Whether the staging folder holds part of a download (huggingface_hub's .incomplete)."""
  for folder, _, names in os.walk(tmp_dir):
    for name in names:
      path = os.path.join(folder, name)
      if name.endswith(".incomplete") and os.path.getsize(path) > 0:
        return True
  return False


def _rmdir(folder: str) -> bool:
  try:
    os.rmdir(folder)
    return True
  except OSError:  # not empty: shards downloaded before the failure stay
    return False


def _download_all(train_shards: int, out_dir: str, tmp_dir: str, fetch, log) -> dict:
  """download()'s work, once its folders exist."""
  names = file_names(train_shards)
  tokens = {"train": 0, "val": 0}
  downloaded, skipped = [], []
  start = time.monotonic()
  for i, name in enumerate(names, 1):
    final = os.path.join(out_dir, name)
    prefix = f"[{i}/{len(names)}] {name}"
    count = _valid_tokens(final)
    if count is not None:
      log(f"{prefix}: present, {count:,} tokens, skipped")
      skipped.append(name)
    else:
      if os.path.exists(final):
        log(f"{prefix}: present but not a valid shard, downloading again")
      t0 = time.monotonic()
      count = _fetch_one(fetch, name, tmp_dir, final)
      log(f"{prefix}: {_mb(os.path.getsize(final))}, {count:,} tokens, "
          f"{time.monotonic() - t0:.1f}s")
      downloaded.append(name)
    tokens["val" if name == VAL_FILE else "train"] += count
  # Only after full success: a failed run keeps tmp_dir so huggingface_hub can resume.
  shutil.rmtree(tmp_dir, ignore_errors=True)
  pattern_dir = glob.escape(out_dir)  # a folder named with [ ] * ? is not a pattern
  train_files = os.path.join(pattern_dir, "fineweb_train_*.bin")
  # The glob a config trains on reads every training shard here, not only those asked for now
  # (--train-shards=2 after 5 said 2 shards and trained on 5): its count is what is reported.
  extra, invalid = [], []
  for path in sorted(glob.glob(train_files)):
    name = os.path.basename(path)
    if name not in names:
      count = _valid_tokens(path)
      (extra if count is not None else invalid).append(name)
      tokens["train"] += count or 0
  return {"dir": out_dir, "train_files": train_files,
          "val_files": os.path.join(pattern_dir, "fineweb_val_*.bin"),
          "train_shards": train_shards + len(extra), "train_tokens": tokens["train"],
          "val_tokens": tokens["val"], "downloaded": downloaded, "skipped": skipped,
          "extra": extra, "invalid": invalid, "seconds": time.monotonic() - start}


USAGE = "usage: python -m nanotext.data.fineweb [--train-shards=N] [--out=DIR]"


def main(args) -> None:
  """CLI: download the shards and print a per-split token summary."""
  if args:
    raise UserError(f"unexpected arguments: {' '.join(args)}; {USAGE}")
  info = download(flags.FLAGS.train_shards, flags.FLAGS.out or None)
  for line in summary(info):
    print(line)


def summary(info: dict) -> list[str]:
  """download()'s result as the lines the CLI prints: the tokens the globs read."""
  extra, bad = info["extra"], info["invalid"]
  more = (f": the {info['train_shards'] - len(extra)} asked for and {len(extra)} more already "
          "there, which the glob fineweb_train_*.bin reads too" if extra else "")
  lines = [f"shards in {info['dir']} ({len(info['downloaded'])} downloaded, "
           f"{len(info['skipped'])} already present, {info['seconds']:.1f}s)",
           f"train tokens: {info['train_tokens']:,} ({info['train_shards']} shards{more})"]
  if bad:
    many = len(bad) > 1
    lines.append(f"note: {bad[0]}{f' and {len(bad) - 1} more' if many else ''} in "
                 f"{info['dir']} {'match' if many else 'matches'} the glob fineweb_train_*.bin "
                 f"but {'are not valid shards' if many else 'is not a valid shard'}, which a run "
                 f"refuses: delete {'them' if many else 'it'}, or download "
                 f"{'them' if many else 'it'} again with a larger --train-shards")
  lines.append(f"val tokens:   {info['val_tokens']:,} (the speedrun evaluates the first "
               f"{VAL_TOKENS:,})")
  return lines


if __name__ == "__main__":
  from nanotext import cli
  flags.DEFINE_integer("train_shards", DEFAULT_TRAIN_SHARDS,
                       f"training shards to download, 1..{MAX_TRAIN_SHARDS} (100M tokens, "
                       "~200 MB each); also spelled --train-shards")
  flags.DEFINE_string("out", DEFAULT_OUT, "output folder (configs/speedrun.yml reads "
                      f"{DEFAULT_OUT})")
  cli.run(main, USAGE, __doc__)

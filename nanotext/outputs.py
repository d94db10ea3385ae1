"""An output a tool writes whole or not at all: the checks of --out before any work, and a
staged folder or file that replaces it in one rename when the work is done."""

import contextlib
import errno
import fnmatch
import os
import re
import shutil
import tempfile

from nanotext.errors import ResourceError, UserError, write_error
from nanotext import fileio, probes, rundir, signals


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _shared(path: str) -> None:
  """Files under `path` (or the file) readable as the umask allows: mkstemp's and safetensors'
  private 0600 would outlive the rename."""
  mode = 0o666 & ~_umask()
  for folder, _, names in os.walk(path) if os.path.isdir(path) else [("", None, [path])]:
    for name in names:
      os.chmod(os.path.join(folder, name), mode)


def _empty_dir(path: str) -> bool:
  """`path` is an empty folder, not a link to one (a link at --out is replaced, not its target)."""
  return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _check_target(out: str, force: bool, protect=(), own=None) -> str:
  """`out` checked; `own` (name patterns) is what the tool writes there: --force replaces only
  a folder holding nothing else, or a file of such a name (a git checkout given as --out was
  replaced whole)."""
  out = os.path.abspath(out)
  # What a rename of `out` replaces, its folder's links resolved (a link at `out` itself is
  # replaced, not its target), against every input as named and as it really lies: an input
  # named through a link into --out was deleted with it.
  where = os.path.join(os.path.realpath(os.path.dirname(out)), os.path.basename(out))
  for given in protect:
    named = os.path.abspath(given)
    for p in dict.fromkeys((named, os.path.realpath(given))):
      name = f"'{named}'" + ("" if p == named else f" (a link to '{p}')")
      for o in dict.fromkeys((out, where)):
        if o == p or p.startswith(o + os.sep):
          raise UserError(f"--out '{out}' would replace the input {name}; choose another path")
        if o.startswith(p + os.sep):
          raise UserError(f"--out '{out}' lies inside the input {name}, which would then no "
                          "longer read as it did; choose a path outside it")
  if os.path.dirname(out) == out or os.path.dirname(where) == where:
    raise UserError(f"--out '{out}' is the file system's root; choose a folder under it")
  for o in dict.fromkeys((out, where)):  # a run's own folder: replaced, the run loses it
    if os.path.isdir(o) and (mark := rundir.training_mark(o)):
      raise UserError(f"--out '{out}' is a training run's folder (it holds {mark}), which this "
                      "tool never replaces; choose another path")
    parent = os.path.dirname(o)
    if os.path.basename(o) in rundir.RUN_FILES and os.path.lexists(os.path.join(parent,
                                                                                "config.yml")):
      raise UserError(f"--out '{out}' is the {os.path.basename(o)} of the run '{parent}'; "
                      "choose a path outside it")
  inner = os.path.isdir(out) and force and _run_inside(out)
  if inner:
    raise UserError(f"--out '{out}' holds the training run '{inner[0]}' (it holds {inner[1]}), "
                    "which this tool never replaces; choose another path")
  run = rundir.run_holding(out) or rundir.run_holding(where)
  if run:
    raise UserError(f"--out '{out}' lies inside the checkpoints/ of the run '{run}', which "
                    "would no longer resume; choose a path outside it")
  if os.path.ismount(out):  # a rename can neither replace it nor move it aside (EBUSY)
    raise UserError(f"--out '{out}' is a mount point, which the output cannot replace (it is "
                    f"renamed into place whole); give a new folder inside it, such as "
                    f"'{os.path.join(out, 'out')}'")
  if not _empty_dir(out):
    if own is not None and os.path.lexists(out):
      _check_own(out, own)  # what --force would refuse: said before "pass --force"
    if os.path.lexists(out) and not force:
      raise UserError(f"output '{out}' already exists; choose another path or pass --force "
                      "to replace it")
  # A folder is replaced by renaming it aside (that updates its '..') and deleting its files.
  if os.path.isdir(out) and not os.path.islink(out) and not os.access(out, os.W_OK):
    raise UserError(f"--out '{out}' is read-only or immutable, so it cannot be replaced; make "
                    "it writable (chmod u+w, chattr -i) or choose another path")
  return out


def _check_own(out: str, own) -> None:
  """Refuse to replace what holds anything but names matching `own` (or is no such file)."""
  if os.path.isdir(out) and not os.path.islink(out):
    names = sorted(os.listdir(out))
  else:
    names = [os.path.basename(out)]
  foreign = [n for n in names if not any(fnmatch.fnmatch(n, p) for p in own)]
  if foreign and os.path.islink(out):  # its own name was taken for a file it holds
    raise UserError(f"--out '{out}' is a link (to '{os.readlink(out)}'), which the output "
                    "would replace, not write through: give the path it links to, or another "
                    "path")
  if foreign:
    more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
    raise UserError(f"--out '{out}' holds '{foreign[0]}'{more}, which this tool does not write: "
                    "--force replaces only an earlier output of it; choose another path")


def _run_inside(folder: str):
  """(a training run's folder below `folder`, what marks it), or None: --force would delete it
  with `folder` (links not followed)."""
  for top, dirs, _ in os.walk(folder):
    for d in dirs:
      if mark := rundir.training_mark(os.path.join(top, d)):
        return os.path.join(top, d), mark
  return None


@contextlib.contextmanager
def writing(out: str):
  """Errors while writing `out` as one line: a full disk or a file-size limit is a
  ResourceError (exit 1), a path that cannot be written a UserError (exit 2). Orbax,
  tensorstore and safetensors report OS errors in their own words (errors.write_error)."""
  try:
    yield
  except (UserError, ResourceError):
    raise
  except Exception as e:  # an OSError, or orbax / tensorstore / safetensors naming an errno
    err = write_error(e, f"cannot write '{out}'")
    if err is not None:
      raise err from None
    text = str(e)
    if not re.match(r"[A-Z_]+: ", text):  # not a storage status: a bug, keep its traceback
      raise
    raise ResourceError(f"writing '{out}' failed: {text.splitlines()[0][:200]}") from None


def _make_parent(out: str, parent: str) -> list:
  """Create the folder --out goes into; a file in the way is bad input, not a traceback. The
  folders made, innermost first (a failed write removes them: nothing on disk changed)."""
  made, missing = [], parent
  while missing and not os.path.lexists(missing):
    made.append(missing)
    missing = os.path.dirname(missing)
  try:
    os.makedirs(parent, exist_ok=True)
    return made
  except OSError as e:
    _remove_made(made)  # those made before the one that failed
    if isinstance(e, (FileExistsError, NotADirectoryError)):
      raise UserError(f"--out '{out}': a file stands where its folder '{parent}' would be") \
          from None
    raise UserError(f"--out '{out}': cannot create '{parent}' ({e.strerror})") from None


def _not_a_folder(out: str) -> None:
  if os.path.isdir(out):
    raise UserError(f"output '{os.path.abspath(out)}' is a folder; give a file path such as "
                    "model.safetensors")


def check_out(out: str, *, force: bool, protect=(), folder: bool = True, own=None) -> None:
  """Every check of --out that staged_dir / staged_file make, plus a write probe of its folder,
  made before the conversion reads a checkpoint (minutes, for a large one)."""
  if rundir.kernel_fs(out):
    raise UserError(f"--out '{out}' lies in a kernel file system ({rundir.kernel_fs(out)}): "
                    "choose a path on disk")
  if folder and os.path.isfile(out):
    raise UserError(f"--out '{out}' is a file, and a folder is written there: give a "
                    "folder path")
  if not folder:  # before _check_target, whose "pass --force" could not help
    _not_a_folder(out)
  out = _check_target(out, force, protect, own)
  parent = os.path.dirname(out)
  while not os.path.isdir(parent):
    if os.path.lexists(parent):
      raise UserError(f"--out '{out}': a file stands where its folder '{parent}' would be")
    parent = os.path.dirname(parent)
  probes.writable_dir(os.path.dirname(out), "the folder of --out")


def _remove_made(made: list) -> None:
  """Remove the folders _make_parent made, where they are still empty."""
  for folder in made:
    try:
      os.rmdir(folder)
    except OSError:
      return


@contextlib.contextmanager
def _replacing(out: str):
  """The last rename refused (a mount point, an immutable or read-only `out` that the checks
  before the work missed) as one line: the written output is dropped, `out` left as it was."""
  try:
    yield
  except OSError as e:
    if e.errno not in (errno.EBUSY, errno.EPERM, errno.EACCES, errno.EXDEV):
      raise
    raise UserError(f"--out '{out}' cannot be replaced ({e.strerror}); it is left as it was: "
                    "choose another path") from None


@contextlib.contextmanager
def staged_dir(out: str, *, force: bool, protect=(), own=None):
  """Yield a temporary folder next to `out`; on success it replaces `out` in one rename.

  A failure leaves `out` as it was: a partial conversion never stands where a good one stood.
  """
  if os.path.isfile(out):
    raise UserError(f"--out '{out}' is a file, and a folder is written there: give a "
                    "folder path")
  out = _check_target(out, force, protect, own)
  parent, name = os.path.split(out)
  made = _make_parent(out, parent)
  try:
    with writing(out):
      tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
  except BaseException:
    _remove_made(made)
    raise
  try:
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's private 0700 would outlive the rename
    with writing(out):
      yield tmp
    _shared(tmp)
    fileio.fsync_tree(tmp)
    # A signal between the two renames left no output: the old one aside, the new one removed.
    with signals.held("after --out was written: it is complete"), _replacing(out):
      if os.path.lexists(out) and not _empty_dir(out):
        old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
        try:
          os.replace(out, os.path.join(old, name))  # aside first: rename cannot replace a folder
        except OSError:
          os.rmdir(old)
          raise
        try:
          os.replace(tmp, out)
        except OSError:
          os.replace(os.path.join(old, name), out)
          os.rmdir(old)
          raise
        shutil.rmtree(old, ignore_errors=True)
      else:
        os.replace(tmp, out)
  except BaseException:
    # A failure or a signal at any point before the rename (the body, the chmod walk, a
    # refused rename): the staged output goes, as the folders made for it; a signal after
    # the body left the whole output under a hidden name.
    if os.path.lexists(tmp):  # renamed into place already: nothing staged is left
      fileio.remove_tree(tmp)  # a failed orbax save may still be writing into it
    _remove_made(made)
    raise
  fileio.fsync_path(parent)


@contextlib.contextmanager
def staged_file(out: str, *, force: bool, protect=(), own=None):
  """Yield a temporary file path next to `out`; on success it replaces `out` atomically."""
  probes.plain_file_or_none(out, "--out")
  _not_a_folder(out)
  out = _check_target(out, force, protect, own)
  parent, name = os.path.split(out)
  made = _make_parent(out, parent)
  try:
    with writing(out):
      fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=parent)
  except BaseException:
    _remove_made(made)
    raise
  os.close(fd)
  try:
    with writing(out):
      yield tmp
    _shared(tmp)
    with _replacing(out):
      fileio.replace_synced(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
      _remove_made(made)

"""User-facing errors: one base class for everything a user can cause and fix.

`stream-qa` (and the app) print a user error as one line and exit 2; any other exception is a bug and
keeps its traceback in a log file. The classes here import nothing heavy, so input can be checked
before torch and transformers load. `inf_mllm.loader.AssetError` (a missing or corrupt model file)
counts as a user error too: it lives below `streaming` and cannot subclass `UserError` without
making this module pull in torch, so `is_user_error` recognises it by class once it is loaded.
"""

import errno
import os
import sys

# stream-qa's exit codes, the one list (docs/stream-qa.md names them): 0 done, 1 a bug (traceback in a log
# file), 2 bad input or a fault of this machine, 3 a soak that failed its verdict, 4 a soak too short to tell (its
# verdict INCONCLUSIVE), 130 Ctrl-C, 141 a closed pipe, 128 + n a stopping signal n (checks.STOP_STATUS)
EXIT_OK, EXIT_BUG, EXIT_BAD_INPUT, EXIT_SOAK_FAILED, EXIT_SOAK_INCONCLUSIVE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141


def one_line(err: BaseException | str) -> str:
    """What an error (or a message) says, as the one line every front end shows: its first line, else its type's
    name."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else (type(err).__name__ if isinstance(err, BaseException) else "")


class UserError(ValueError):
    """Bad input or set-up; the message is one line for the user and names what to change."""


class ConfigError(UserError):
    """A configuration value that cannot work (budget, fps, clip length, policy options, device)."""


class UsageError(ConfigError):
    """A command-line choice that cannot work (unknown model or policy, options that do not go together)."""


class OutputError(UserError):
    """stdout cannot take the answers: closed (`>&-`), on a full disk, or failing mid-run."""


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, UserError):
        return True
    loader = sys.modules.get("inf_mllm.loader")  # only raised once loaded, so never imported here
    diskio = sys.modules.get("inf_mllm.diskio")  # FolderBusy: another process writes the folder
    return (loader is not None and isinstance(err, loader.AssetError)) or (
        diskio is not None and isinstance(err, diskio.FolderBusy))


# errors of the machine, not of the program: a full or read-only disk, permissions, a file gone, no descriptors
ENVIRONMENT = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
               errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EMFILE, errno.ENFILE, errno.ENXIO, errno.ESTALE}


def environment_fault(err: BaseException) -> str | None:
    """One line for an error whose cause is this machine's disk or files (the OSError itself, or the one it
    was raised from), else None. ENOENT counts only with a file name: a path that vanished, not a lookup."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in ENVIRONMENT and (err.errno != errno.ENOENT or err.filename):
            where = f" ({err.filename})" if err.filename else ""
            return (f"{err.strerror or os.strerror(err.errno)}{where}: a fault of this machine's disk or files, not of "
                    f"stream-qa or your input; fix it (space, permissions, the path) and run again")
        err = err.__cause__ or err.__context__
    return None

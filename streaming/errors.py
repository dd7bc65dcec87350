"""User-facing errors: one base class for everything a user can cause and fix.

`stream-qa` (and the app) print a user error as one line and exit 2; any other exception is a bug and
keeps its traceback in a log file. The classes here import nothing heavy, so input can be checked
before torch and transformers load. `inf_mllm.loader.AssetError` (a missing or corrupt model file)
counts as a user error too: it lives below `streaming` and cannot subclass `UserError` without
making this module pull in torch, so `is_user_error` recognises it by class once it is loaded.
"""

import sys


class UserError(ValueError):
    """Bad input or set-up; the message is one line for the user and names what to change."""


class ConfigError(UserError):
    """A configuration value that cannot work (budget, fps, clip length, policy options, device)."""


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, UserError):
        return True
    loader = sys.modules.get("inf_mllm.loader")  # only raised once loaded, so never imported here
    return loader is not None and isinstance(err, loader.AssetError)

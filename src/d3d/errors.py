"""The user-facing error types, in a module with no dependencies: the decoding engine and the GPU
check import them on machines that have torch and transformers but no Hydra or OmegaConf."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class UserError(Exception):
    """A problem the user fixes (a path, a file, a folder in use); the message says what and how."""

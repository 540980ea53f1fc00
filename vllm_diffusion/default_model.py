"""Where the embedded models are: the default one used by the README's main job and the
benchmarks, and the tiny one the fast tests and the CI quality test use.

The weights are not part of the wheel. They live in the repository's ``checkpoints/``
directory (``checkpoints/sdar-small-chat``, 12 layers, the default;
``checkpoints/sdar-tiny-chat``, 4 layers), found next to the package in a checkout, or
in the directory named by ``$VLLM_DIFFUSION_CHECKPOINTS`` (looked at first).
"""

from __future__ import annotations

import os
import pathlib

CHECKPOINTS_ENV = "VLLM_DIFFUSION_CHECKPOINTS"
DEFAULT_NAME = "sdar-small-chat"
TINY_NAME = "sdar-tiny-chat"
# A repository checkout: checkpoints/ beside the package directory.
REPOSITORY_CHECKPOINTS = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"


def checkpoint_dirs() -> list[pathlib.Path]:
    """The directories searched for embedded checkpoints, in order."""
    dirs = [REPOSITORY_CHECKPOINTS]
    if os.environ.get(CHECKPOINTS_ENV):
        dirs.insert(0, pathlib.Path(os.environ[CHECKPOINTS_ENV]).expanduser())
    return dirs


def has_weights(checkpoint: pathlib.Path) -> bool:
    return (checkpoint / "model.safetensors").is_file()


def embedded_checkpoint(name: str) -> pathlib.Path:
    """The checkpoint ``name`` in the first searched directory that holds it (the
    repository's path when none does, so that a missing one is named where expected)."""
    for directory in checkpoint_dirs():
        if has_weights(directory / name):
            return directory / name
    return REPOSITORY_CHECKPOINTS / name


DEFAULT_CHECKPOINT = embedded_checkpoint(DEFAULT_NAME)
TINY_CHECKPOINT = embedded_checkpoint(TINY_NAME)


def default_model_path() -> pathlib.Path:
    """The default model (the tiny one where only it is present); raises
    ``FileNotFoundError`` saying where it looked and how to provide the weights."""
    dirs = checkpoint_dirs()
    for name in (DEFAULT_NAME, TINY_NAME):
        for directory in dirs:
            if has_weights(directory / name):
                return directory / name
    looked = ", ".join(str(d) for d in dirs)
    raise FileNotFoundError(
        f"no embedded model ({DEFAULT_NAME} or {TINY_NAME} with a model.safetensors) in "
        f"{looked}. The weights are not part of the vllm-diffusion wheel: run from a "
        f"clone of the repository (its checkpoints/ directory), set {CHECKPOINTS_ENV} to "
        f"a directory holding {DEFAULT_NAME}/, or pass a model path explicitly.")

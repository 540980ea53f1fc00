"""Where the models are: the default one, SmolLM2-135M-Instruct converted to block
diffusion (built by ``tools/build_smollm2.py --converted`` into ``$VLLM_DIFFUSION_CACHE``,
else ``~/.cache/vllm-diffusion``; README, "The default model"), and the embedded ones the
tests use (the repository's ``checkpoints/``, or ``$VLLM_DIFFUSION_CHECKPOINTS`` first).
"""

from __future__ import annotations

import os
import pathlib

CACHE_ENV = "VLLM_DIFFUSION_CACHE"
CONVERTED_NAME = "smollm2-135m-dllm"
CHECKPOINTS_ENV = "VLLM_DIFFUSION_CHECKPOINTS"
EMBEDDED_NAME = "sdar-small-chat"
TINY_NAME = "sdar-tiny-chat"
# A repository checkout: checkpoints/ beside the package directory.
REPOSITORY_CHECKPOINTS = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
BUILD_COMMAND = "python tools/build_smollm2.py --converted"


def cache_dir() -> pathlib.Path:
    """Where built checkpoints live (never inside the repository)."""
    root = os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "vllm-diffusion"
    return pathlib.Path(root).expanduser()


def converted_model_dir() -> pathlib.Path:
    return cache_dir() / CONVERTED_NAME


def default_model_path() -> pathlib.Path:
    """The converted SmolLM2 (built); raises ``FileNotFoundError`` saying how to build it."""
    path = converted_model_dir()
    if has_weights(path):
        return path
    raise FileNotFoundError(
        f"the default model is not built: no model.safetensors in {path}. Build it with "
        f"`{BUILD_COMMAND}` from a clone of the repository (tools/setup_env.sh does), set "
        f"{CACHE_ENV} to the cache directory that holds {CONVERTED_NAME}/, or pass a model "
        f"path explicitly.")


def checkpoint_dirs() -> list[pathlib.Path]:
    """The directories searched for embedded checkpoints, in order."""
    dirs = [REPOSITORY_CHECKPOINTS]
    if os.environ.get(CHECKPOINTS_ENV):
        dirs.insert(0, pathlib.Path(os.environ[CHECKPOINTS_ENV]).expanduser())
    return dirs


def has_weights(checkpoint: pathlib.Path) -> bool:
    return (checkpoint / "model.safetensors").is_file()


def embedded_checkpoint(name: str) -> pathlib.Path:
    """The checkpoint ``name`` in the first searched directory that holds it (else the
    repository's path, where a missing one is named)."""
    for directory in checkpoint_dirs():
        if has_weights(directory / name):
            return directory / name
    return REPOSITORY_CHECKPOINTS / name


EMBEDDED_CHECKPOINT = embedded_checkpoint(EMBEDDED_NAME)
TINY_CHECKPOINT = embedded_checkpoint(TINY_NAME)


def embedded_model_path() -> pathlib.Path:
    """The embedded SDAR model (the tiny one where only it is present); raises
    ``FileNotFoundError`` saying where it looked and how to provide the weights."""
    for name in (EMBEDDED_NAME, TINY_NAME):
        if has_weights(path := embedded_checkpoint(name)):
            return path
    looked = ", ".join(str(d) for d in checkpoint_dirs())
    raise FileNotFoundError(
        f"no embedded model ({EMBEDDED_NAME} or {TINY_NAME} with a model.safetensors) in "
        f"{looked}. The weights are not part of the vllm-diffusion wheel: run from a "
        f"clone of the repository (its checkpoints/ directory), set {CHECKPOINTS_ENV} to "
        f"a directory holding {EMBEDDED_NAME}/, or pass a model path explicitly.")

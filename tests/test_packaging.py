"""The serving package stays a serving package: its wheel holds serving code only, the
repository stays small, the package's layers import only what they may, and the embedded
models are found outside the package (or a clear error says where to put them)."""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from vllm_diffusion import default_model

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_diffusion"
# The GPU machine takes at most 64 MiB of working tree per call (the project's limit is 60
# for what git tracks); the embedded checkpoints (the SDAR model, the tiny one, the
# LLaDA-format one: 50 MB) and the default model's adapter (5.5 MiB) are most of it.
MAX_TRACKED_MIB = 60
# What a source copy for the wheel build leaves out (build outputs and environments).
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".hypothesis", "results")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    """The file names in a wheel built from a copy of the source tree (so stale build
    outputs of the checkout cannot leak in), with this environment's pip and setuptools."""
    pytest.importorskip("setuptools", reason="the wheel is built without build isolation")
    source = tmp_path_factory.mktemp("source") / "repo"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("vllm_diffusion-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.mark.wheel
def test_wheel_holds_serving_code_only(wheel_names):
    code = [n for n in wheel_names if ".dist-info/" not in n]
    assert not [n for n in wheel_names if n.endswith(".safetensors")]
    assert {n.split("/")[0] for n in code} == {"vllm_diffusion"}, "only the serving package"
    for left_out in ("/quality/", "/testing/", "/fixtures/", "/checkpoints/", "offline.py",
                     "recording.py", "vllm_diffusion_lab"):
        assert not [n for n in code if left_out in n], left_out
    for part in ("kernels", "policies", "seams", "step", "models", "attention", "worker"):
        assert f"vllm_diffusion/{part}/__init__.py" in code, part
    for module in ("__init__.py", "default_model.py", "engine_setup.py", "policies/base.py",
                   "worker/runner.py"):
        assert f"vllm_diffusion/{module}" in code, module
    assert any(n.endswith(".dist-info/entry_points.txt") for n in wheel_names)


def tracked_files() -> list[pathlib.Path]:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: no tracked files to measure")
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=False)
    if listing.returncode != 0:
        pytest.skip(f"git ls-files failed: {listing.stderr.decode(errors='replace').strip()}")
    return [REPO / name for name in listing.stdout.decode().split("\0") if name]


def test_tracked_files_stay_small():
    sizes = {path: path.stat().st_size for path in tracked_files() if path.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= MAX_TRACKED_MIB * 2**20, (
        f"tracked files total {total / 2**20:.1f} MiB (limit {MAX_TRACKED_MIB}); largest: "
        + ", ".join(f"{p.relative_to(REPO)} {sizes[p] / 2**20:.1f} MiB" for p in largest))


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module a source file imports (anywhere in it), relative imports resolved;
    ``from X import name`` also yields ``X.name`` (it may be a submodule)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    elif package.endswith(".__init__"):
        package = package[:-len(".__init__")]
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            modules.append(base)
            modules += [f"{base}.{alias.name}" for alias in node.names]
    return modules


def sources(*parts: str) -> list[pathlib.Path]:
    return sorted(PACKAGE.joinpath(*parts).rglob("*.py"))


def violations(files: list[pathlib.Path], forbidden) -> list[str]:
    return [f"{path.relative_to(REPO)} imports {module}" for path in files
            for module in imported_modules(path) if forbidden(module)]


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_serving_package_imports_neither_the_lab_nor_its_own_root():
    modules = [p for p in sources() if p != PACKAGE / "__init__.py"]
    assert violations(sources(), lambda m: under(m, "vllm_diffusion_lab")) == []
    # ``from vllm_diffusion import x`` / ``import vllm_diffusion`` (relative forms too) load
    # the package root, register() and everything it imports; name the submodule instead.
    assert violations(modules, lambda m: m == "vllm_diffusion") == []


def test_layers_import_only_downwards():
    assert violations(sources("policies") + sources("models") + sources("attention"),
                      lambda m: under(m, "vllm_diffusion.worker")) == []
    assert violations(sources("models") + sources("attention"),
                      lambda m: under(m, "vllm_diffusion.policies")) == []


# What the API server imports: it resolves the engine's options and checks requests.
FRONT_END = [PACKAGE / name for name in ("config.py", "requests.py", "request_limits.py",
                                         "engine_setup.py", "metrics.py", "options.py")
             ] + sources("seams")


def test_the_front_end_imports_nothing_from_the_worker():
    assert violations(FRONT_END, lambda m: under(m, "vllm_diffusion.worker")) == []
    # policies are looked up by name (``policies.POLICIES``), their modules imported only
    # for the policy served
    registry = ("vllm_diffusion.policies", "vllm_diffusion.policies.POLICIES")
    assert violations(FRONT_END, lambda m: under(m, "vllm_diffusion.policies")
                      and m not in registry) == []


FRONT_END_IMPORTS = """
import json, sys
import vllm_diffusion
vllm_diffusion.register()
import vllm_diffusion.config, vllm_diffusion.engine_setup, vllm_diffusion.requests
from vllm_diffusion.seams import (async_llm, engine_args, input_processor, offline_llm,
                                  openai_serving, output_processor, stat_loggers)
from vllm_diffusion.config import parse_engine_options
from vllm_diffusion.policies import POLICIES

loaded = lambda: sorted(m for m in sys.modules if m.startswith("vllm_diffusion."))
before = loaded()
parse_engine_options({"diffusion_policy": sys.argv[1]}, config_block_size=8,
                     config_mask_token_id=3, vocab_size=100)
print(json.dumps({"before": before, "after": loaded(),
                  "policies": {name: POLICIES.module_of(name) for name in POLICIES}}))
"""


@pytest.mark.parametrize("served", ["standard", "focus"])
def test_the_front_end_loads_the_served_policy_only(served):
    """In a fresh process, as the API server: the plugin's front end loads no worker
    module, no policy and no kernel; resolving the engine's options loads the served
    policy and no other."""
    run = subprocess.run([sys.executable, "-c", FRONT_END_IMPORTS, served], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    policy_modules = found["policies"]
    for layer in ("vllm_diffusion.worker", "vllm_diffusion.kernels",
                  "vllm_diffusion.attention", *policy_modules.values()):
        assert not [m for m in found["before"] if under(m, layer)], layer
    others = [module for name, module in policy_modules.items() if name != served]
    assert policy_modules[served] in found["after"]
    assert not [m for m in found["after"] if under(m, "vllm_diffusion.worker")
                or any(under(m, other) for other in others)]


def test_kernels_and_step_do_not_import_vllm():
    assert violations(sources("kernels") + sources("step"), lambda m: under(m, "vllm")) == []


def test_embedded_model_is_found_in_the_checkout_or_the_named_directory(tmp_path,
                                                                         monkeypatch):
    monkeypatch.delenv(default_model.CHECKPOINTS_ENV, raising=False)
    assert default_model.embedded_model_path() == REPO / "checkpoints" / "sdar-small-chat"
    named = tmp_path / "sdar-small-chat"
    named.mkdir()
    (named / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv(default_model.CHECKPOINTS_ENV, str(tmp_path))
    assert default_model.embedded_model_path() == named


def test_default_model_is_the_built_conversion_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tools/build_smollm2.py --converted"):
        default_model.default_model_path()
    built = tmp_path / default_model.CONVERTED_NAME
    built.mkdir()
    (built / "model.safetensors").write_bytes(b"")
    assert default_model.default_model_path() == built


def test_missing_embedded_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "REPOSITORY_CHECKPOINTS", tmp_path / "checkpoints")
    monkeypatch.setenv(default_model.CHECKPOINTS_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError) as error:
        default_model.embedded_model_path()
    message = str(error.value)
    assert str(tmp_path / "checkpoints") in message and str(tmp_path / "elsewhere") in message
    assert default_model.CHECKPOINTS_ENV in message

"""mamba-ssm from its unpacked source in third_party/ (scripts/peers/fetch_mamba_ssm.sh): the
build of its CUDA extensions that scripts/gpu_check.py starts in the background, and the import
of its modules in a process that times them beside ssm (``load``).

mamba-ssm's ``__init__`` imports the compiled ``selective_scan_cuda`` and every model module
(which import huggingface_hub and transformers), so ``load`` registers the package without
running it, puts a stub under the name of each extension that is not built, and stubs the
hub libraries where they are not installed: the Triton kernels import without any build. On
the CPU, in Triton's interpreter, it also makes the kernels' CUDA-only host code run there
(``interpreter_shims``), enough for the SSD kernels and the Mamba2 module, not for Mamba-3's
(bfloat16 arithmetic and tensor descriptors, which the interpreter gets wrong)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

from .common import ROOT

THIRD_PARTY = Path(os.environ.get("SSM_THIRD_PARTY", ROOT / "third_party"))  # where the fetch script put them
SOURCE = THIRD_PARTY / "mamba-ssm"
CONV_SOURCE = THIRD_PARTY / "causal-conv1d"
NINJA = THIRD_PARTY / "bin"  # a ninja binary for machines without one (the build is serial without it)
# extension module -> the source folder that ``setup.py build_ext --inplace`` leaves it in
EXTENSIONS = {"selective_scan_cuda": SOURCE, "causal_conv1d_cuda": CONV_SOURCE}
PATCH_MARK = "patched by ssm's scripts/peers/fetch_mamba_ssm.sh"


def shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def built(extension: str) -> bool:
    """Whether ``extension``'s shared library lies in its source folder."""
    return any(EXTENSIONS[extension].glob(f"{extension}*.so"))


def source_problem() -> str | None:
    """Why the peer cannot be loaded from third_party/ (None when it can)."""
    if not (SOURCE / "mamba_ssm" / "__init__.py").exists():
        return f"no {shown(SOURCE)} (run scripts/peers/fetch_mamba_ssm.sh; carry third_party to a GPU machine)"
    return None


# ----------------------------------------------------------------------------- the build


def build_env(env: dict, capability: tuple[int, int] | None) -> dict:
    """The environment of the CUDA build: one gencode target (the device's, via the patched
    setup.py's PEER_GENCODE), forced source builds (no wheel download), MAX_JOBS = the cores,
    and third_party/bin on PATH where the machine has no ninja."""
    major, minor = capability or (9, 0)
    arch = f"{major}{minor}"
    env = env | {
        "PEER_GENCODE": f"arch=compute_{arch},code=sm_{arch}",
        "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}",
        "MAMBA_FORCE_BUILD": "TRUE",
        "CAUSAL_CONV1D_FORCE_BUILD": "TRUE",
        "MAX_JOBS": str(os.cpu_count() or 1),
    }
    if shutil.which("ninja", path=env.get("PATH")) is None and (NINJA / "ninja").exists():
        env["PATH"] = f"{NINJA}{os.pathsep}{env.get('PATH', '')}"
    return env


def build_problem(source: Path) -> str | None:
    """Why ``source`` cannot be built here (None when it can be tried)."""
    if not (source / "setup.py").exists():
        return f"no {shown(source)}"
    if PATCH_MARK not in (source / "setup.py").read_text():
        return f"{shown(source)}/setup.py is not patched for one architecture (rerun the fetch script)"
    return None


def start_builds(
    log_dir: Path, env: dict, capability: tuple[int, int] | None, extensions=tuple(EXTENSIONS)
) -> dict[str, dict]:
    """Start ``python setup.py build_ext --inplace`` of each of ``extensions`` not built yet, in
    the background, each logging to log_dir/build-NAME.log: {extension: {"process", "log"} or
    {"skipped": why}}."""
    started = {}
    env = build_env(env, capability)
    for extension, source in EXTENSIONS.items():
        problem = build_problem(source)
        if extension not in extensions:
            started[extension] = {"skipped": "not asked for"}
        elif built(extension):
            started[extension] = {"skipped": "already built"}
        elif problem:
            started[extension] = {"skipped": problem}
        else:
            log = log_dir / f"build-{extension}.log"
            with open(log, "w") as f:
                cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
                settings = f"PEER_GENCODE={env['PEER_GENCODE']} MAX_JOBS={env['MAX_JOBS']} PATH={env.get('PATH')}"
                f.write(f"$ cd {source} && {' '.join(cmd)}  # {settings}\n")
                f.flush()
                # niced: the foreground steps (Triton compiles, the tests) keep the CPUs; in the window of
                # 2026-11-27 the un-niced build took the 16 cores and the tests ran out of their time
                process = subprocess.Popen(
                    cmd, cwd=source, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                    preexec_fn=lambda: os.nice(15),
                )  # fmt: skip
            started[extension] = {"process": process, "log": log}
    return started


# ----------------------------------------------------------------------------- the import


class Stub(types.ModuleType):
    """A module that stands for one not built or not installed: any attribute is a stand-in
    class (so that ``class X(Missing)`` and ``from stub import name`` work) that fails when
    called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.__name__

        class Missing:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(f"{module}.{name} is a stub: {module} is not built or not installed")

        Missing.__name__ = name
        return Missing


def stub(name: str) -> Stub:
    module = Stub(name)
    module.__path__ = []  # a package, so that its submodules can be stubbed as well
    sys.modules[name] = module
    return module


def interpreter_shims() -> None:
    """What the peer's host code needs on the CPU under TRITON_INTERPRET=1: torch.cuda.device
    as a no-op, device properties to size grids with, and its autotuned kernels cut to their
    first configuration (the interpreter has no benchmarker to choose with)."""
    import torch

    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        multi_processor_count=4, name="Triton interpreter", major=9, minor=0
    )


def plain_approximations() -> None:
    """Mamba-3's kernels call PTX approximations (cos.approx.f32 and the like, inline assembly)
    that the interpreter cannot run: the loaded modules get Triton's own functions instead
    (``_approximations``), so that the peer's forward runs there (its argument checks, its shapes)."""
    plain = _approximations()
    for name, module in list(sys.modules.items()):
        if name.startswith("mamba_ssm.ops.triton.mamba3") and module is not None:
            for function, replacement in plain.items():
                if function in vars(module):
                    setattr(module, function, replacement)


def _approximations() -> dict:
    import triton

    global tl  # jit functions find triton.language among their module's globals, in the interpreter too
    import triton.language as tl

    @triton.jit
    def cos(x):
        return tl.cos(x)

    @triton.jit
    def sin(x):
        return tl.sin(x)

    @triton.jit
    def tanh(x):
        return 2 * tl.sigmoid(2 * x) - 1

    @triton.jit
    def sech2(x):
        t = 2 * tl.sigmoid(2 * x) - 1
        return 1 - t * t

    @triton.jit
    def sigmoid(x):
        return tl.sigmoid(x)

    return {"cos_approx": cos, "sin_approx": sin, "tanh_approx": tanh, "sech2_approx": sech2, "sigmoid_approx": sigmoid}


def cut_autotuners(shard: tuple[int, int] | None = None) -> int:
    """Cut each autotuned kernel of the loaded peer modules: to its first configuration (the
    interpreter), or with ``shard`` = (i, k) to its configurations i, i + k, i + 2k, ... (its
    first where that leaves none). k processes, one per shard, compile all of a kernel's
    configurations between them into Triton's cache on disk, each a k-th, where one process
    would compile them one after another; a later process autotunes over them all, as the peer
    does, from that cache. The number of kernels cut."""
    from triton.runtime.autotuner import Autotuner

    cut = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("mamba_ssm.") and module is not None:
            for value in vars(module).values():
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    kept = value.configs[:1] if shard is None else value.configs[shard[0] :: shard[1]]
                    value.configs, cut = kept or value.configs[:1], cut + 1
    return cut


MODULES = {  # what the peer cases use, by short name
    "selective": "mamba_ssm.ops.selective_scan_interface",
    "ssd": "mamba_ssm.ops.triton.ssd_combined",
    "mamba3": "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined",
    "mamba2": "mamba_ssm.modules.mamba2",
    "models": "mamba_ssm.models.mixer_seq_simple",
    "config": "mamba_ssm.models.config_mamba",
}


def load(interpreting: bool, shard: tuple[int, int] | None = None) -> types.SimpleNamespace:
    """Import the peer's modules from third_party/mamba-ssm in this process: a namespace of
    those modules (``MODULES``' names, None where the import failed) with ``built`` (extension ->
    bool), ``stubs`` (the module names stubbed) and ``errors`` (short name -> why). ``shard``:
    its autotuned kernels keep only that shard of their configurations (see cut_autotuners), for
    a process that only compiles."""
    problem = source_problem()
    if problem:
        raise FileNotFoundError(problem)
    stubs, errors, extensions = [], {}, {}
    for extension, source in EXTENSIONS.items():
        extensions[extension] = built(extension)
        if extensions[extension]:
            sys.path.insert(0, str(source))  # the extension, and causal-conv1d's package beside it
            try:
                importlib.import_module(extension)
            except ImportError as e:  # built, but not loadable here (another torch, another CUDA)
                extensions[extension], errors[extension] = False, f"{type(e).__name__}: {e}"
    if not extensions["selective_scan_cuda"]:
        stub("selective_scan_cuda")
        stubs.append("selective_scan_cuda")
    for name, parts in (("huggingface_hub", ()), ("transformers", ("utils", "utils.hub", "generation"))):
        try:
            importlib.import_module(name)
        except ImportError:
            for module in (name, *(f"{name}.{p}" for p in parts)):
                stub(module)
                stubs.append(module)
    if "transformers.utils" in stubs:
        sys.modules["transformers.utils"].WEIGHTS_NAME = "pytorch_model.bin"
        sys.modules["transformers.utils"].CONFIG_NAME = "config.json"
    package = types.ModuleType("mamba_ssm")  # the package without its __init__ (which imports it all)
    package.__path__ = [str(SOURCE / "mamba_ssm")]
    package.__version__ = (SOURCE / "PKG-INFO").read_text().split("\nVersion: ")[1].split()[0]
    sys.modules["mamba_ssm"] = package
    if interpreting:
        interpreter_shims()
    loaded = {}
    for short, module in MODULES.items():
        try:
            loaded[short] = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a peer module that fails to import is reported, not fatal
            loaded[short], errors[short] = None, f"{type(e).__name__}: {e}"
    if interpreting:
        cut_autotuners()
        plain_approximations()
    elif shard is not None:
        cut_autotuners(shard)
    return types.SimpleNamespace(**loaded, version=package.__version__, built=extensions, stubs=stubs, errors=errors)

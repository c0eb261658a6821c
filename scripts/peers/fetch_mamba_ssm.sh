#!/usr/bin/env bash
# Fetch mamba-ssm's source, the GPU peer that scripts/gpu_check.py times ssm against (issue 44),
# and causal-conv1d's, which its Mamba2 module's fused training path needs. Optional: nothing in
# the tests or the library needs them.
#
#   bash scripts/peers/fetch_mamba_ssm.sh        # into third_party/ (git-ignored)
#
# Leaves, unpacked from the package index's source archives (nothing is built here):
#   third_party/mamba-ssm       mamba-ssm $MAMBA_SSM_VERSION (its Triton kernels run as they are;
#                               selective_scan_cuda, 9 .cu files, is built on the GPU machine)
#   third_party/causal-conv1d   causal-conv1d $CAUSAL_CONV1D_VERSION (3 .cu files)
#   third_party/bin/ninja       ninja from its wheel, for a parallel build where the GPU machine
#                               has none (torch's extension build is serial without it)
# The device tool's `carry: ["third_party"]` takes them to the GPU machine, which has no network.
#
# A plain `pip download` builds the package's metadata in an isolated environment and pulls a
# CUDA torch; *_SKIP_CUDA_BUILD with --no-build-isolation only reads setup.py. Both setup.py files
# are patched: under CUDA 13 they append gencode flags for nine architectures (sm_75 .. sm_121)
# whatever TORCH_CUDA_ARCH_LIST says, so the build is cut to one, $PEER_GENCODE at build time
# (default sm_90, the H100's and H200's); and wheel's bdist_wheel, which only a wheel build uses,
# falls back to setuptools' so that `setup.py build_ext --inplace` runs where wheel is missing.
# Idempotent: what is already there at the right version is kept, and a patched file stays as is.
set -euo pipefail

MAMBA_SSM_VERSION="${MAMBA_SSM_VERSION:-2.3.2.post1}"
CAUSAL_CONV1D_VERSION="${CAUSAL_CONV1D_VERSION:-1.7.0}"
NINJA_VERSION="${NINJA_VERSION:-1.13.2}"
DEST="${1:-third_party}"
# reading mamba-ssm's setup.py imports torch: the project's environment (make .venv/.installed-test)
# where there is one, else python3
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "fetch_mamba_ssm.sh: $PYTHON cannot import torch, which reading mamba-ssm's setup.py needs;" \
        "run 'make .venv/.installed-test' first, or set PYTHON to a python with torch" >&2
    exit 1
fi

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# fetch NAME VERSION FOLDER SKIP_VARIABLE: the sdist of NAME==VERSION, unpacked into $DEST/FOLDER
fetch() {
    local name="$1" version="$2" folder="$3" skip="$4"
    if grep -qx "Version: $version" "$DEST/$folder/PKG-INFO" 2>/dev/null; then
        echo "$name $version: already in $DEST/$folder"
        return
    fi
    # reading setup.py imports wheel at its top; a python without it (this machine's python3 on
    # 2026-11-27) gets it for the download only, in $tmp
    if ! "$PYTHON" -c "import wheel" 2>/dev/null && [ ! -d "$tmp/wheel" ]; then
        "$PYTHON" -m pip install --quiet --target "$tmp/wheel" wheel
    fi
    env "$skip=TRUE" PYTHONPATH="$tmp/wheel${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pip download --quiet --no-deps \
        --no-build-isolation --no-binary :all: "$name==$version" -d "$tmp/$folder"
    tar -xzf "$tmp/$folder"/*.tar.gz -C "$tmp/$folder"
    rm -rf "${DEST:?}/$folder"
    mv "$tmp/$folder"/*/ "$DEST/$folder"
    echo "$name $version: unpacked into $DEST/$folder"
}

# patch SETUP_PY: one gencode target, and bdist_wheel without the wheel package
patch_setup() {
    "$PYTHON" - "$1" <<'EOF'
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
MARK = "# patched by ssm's scripts/peers/fetch_mamba_ssm.sh"
if MARK in text:
    print(f"{path}: already patched")
    sys.exit(0)
wheel = "from wheel.bdist_wheel import bdist_wheel as _bdist_wheel\n"
anchor = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
if text.count(wheel) != 1 or text.count(anchor) != 1 or "cc_flag" not in text:
    sys.exit(f"{path}: not the setup.py this patch knows (no single bdist_wheel import / HACK line)")
text = text.replace(
    wheel,
    f"try:  {MARK}\n    {wheel}except ImportError:\n"
    "    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel\n",
)
text = text.replace(
    anchor,
    f"    if not HIP_BUILD:  {MARK}: one architecture, not nine\n"
    '        cc_flag = ["-gencode", os.environ.get("PEER_GENCODE", "arch=compute_90,code=sm_90")]\n\n' + anchor,
)
path.write_text(text)
print(f"{path}: patched (gencode from $PEER_GENCODE, default sm_90; bdist_wheel fallback)")
EOF
}

fetch mamba-ssm "$MAMBA_SSM_VERSION" mamba-ssm MAMBA_SKIP_CUDA_BUILD
fetch causal-conv1d "$CAUSAL_CONV1D_VERSION" causal-conv1d CAUSAL_CONV1D_SKIP_CUDA_BUILD
patch_setup "$DEST/mamba-ssm/setup.py"
patch_setup "$DEST/causal-conv1d/setup.py"

have="$("$DEST/bin/ninja" --version 2>/dev/null || true)"  # e.g. 1.13.2.git.kitware.jobserver-pipe-1
if [ "${have#"$NINJA_VERSION"}" != "$have" ]; then
    echo "ninja $NINJA_VERSION: already in $DEST/bin"
else
    "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: "ninja==$NINJA_VERSION" -d "$tmp/ninja"
    "$PYTHON" -m zipfile -e "$tmp"/ninja/ninja-*.whl "$tmp/ninja/wheel"
    mkdir -p "$DEST/bin"
    install -m 755 "$tmp"/ninja/wheel/ninja-*.data/scripts/ninja "$DEST/bin/ninja"
    echo "ninja $("$DEST/bin/ninja" --version): installed as $DEST/bin/ninja"
fi
du -sh "$DEST/mamba-ssm" "$DEST/causal-conv1d" "$DEST/bin"

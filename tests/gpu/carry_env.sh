# Sourced by the GPU scripts (run from the repository root): `carry_env CARRY WORK` unpacks the
# xz-compressed libraries of the package made by tests/gpu/build_carry.sh into WORK/lib and puts
# them, the package's other libraries and the CUDA toolkit's first on the library path. Tests that
# read repository files (recipes, the bundled data) find them here, not at the path the binaries
# were built under. Returns non-zero when a library cannot be unpacked.
carry_env() {
  local carry="$1" work="$2" f name
  mkdir -p "$work/lib"
  for f in "$carry"/lib/*.xz; do
    [[ -e "$f" ]] || continue
    name="$(basename "${f%.xz}")"
    if command -v xz >/dev/null; then
      xz -dc "$f" >"$work/lib/$name"
    else
      python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst: shutil.copyfileobj(src, dst)' \
        "$f" "$work/lib/$name"
    fi || {
      echo "carry_env: cannot unpack $f" >&2
      return 1
    }
  done
  export GLMTUNE_SOURCE_DIR="$PWD"
  export LD_LIBRARY_PATH="$work/lib:$(cd "$carry" && pwd)/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# `carry_unpack CARRY`: a package that travelled as CARRY.tar.xz (build_carry.sh packs a large one
# so) is unpacked next to it when the folder itself is not there. Returns non-zero when neither is.
carry_unpack() {
  local carry="$1"
  if [[ ! -d "$carry" && -f "$carry.tar.xz" ]]; then
    python3 -c 'import sys, tarfile
safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **safe)' \
      "$carry.tar.xz" "$(dirname "$carry")" || {
      echo "carry_unpack: cannot unpack $carry.tar.xz" >&2
      return 2
    }
  fi
  if [[ ! -d "$carry" ]]; then
    echo "carry_unpack: no $carry here; run tests/gpu/build_carry.sh on the build machine first," \
      "then run this from the repository root" >&2
    return 2
  fi
}

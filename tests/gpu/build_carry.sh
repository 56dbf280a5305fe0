#!/usr/bin/env bash
# Builds the GPU test binaries and the CUDA benchmark on this (build) machine and packs them for a
# GPU machine that has the CUDA 13 runtime but not Debian's fmt / OpenBLAS / spdlog packages:
#
#   .gpu-carry/<binary>        every test_cuda_* test, every bench_cuda* benchmark and the glmtune
#                              CLI, stripped
#   .gpu-carry/lib/<soname>    the non-system shared libraries they load (found with ldd);
#                              libraries over 8 MiB are stored xz-compressed as <soname>.xz and
#                              unpacked by tests/gpu/run.sh
#   .gpu-carry/MANIFEST        what was built, from which commit, and the sizes
#   .gpu-carry.tar.xz          the folder packed in one xz stream, when it is over 48 MiB
#
# Usage (from anywhere):  tests/gpu/build_carry.sh
# Environment: GLMTUNE_GPU_BUILD_DIR (default <repo>/build-cuda), GLMTUNE_BUILD_JOBS (default 2),
# GLMTUNE_GPU_CARRY (the package folder, default <repo>/.gpu-carry), GLMTUNE_GPU_ONLY (an extended
# regular expression: only the binaries whose names match are built and packed),
# GLMTUNE_GPU_BASELINE (a commit: its glmtune CLI is packed too, as glmtune-baseline, for the
# before/after runs of tests/gpu/ab.sh; built from a worktree in <build>-baseline-src into
# <build>-baseline, which later calls reuse, so only what differs from the last baseline rebuilds).
# Then run tests/gpu/run.sh (or tests/gpu/ab.sh) on the GPU machine from the repository root.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${GLMTUNE_GPU_BUILD_DIR:-$root/build-cuda}"
jobs="${GLMTUNE_BUILD_JOBS:-2}"
carry="${GLMTUNE_GPU_CARRY:-$root/.gpu-carry}"

# Statically linked libstdc++/libgcc: the GPU machine's C++ runtime never matters.
configure() {
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGLMTUNE_CUDA=ON \
    -DGLMTUNE_STATIC_RUNTIME=ON -DGLMTUNE_TESTS=ON -DGLMTUNE_BENCH=ON -DGLMTUNE_VIDEO=OFF >/dev/null
}
configure "$root" "$build"

tests=()
only="${GLMTUNE_GPU_ONLY:-.}"
for src in "$root"/tests/unit/test_cuda_*.cpp; do
  name="$(basename "${src%.cpp}")"
  [[ "$name" =~ $only ]] && tests+=("$name")
done
benches=()
for src in "$root"/bench/bench_cuda*.cpp; do
  name="$(basename "${src%.cpp}")"
  [[ -e "$src" && "$name" =~ $only ]] && benches+=("$name")
done
if [[ ${#tests[@]} -eq 0 ]]; then
  echo "build_carry: no tests/unit/test_cuda_*.cpp found" >&2
  exit 1
fi
echo "build_carry: building ${#tests[@]} tests and ${#benches[@]} benchmarks in $build"
ninja -C "$build" -j "$jobs" glmtune "${tests[@]}" "${benches[@]}"

rm -rf "$carry"
mkdir -p "$carry/lib"
declare -A built=()  # binary name -> path in the build tree
for t in "${tests[@]}"; do built[$t]="$build/tests/$t"; done
for b in "${benches[@]}"; do built[$b]="$build/bench/$b"; done
# The CLI travels too, for commands run by hand there (glmtune bench step, glmtune env).
built[glmtune]="$build/bin/glmtune"
binaries=("${tests[@]}" "${benches[@]}" glmtune)

baseline="${GLMTUNE_GPU_BASELINE:-}"
if [[ -n "$baseline" ]]; then
  rev="$(git -C "$root" rev-parse --verify --quiet "$baseline^{commit}")" || {
    echo "build_carry: GLMTUNE_GPU_BASELINE=$baseline is not a commit of this repository" >&2
    exit 1
  }
  base_src="$build-baseline-src"
  base_build="$build-baseline"
  if [[ -e "$base_src/.git" ]]; then
    git -C "$base_src" checkout --quiet --detach "$rev"
  else
    git -C "$root" worktree add --quiet --detach "$base_src" "$rev"
  fi
  echo "build_carry: building the baseline glmtune of $(git -C "$root" rev-parse --short "$rev") in $base_build"
  configure "$base_src" "$base_build"
  ninja -C "$base_build" -j "$jobs" glmtune
  built[glmtune-baseline]="$base_build/bin/glmtune"
  binaries+=(glmtune-baseline)
fi
for b in "${binaries[@]}"; do
  cp "${built[$b]}" "$carry/$b"
  strip --strip-unneeded "$carry/$b"
done

# Libraries the GPU machine provides itself: glibc, the C++ runtime (linked statically anyway),
# the driver and the CUDA toolkit's libraries (cuBLAS/cuBLASLt live in /usr/local/cuda/lib64).
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | \
      libresolv.so* | libutil.so* | libstdc++.so* | libgcc_s.so* | libcuda.so* | libnvidia-* | \
      libcublas* | libcudart* | libnvrtc* | libnvJitLink* | libcufft* | libcurand* | \
      libcusparse* | libcusolver*)
      return 0
      ;;
  esac
  [[ "$1" == /usr/local/cuda* ]]
}

declare -A seen=()
for b in "${binaries[@]}"; do
  deps="$(ldd "${built[$b]}")"
  if grep -q "not found" <<<"$deps"; then
    echo "build_carry: $b has unresolved libraries on this machine:" >&2
    grep "not found" <<<"$deps" >&2
    exit 1
  fi
  # Lines look like "libfoo.so.1 => /path/libfoo.so.1 (0x...)".
  while read -r soname path; do
    [[ -n "$path" && -z "${seen[$soname]:-}" ]] || continue
    seen[$soname]=1
    is_system_lib "$path" && continue
    if (($(stat -L -c %s "$path") > 8 * 1024 * 1024)); then
      # Compressing OpenBLAS takes most of a minute: keep the result in the build tree.
      cached="$build/gpu-carry-xz/$soname.xz"
      if [[ ! "$cached" -nt "$path" ]]; then
        mkdir -p "$build/gpu-carry-xz"
        xz -T"$jobs" -6 -c "$path" >"$cached.tmp" && mv "$cached.tmp" "$cached"
      fi
      cp "$cached" "$carry/lib/$soname.xz"
    else
      cp -L "$path" "$carry/lib/$soname"
    fi
  done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<<"$deps")
done

# Every binary must at least start and list its tests here (with the system libraries).
for t in "${tests[@]}"; do
  "$carry/$t" --gtest_list_tests >/dev/null || {
    echo "build_carry: $t does not start" >&2
    exit 1
  }
done

{
  echo "glmtune GPU carry"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(
    git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  if [[ -n "$baseline" ]]; then
    echo "baseline: $(git -C "$root" rev-parse --short "$rev") (glmtune-baseline)"
  fi
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "binaries:"
  for b in "${binaries[@]}"; do printf '  %-36s %8d bytes\n' "$b" "$(stat -c %s "$carry/$b")"; done
  echo "libraries:"
  for l in "$carry"/lib/*; do
    [[ -e "$l" ]] && printf '  %-36s %8d bytes\n' "$(basename "$l")" "$(stat -c %s "$l")"
  done
} >"$carry/MANIFEST"
cat "$carry/MANIFEST"
total=$(du -sb "$carry" | cut -f1)
echo "build_carry: $carry holds $((total / 1024 / 1024)) MiB"
# The package travels to the GPU machine together with the repository: keep it small. Every binary
# links the whole library with its kernels, so the full set is hundreds of MiB; packed in one xz
# stream whose window spans several binaries, the shared parts are stored once (about 25 MiB for
# all of them). tests/gpu/run.sh unpacks it when the folder itself is not there.
rm -f "$carry.tar.xz"
if ((total > 48 * 1024 * 1024)); then
  tar -C "$(dirname "$carry")" -cf - "$(basename "$carry")" |
    xz -T"$jobs" -6 --lzma2=dict=256MiB >"$carry.tar.xz.tmp"
  mv "$carry.tar.xz.tmp" "$carry.tar.xz"
  packed=$(stat -c %s "$carry.tar.xz")
  echo "build_carry: packed into $carry.tar.xz, $((packed / 1024 / 1024)) MiB: carry that file" \
    "instead of the folder"
  if ((packed > 48 * 1024 * 1024)); then
    echo "build_carry: warning: even packed it is larger than 48 MiB; narrow GLMTUNE_GPU_ONLY" >&2
  fi
fi

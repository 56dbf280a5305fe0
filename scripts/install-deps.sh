#!/usr/bin/env bash
# Installs everything glmtune needs to build and test on Debian 12 (or Ubuntu 24.04), from the
# distribution's packages. Idempotent: packages already present are not fetched again.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libopenblas-dev nlohmann-json3-dev libpcre2-dev libcli11-dev libtomlplusplus-dev
  libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev jq
  libopenmpi-dev openmpi-bin
  clang-14 libclang-rt-14-dev clang-format
  libjpeg62-turbo-dev libpng-dev libwebp-dev libgif-dev libexif-dev
  libavformat-dev libavcodec-dev libavutil-dev libswscale-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"

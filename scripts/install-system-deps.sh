#!/usr/bin/env bash
# Install the system packages the end-to-end tests (tests/e2e) need:
# real Bazel (Debian's bazel-bootstrap 4.2.3) and ccache 4.7.x plus a C/C++
# toolchain and CMake.  Idempotent: does nothing when everything is present.
# Adding one: a line of its own in PACKAGES, with a comment naming what needs it.
set -euo pipefail

# bazel-bootstrap pulls in bazel-bootstrap-data (pre-extracted install base in
# /usr/share/bazel, including the @platforms repo Bazel uses offline) and
# default-jdk-headless.  bazel-platforms is NOT needed: Bazel 4.2.3 resolves
# @platforms to /usr/share/bazel/platforms from bazel-bootstrap-data.
# bazel-rules-cc is too new for 4.2.3: the e2e workspace ships shims instead.
PACKAGES=(
  bazel-bootstrap   # /usr/bin/bazel -> bazel-4 (4.2.3)
  ccache            # 4.7.5: remote_storage http:// with layout=bazel|subdirs|flat
  cmake
  g++
  gcc
  make
  libc6-dev
  ninja-build       # the CMake generator the launcher tests and bench use
  git               # buildvault artifact: the key tree follows git ls-files (tests/run)
  apache2-utils     # htpasswd: the auth tests write their htpasswd files with the real tool
  bubblewrap        # bwrap: the remote-execution workers' sandbox (--sandbox auto|bwrap)
  redis-server      # the execution tests' own Redis (scale-out queue), started on a free port
  podman            # tests/container: builds and runs docker/Dockerfile
  runc              # tests/container: podman's runtime (crun fails on these hosts' cgroups)
  debootstrap       # tests/container: the local Debian base image (registries are unreachable)
  docker-compose    # tests/container: `docker-compose config` validates docker/compose.yml
  chromium          # tests/integration/test_admin_status_page.py: the status page, headless
  chromium-driver   # tests/browser: Selenium drives chromium through the build pages
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-system-deps: all present (${PACKAGES[*]})"
  exit 0
fi

echo "install-system-deps: installing ${missing[*]}"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "install-system-deps: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only if they look absent (fresh container).
if ! apt-cache show bazel-bootstrap >/dev/null 2>&1; then
  "${SUDO[@]}" apt-get update
fi
"${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"

dpkg-query -W -f='install-system-deps: ${Package} ${Version}\n' "${PACKAGES[@]}"

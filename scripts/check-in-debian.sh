#!/usr/bin/env bash
# Runs the README's two commands (scripts/train.sh, scripts/test.sh) on a fresh minimal Debian
# root of the given release, as a new user would on that Debian:
#
#   sudo scripts/check-in-debian.sh trixie          # Debian 13: libtorch 2.6, python3-torch 2.6
#   sudo scripts/check-in-debian.sh bookworm        # Debian 12: libtorch 1.13
#   sudo scripts/check-in-debian.sh trixie --only test      # just the test command (CI)
#   sudo scripts/check-in-debian.sh trixie -- -R cli.       # extra arguments go to ctest
#   sudo scripts/check-in-debian.sh trixie --shell 'python3 bench/ddp_vs_pytorch.py'
#
# The root is made once with `debootstrap --variant=minbase RELEASE ROOT MIRROR` (MIRROR: the one
# the host's apt sources name) and kept in $DDPKIT_ROOTS (default /var/cache/ddpkit/roots), outside
# the checkout; later runs reuse it, with the packages install-deps.sh put there. The checkout's
# files (tracked and untracked-not-ignored) are copied to /work/ddpkit in the root each run; its
# build/ folder stays there between runs. The host's ccache folder is mounted into the root.
# /proc, /dev and the ccache folder are unmounted on every exit, error or signal.
set -euo pipefail

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
release=$1
shift
case "$release" in
  bookworm | trixie) ;;
  *) echo "check-in-debian: release must be bookworm or trixie, got '$release'" >&2; usage ;;
esac
only=""
shell_cmd=""
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:?--only needs train or test}; shift 2 ;;
    --shell) shell_cmd=${2:?--shell needs a command}; shift 2 ;;
    --) shift; ctest_args=("$@"); break ;;
    *) echo "check-in-debian: unknown argument '$1'" >&2; usage ;;
  esac
done
case "$only" in "" | train | test) ;; *) echo "check-in-debian: --only takes train or test, got '$only'" >&2; exit 2 ;; esac
[ "$(id -u)" -eq 0 ] || { echo "check-in-debian: needs root (debootstrap, chroot, mounts)" >&2; exit 2; }

here=$(cd "$(dirname "$0")/.." && pwd)
roots=${DDPKIT_ROOTS:-/var/cache/ddpkit/roots}
root=$roots/$release
mkdir -p "$roots"

# One user of a root at a time: a second run waits (bounded) instead of sharing mounts.
exec 9>"$roots/$release.lock"
flock -w 3600 9 || { echo "check-in-debian: $root is busy (lock held for an hour)" >&2; exit 1; }

host_mirror() {
  local m=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
    m=$(awk '$1 == "deb" && $2 !~ /security/ {print ($2 ~ /^\[/ ? $3 : $2); exit}' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

mounted=()
cleanup() {
  local rc=$?
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[$i]}" 2>/dev/null || umount -R -l "${mounted[$i]}" 2>/dev/null || true
  done
  # What the tests mounted inside (ip netns's /run/netns), deepest first.
  if [ -n "${root:-}" ]; then
    awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
      umount -l "$m" 2>/dev/null || true
    done
  fi
  if [ -n "${root:-}" ] && grep -q " $root/" /proc/mounts; then
    echo "check-in-debian: warning: mounts under $root remain:" >&2
    grep " $root/" /proc/mounts >&2 || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ ! -f "$root/.ddpkit-root-ready" ]; then
  command -v debootstrap >/dev/null || {
    echo "check-in-debian: installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  mirror=$(host_mirror)
  echo "check-in-debian: debootstrap --variant=minbase $release $root $mirror"
  rm -rf "$root.partial"
  debootstrap --variant=minbase "$release" "$root.partial" "$mirror" >"$roots/$release.debootstrap.log" 2>&1 || {
    echo "check-in-debian: debootstrap failed; the end of $roots/$release.debootstrap.log:" >&2
    tail -20 "$roots/$release.debootstrap.log" >&2
    exit 1
  }
  rm -rf "$root"
  mv "$root.partial" "$root"
  touch "$root/.ddpkit-root-ready"
fi

cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
mkdir -p "$root/proc" "$root/sys" "$root/dev" "$root/ccache" "$root/work/ddpkit"
# The root on itself, so that its / is a mount point: `ip netns exec` and `ip -n` (the multi-host
# tests' namespaces) make / a slave mount and remount /sys in a namespace of their own, which
# fails on a plain directory ("mount --make-rslave /" failed: Invalid argument).
mount --bind "$root" "$root"
mount --make-private "$root"
mounted+=("$root")
mount -t proc proc "$root/proc"
mounted+=("$root/proc")
mount -t sysfs sysfs "$root/sys"
mounted+=("$root/sys")
mount --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"  # unmounting below must not reach the host's /dev
mounted+=("$root/dev")
ccache_dir=$(ccache -k cache_dir 2>/dev/null || true)
ccache_dir=${ccache_dir:-${CCACHE_DIR:-$HOME/.cache/ccache}}
mkdir -p "$ccache_dir"
mount --bind "$ccache_dir" "$root/ccache"
mounted+=("$root/ccache")

# The checkout as git sees it, over the previous copy; build/ is kept for incremental builds. Only
# files whose content changed are written, with the current time; the others keep theirs. (With
# tar's preserved times, a source edited after an earlier copy but before that copy's build
# finished looked older than its object and was never rebuilt.)
dest=$root/work/ddpkit
stage=$root/work/ddpkit.stage
rm -rf "$stage" && mkdir -p "$stage"
(cd "$here" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$stage"
(cd "$stage" && find . \( -type f -o -type l \) -print0) | while IFS= read -r -d '' f; do
  if ! cmp -s "$stage/$f" "$dest/$f" 2>/dev/null; then
    mkdir -p "$(dirname "$dest/$f")" && rm -f "$dest/$f" && cp -P "$stage/$f" "$dest/$f" && touch -h "$dest/$f"
  fi
done
(cd "$dest" && find . -path ./build -prune -o \( -type f -o -type l \) -print0) | while IFS= read -r -d '' f; do
  [ -e "$stage/$f" ] || [ -L "$stage/$f" ] || rm -f "$dest/$f"
done
rm -rf "$stage"
# The checkout's ../shared (reference material) travels too when present.
[ -d "$here/../shared" ] && { rm -rf "$root/work/shared"; cp -r "$here/../shared" "$root/work/shared"; }

run_in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM="${TERM:-dumb}" CCACHE_DIR=/ccache CI="${CI:-}" DDPKIT_JOBS="${DDPKIT_JOBS:-2}" \
    /bin/bash -c "cd /work/ddpkit && $1"
}

echo "check-in-debian: Debian $(cat "$root/etc/debian_version") ($release) in $root"
if [ -n "$shell_cmd" ]; then
  run_in_root "$shell_cmd"
  exit $?
fi
if [ "$only" != test ]; then
  echo "check-in-debian: [$release] ./scripts/train.sh"
  run_in_root "./scripts/train.sh"
fi
if [ "$only" != train ]; then
  echo "check-in-debian: [$release] ./scripts/test.sh ${ctest_args[*]}"
  run_in_root "./scripts/test.sh $(printf '%q ' "${ctest_args[@]}")"
fi

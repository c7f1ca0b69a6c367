#!/usr/bin/env bash
# bundle.sh — pack kvd and kvctl into a relocatable tarball that runs on a host without the
# build dependencies (ZeroMQ, libuv, protobuf-c, jemalloc, libsodium; the CUDA runtime when
# built with CUDA), plus the deployment files, with a SHA-256 checksum.
#
# Layout of the bundle (unpack anywhere; /opt/kvd is what deploy/kvd@.service and the
# DaemonSet expect):
#
#   kvd-VERSION-linux-ARCH/
#     bin/kvd, bin/kvctl         launchers: run libexec/<name> with lib/ first on the library
#                                path; they resolve their own location, so a symlink in
#                                /usr/local/bin works
#     bin/kvd-svc, bin/kvd-node  service helpers (deploy/kvd-svc, deploy/k8s/kvd-node)
#     libexec/kvd, libexec/kvctl the real executables, unmodified
#     lib/                       every shared library they load except the C library's own
#                                (libc, libm, libdl, libpthread, librt, libresolv, ld-linux)
#                                and the NVIDIA driver's (libcuda, libnvidia-*): those must come
#                                from the host, matching its kernel and driver
#     etc/kvd.conf               deploy/kvd.conf (every directive with its default)
#     share/{systemd,k8s,prometheus,grafana}/, docs/
#     BUNDLE                     version, commit, build host, glibc needed, file list + SHA-256
#
# Why launchers and not an $ORIGIN rpath: the binaries stay byte-identical to the tested build
# (no patchelf, which is not a build dependency), and LD_LIBRARY_PATH is set only for the
# exec'd process. The host's glibc must be at least the one named in BUNDLE (the build's
# newest GLIBC_ symbol version): glibc is never bundled, it must match the host's ld.so.
#
# The tarball is reproducible for a given build: sorted names, owner 0, mtime = the commit's.
set -euo pipefail

prog=bundle.sh
die() { echo "$prog: $*" >&2; exit 1; }

usage() {
    cat <<'EOF'
usage: deploy/bundle.sh [--build DIR] [--out DIR] [--add FILE]... [--no-check]

  --build DIR   build tree holding kvd/kvd and client/kvctl (default: build)
  --out DIR     where the tarball and its .sha256 go (default: the current directory)
  --add FILE    also pack FILE (an executable gets a launcher like kvd's; e.g.
                --add build/engine-shim/kvbench)
  --no-check    skip the self-check (unpack into a temporary directory and run
                bin/kvd --version and bin/kvctl --help with an empty environment)

Output: OUT/kvd-VERSION-linux-ARCH.tar.gz and OUT/kvd-VERSION-linux-ARCH.tar.gz.sha256
(verify with: sha256sum -c kvd-*.tar.gz.sha256). Install: docs/deploy.md.
EOF
}

top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=build
out=.
check=1
extra=()
while [ $# -gt 0 ]; do
    case $1 in
    --build) [ $# -ge 2 ] || die "--build needs a directory"; build=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; out=$2; shift 2 ;;
    --add) [ $# -ge 2 ] || die "--add needs a file"; extra+=("$2"); shift 2 ;;
    --no-check) check=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done

for tool in ldd tar gzip sha256sum objdump; do
    command -v "$tool" >/dev/null 2>&1 ||
        die "needs '$tool' on PATH (Debian: apt-get install binutils coreutils tar gzip libc-bin)"
done
# relative --build is taken from the repository root, like the README's build/ paths
case $build in /*) ;; *) [ -d "$build" ] || build=$top/$build ;; esac
[ -d "$build" ] || die "no build directory '$build' (build first: cmake -S . -B build -G Ninja && ninja -C build kvd kvctl)"
kvd_bin=$build/kvd/kvd
kvctl_bin=$build/client/kvctl
for b in "$kvd_bin" "$kvctl_bin"; do
    [ -x "$b" ] || die "no executable $b (build it: ninja -C $build kvd kvctl)"
done
for f in "${extra[@]}"; do [ -f "$f" ] || die "--add: no file '$f'"; done
mkdir -p "$out" || die "cannot create output directory '$out'"
out=$(cd "$out" && pwd)

version=$("$kvd_bin" --version 2>/dev/null | awk '{print $2}') || true
[ -n "$version" ] || die "'$kvd_bin --version' printed no version (is it a kvd binary for this machine?)"
commit=unknown
epoch=0
if git -C "$top" rev-parse --git-dir >/dev/null 2>&1; then
    commit=$(git -C "$top" rev-parse --short=12 HEAD)
    epoch=$(git -C "$top" log -1 --format=%ct HEAD)
    git -C "$top" diff --quiet HEAD -- 2>/dev/null || commit=$commit-dirty
fi
arch=$(uname -m)
name=kvd-$version-linux-$arch
stage=$(mktemp -d "${TMPDIR:-/tmp}/kvd-bundle.XXXXXX")
trap 'rm -rf "$stage"' EXIT
root=$stage/$name
mkdir -p "$root"/{bin,libexec,lib,etc,docs} "$root"/share/{systemd,k8s,prometheus,grafana}

# Libraries to leave to the host: glibc's own (must match the host's ld.so) and the NVIDIA
# driver's user-space side (must match the host's kernel module).
skip='/(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libnsl|ld-linux[^/]*|libcuda|libnvidia[^/]*)\.so'

# pack_elf FILE: the executable into libexec/, a launcher into bin/, its libraries into lib/.
pack_elf() {
    local f=$1 base
    base=$(basename "$f")
    cp -L "$f" "$root/libexec/$base"
    chmod 0755 "$root/libexec/$base"
    local missing
    missing=$(ldd "$f" | awk '/=> not found/ {print $1}')
    [ -z "$missing" ] || die "$f needs libraries this machine does not have: $missing"
    ldd "$f" | awk '/=> \// {print $3}' | { grep -vE "$skip" || true; } | while read -r lib; do
        cp -Ln "$lib" "$root/lib/" 2>/dev/null || true
    done
    cat >"$root/bin/$base" <<EOF
#!/bin/sh
# Launcher from deploy/bundle.sh: run the bundled $base with the bundle's libraries first.
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/../libexec/$base" "\$@"
EOF
    chmod 0755 "$root/bin/$base"
}

# ELF magic: 0x7f 'E' 'L' 'F' (no dependency on file(1), absent from minimal images)
is_elf() { [ "$(head -c 4 "$1" | tr -d '\177')" = ELF ]; }

pack_elf "$kvd_bin"
pack_elf "$kvctl_bin"
for f in "${extra[@]}"; do
    if is_elf "$f"; then pack_elf "$f"; else install -m 0755 "$f" "$root/bin/"; fi
done
install -m 0755 "$top/deploy/kvd-svc" "$root/bin/kvd-svc"
install -m 0755 "$top/deploy/k8s/kvd-node" "$root/bin/kvd-node"
install -m 0644 "$top/deploy/kvd.conf" "$root/etc/kvd.conf"
install -m 0644 "$top/deploy/kvd@.service" "$root/share/systemd/"
install -m 0644 "$top/deploy/kvd-mps@.service" "$root/share/systemd/"
install -m 0644 "$top/deploy/k8s/kvd-daemonset.yaml" "$root/share/k8s/"
install -m 0644 "$top"/deploy/prometheus/*.yml "$root/share/prometheus/"
install -m 0644 "$top"/deploy/grafana/*.json "$root/share/grafana/"
for d in deploy.md daemon.md protocol.md snapshot.md; do
    [ -f "$top/docs/$d" ] && install -m 0644 "$top/docs/$d" "$root/docs/"
done
chmod 0644 "$root"/lib/* 2>/dev/null || true

# The newest glibc symbol version any packed binary or library needs: the host minimum.
glibc=$(for f in "$root"/libexec/* "$root"/lib/*; do
            [ -f "$f" ] && objdump -T "$f" 2>/dev/null
        done | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
{
    echo "name:    $name"
    echo "version: $version"
    echo "commit:  $commit"
    echo "built:   $(uname -srm), $(ldd --version | head -n 1)"
    echo "needs:   Linux $arch with ${glibc:-GLIBC (unknown)} or newer; for backend = cuda, the"
    echo "         NVIDIA driver (libcuda.so.1) of the host"
    echo "files (sha256):"
    (cd "$root" && find . -type f ! -name BUNDLE | LC_ALL=C sort | sed 's|^\./||' |
        xargs sha256sum | sed 's/^/  /')
} >"$root/BUNDLE"

tarball=$out/$name.tar.gz
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" \
    -cf - "$name" | gzip -9n >"$tarball"
(cd "$out" && sha256sum "$name.tar.gz" >"$name.tar.gz.sha256")

if [ "$check" = 1 ]; then
    t=$(mktemp -d "${TMPDIR:-/tmp}/kvd-bundle-check.XXXXXX")
    (cd "$out" && sha256sum -c --quiet "$name.tar.gz.sha256") || { rm -rf "$t"; die "checksum mismatch"; }
    tar -C "$t" -xzf "$tarball"
    # An empty environment: nothing from this shell (LD_LIBRARY_PATH included) helps it run.
    if ! env -i "$t/$name/bin/kvd" --version >/dev/null 2>"$t/err" ||
       ! env -i "$t/$name/bin/kvctl" --help >/dev/null 2>>"$t/err"; then
        cat "$t/err" >&2
        rm -rf "$t"
        die "self-check failed: the unpacked bundle does not run"
    fi
    nf=$(LD_LIBRARY_PATH=$t/$name/lib ldd "$t/$name/libexec/kvd" | grep -c 'not found' || true)
    rm -rf "$t"
    [ "$nf" = 0 ] || die "self-check failed: libraries not found for the unpacked kvd"
fi
echo "$prog: $tarball ($(du -h "$tarball" | cut -f1), ${glibc:-glibc ?}+, commit $commit)"
echo "$prog: $(cat "$tarball.sha256")"

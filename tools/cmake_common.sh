# Sourced by tools/cmake_build.sh and tools/cmake_package_check.sh (needs ROOT): the cache
# directory, ccache that hits across checkouts, unity builds and the compiler launcher.
CACHE="${FSDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/libtorch-fsdp}"
export CCACHE_DIR="$CACHE/ccache"
# Hits across checkouts of the same sources: paths under ROOT are rewritten relative to the
# working directory (the build tree, also under ROOT), and that directory is not hashed.
export CCACHE_BASEDIR="$ROOT"
export CCACHE_NOHASHDIR=1
# Every target reuses one precompiled header (cmake/FsdpTargets.cmake); ccache caches such
# compiles only when told that the PCH's macros and timestamps may be ignored.
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# Unity builds (up to 16 sources of a target per translation unit): LibTorch's headers are
# parsed, and their inline code instantiated, once per batch instead of once per source
# (docs/development/building.md). They also turn two same-named helpers in one target's
# anonymous namespaces into a compile error: copies of one helper are caught.
UNITY=(-DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16)
LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then
  mkdir -p "$CCACHE_DIR"
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
else
  echo "warning: ccache not found (Debian: apt-get install ccache); building without it"
fi

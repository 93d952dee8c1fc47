"""External repositories that libtorch_fsdp's BUILD files refer to, for any workspace.

Our BUILD files name `@libtorch`, `@system`, `@cuda`, `@torch_cuda_deps` and load `@rules_cc`. Bazel 4 resolves
those names in the *main* workspace's namespace, so a workspace that depends on this one
must declare them too. It calls this macro from its WORKSPACE:

    local_repository(name = "libtorch_fsdp", path = "/path/to/libtorch-fsdp")
    load("@libtorch_fsdp//:deps.bzl", "libtorch_fsdp_dependencies")
    libtorch_fsdp_dependencies()                      # or torch_root = "/abs/.../site-packages/torch"

This workspace's own WORKSPACE calls it too, so both always agree. Everything is local (the
build is offline): each repository is a directory of symlinks to a tree on this machine plus
a BUILD file from //third_party, like `new_local_repository`, except that relative paths are
relative to *this* repository's root, not to the calling workspace's.

Args of libtorch_fsdp_dependencies (every path absolute, or relative to libtorch_fsdp's root):
  torch_root: the torch package directory of the pinned wheel (has include/, lib/,
      share/cmake/Torch). Default: third_party/torch_root, the link `./x setup` makes.
  cuda_root: CUDA toolkit (only `--config=cuda` uses it). Default:
      third_party/cuda_root (made by `./x setup` when nvcc is present); may be missing.
  torch_cuda_deps: the torch wheel's CUDA dependencies, the `nvidia` directory of an install
      of torch with its dependencies (NCCL, CUDA runtime, cuDNN, ...; only `--config=cuda`
      uses it). Default: third_party/torch_cuda_deps (made by `./x setup`); may be missing.
  system_root: where the Debian packages (gtest, benchmark, absl, gloo headers) live.
  offline_rule_shims: also declare rules_cc / rules_java / remote_coverage_tools as the
      offline stand-ins from third_party/bazel_shims (needed with Debian's bazel-bootstrap
      without network). False if the calling workspace provides real ones.
A repository the calling workspace already declared (before this call) is left alone.
"""

def _libtorch_fsdp_root(rctx):
    # Label() here resolves in the repository that holds this file: libtorch_fsdp's root
    # (seen from a consumer: <output_base>/external/libtorch_fsdp).
    return rctx.path(Label("//:BUILD.bazel")).dirname

def _resolve(rctx, path):
    if path.startswith("/"):
        return rctx.path(path)
    return rctx.path("%s/%s" % (_libtorch_fsdp_root(rctx), path))

def _local_tree_impl(rctx):
    src = _resolve(rctx, rctx.attr.path)
    build_file = rctx.attr.build_file
    if src.exists:
        for entry in src.readdir():
            name = entry.basename
            if build_file and name in ("BUILD", "BUILD.bazel", "WORKSPACE", "WORKSPACE.bazel"):
                continue
            rctx.symlink(entry, name)
    elif rctx.attr.required:
        fail(("@%s: %s does not exist (%s). Run ./x setup in libtorch_fsdp, or pass the " +
              "directory to libtorch_fsdp_dependencies().") % (rctx.name, src, rctx.attr.hint))
    if build_file:
        rctx.symlink(build_file, "BUILD.bazel")
    if not rctx.path("WORKSPACE").exists:
        rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

# new_local_repository / local_repository whose relative paths start at libtorch_fsdp's root.
_local_tree = repository_rule(
    implementation = _local_tree_impl,
    local = True,
    attrs = {
        "path": attr.string(mandatory = True),
        "build_file": attr.label(allow_single_file = True),
        "required": attr.bool(default = True),
        "hint": attr.string(),
    },
)

def _maybe(name, **kwargs):
    if native.existing_rule(name) == None:
        _local_tree(name = name, **kwargs)

def libtorch_fsdp_dependencies(
        torch_root = "third_party/torch_root",
        cuda_root = "third_party/cuda_root",
        torch_cuda_deps = "third_party/torch_cuda_deps",
        system_root = "/usr",
        offline_rule_shims = True):
    """Declares @libtorch, @system, @cuda, @torch_cuda_deps (and the offline rule shims); see the file doc."""
    if offline_rule_shims:
        for shim in ("rules_cc", "rules_java", "remote_coverage_tools"):
            _maybe(
                name = shim,
                path = "third_party/bazel_shims/" + shim,
                hint = "offline stand-in shipped with libtorch_fsdp",
            )

    # LibTorch (CPU part) from the pinned torch wheel (third_party/torch_version.txt).
    _maybe(
        name = "libtorch",
        path = torch_root,
        build_file = Label("//third_party:libtorch.BUILD"),
        hint = "the torch package directory of the pinned wheel",
    )

    # GoogleTest, Google Benchmark, abseil and gloo headers from Debian packages.
    _maybe(
        name = "system",
        path = system_root,
        build_file = Label("//third_party:system.BUILD"),
        hint = "the prefix of the Debian packages",
    )

    # CUDA toolkit (only used under --config=cuda); an empty repository without it.
    _maybe(
        name = "cuda",
        path = cuda_root,
        build_file = Label("//third_party:cuda.BUILD"),
        required = False,
    )

    # The torch wheel's CUDA dependencies (NCCL headers and libraries libtorch_cuda.so was
    # built with; only used under --config=cuda); an empty repository without them.
    _maybe(
        name = "torch_cuda_deps",
        path = torch_cuda_deps,
        build_file = Label("//third_party:torch_cuda_deps.BUILD"),
        required = False,
    )

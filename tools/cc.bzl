"""The C++ rules every BUILD file of this repository loads: rules_cc's cc_library, cc_test and
cc_binary, plus LibTorch's most used headers precompiled once per configuration.

Why: a TU that includes ATen spends most of its compile time in LibTorch's headers, and a
precompiled header halves it (docs/development/building.md has the figures and how they were
measured). Bazel has no precompiled-header support, so:

- torch_precompiled_header compiles tools/torch_pch_headers.h with the C++ toolchain's own
  command line for the current configuration (features, --copt/--cxxopt, LibTorch's include
  directories and defines, -fPIC: every compile here is position-independent) into
  bazel-bin/<pkg>/torch_pch.h.gch/pic.h, next to a copy of the header, bazel-bin/<pkg>/torch_pch.h.
- The macros below add that target to deps and `-include tools/torch_pch.h` to copts. GCC finds
  the copy through the `-iquote bazel-out/<cfg>/bin` that Bazel passes (no source file of that
  name exists), looks into the torch_pch.h.gch directory first, and uses a precompiled header
  there only if it was built with compatible flags; otherwise it reads the header itself:
  slower, never wrong (-Winvalid-pch shows which).
- Every TU of a target built this way sees those LibTorch headers; the TSan step of `./x check`
  builds with `--define=torch_pch=off` so a missing #include still fails somewhere.

Two tiers, because the headers cost a TU more than reading them: GCC instantiates what their
inline code needs in every TU that includes them, precompiled or not, and the ATen-only header
costs an empty TU a fraction of the full one's time (docs/development/building.md). Each
target says which it needs:
  torch_pch unset    //tools:torch_pch, tools/torch_pch_headers.h (ATen, torch::nn, torch::optim)
  torch_pch = "aten" //tools:torch_pch_aten, tools/torch_pch_aten_headers.h (ATen only)
  torch_pch = False  none (no source includes LibTorch; also for targets without LibTorch)
tools/pch_tiers.py computes each target's tier from its sources' includes. The CMake build
precompiles the same header lists (cmake/FsdpTargets.cmake: fsdp_pch, fsdp_pch_aten).
"""

load("@bazel_tools//tools/build_defs/cc:action_names.bzl", "CPP_COMPILE_ACTION_NAME")
load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load(
    "@rules_cc//cc:defs.bzl",
    _cc_binary = "cc_binary",
    _cc_library = "cc_library",
    _cc_test = "cc_test",
)

def _features(ctx, cc_toolchain):
    return cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )

def _cpp_compile_command(ctx, cc_toolchain, features, context, source, flags, output = None):
    """(compiler, arguments, environment) of the toolchain's C++ compile of `source` for the
    current configuration (--copt/--cxxopt, `context`'s include paths and defines, -fPIC),
    plus `flags`."""
    variables = cc_common.create_compile_variables(
        feature_configuration = features,
        cc_toolchain = cc_toolchain,
        source_file = source,
        output_file = output,
        user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts + flags,
        include_directories = context.includes,
        quote_include_directories = context.quote_includes,
        system_include_directories = context.system_includes,
        preprocessor_defines = context.defines,
        use_pic = True,
    )
    return (
        cc_common.get_tool_for_action(feature_configuration = features, action_name = CPP_COMPILE_ACTION_NAME),
        cc_common.get_memory_inefficient_command_line(
            feature_configuration = features,
            action_name = CPP_COMPILE_ACTION_NAME,
            variables = variables,
        ),
        cc_common.get_environment_variables(
            feature_configuration = features,
            action_name = CPP_COMPILE_ACTION_NAME,
            variables = variables,
        ),
    )

def _torch_precompiled_header_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    deps_context = cc_common.merge_cc_infos(
        cc_infos = [d[CcInfo] for d in ctx.attr.deps],
    ).compilation_context
    header = ctx.actions.declare_file(ctx.attr.name + ".h")
    ctx.actions.expand_template(template = ctx.file.src, output = header, substitutions = {})
    pch = ctx.actions.declare_file(ctx.attr.name + ".h.gch/pic.h")
    compiler, arguments, env = _cpp_compile_command(
        ctx,
        cc_toolchain,
        _features(ctx, cc_toolchain),
        deps_context,
        header.path,
        ["-x", "c++-header"],
        output = pch.path,
    )
    ctx.actions.run(
        executable = compiler,
        arguments = arguments,
        env = env,
        inputs = depset([header], transitive = [cc_toolchain.all_files, deps_context.headers]),
        outputs = [pch],
        mnemonic = "CppPrecompiledHeader",
        progress_message = "Precompiling LibTorch headers %s" % ctx.label,
    )
    own = CcInfo(compilation_context = cc_common.create_compilation_context(
        headers = depset([header, pch]),
    ))
    return [
        DefaultInfo(files = depset([header, pch])),
        cc_common.merge_cc_infos(cc_infos = [own] + [d[CcInfo] for d in ctx.attr.deps]),
    ]

torch_precompiled_header = rule(
    implementation = _torch_precompiled_header_impl,
    doc = "A header and its GCC precompiled form (<name>.h, <name>.h.gch/pic.h), a CcInfo dep.",
    attrs = {
        "src": attr.label(allow_single_file = [".h"], mandatory = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)

# The torch_precompiled_header targets in tools/BUILD.bazel (each writes <name>.h there), by
# the tier a target names in torch_pch.
_PCH_PACKAGE = "tools"
_PCH_NAMES = {True: "torch_pch", "nn": "torch_pch", "aten": "torch_pch_aten"}

def _with_torch_pch(kwargs):
    tier = kwargs.pop("torch_pch", True)
    if tier == False or not kwargs.get("srcs"):
        return kwargs
    if tier not in _PCH_NAMES:
        fail("torch_pch must be True, \"nn\", \"aten\" or False, got %r" % (tier,))
    name = _PCH_NAMES[tier]
    off = "//%s:torch_pch_off" % _PCH_PACKAGE
    kwargs["deps"] = kwargs.get("deps", []) + select({
        off: [],
        "//conditions:default": ["//%s:%s" % (_PCH_PACKAGE, name)],
    })
    kwargs["copts"] = kwargs.get("copts", []) + select({
        off: [],
        "//conditions:default": ["-include", "%s/%s.h" % (_PCH_PACKAGE, name)],
    })
    return kwargs

# Unity builds: a target's .cc files are compiled as TUs of up to _UNITY_BATCH sources each,
# a generated <name>_unity_<i>.cc that #includes them in srcs order. Why: with the precompiled
# header a TU still pays seconds before its own code (GCC instantiates the inline code of
# LibTorch's headers that the TU uses, in every TU), which was most of a cold build's compile
# time (docs/development/building.md). The sources stay the files
# diagnostics name; they are inputs of the unity compile as textual headers of a private
# <name>_unity_sources library, so a changed source recompiles its batch. Sources of one
# target share a TU: two same-named helpers in their anonymous namespaces are a compile
# error (rename one, or share it). --define=unity=off (//tools:unity_off) compiles each
# source alone. Targets whose srcs are a select() or name other targets are left as they are.
_UNITY_BATCH = 8
_UNITY_OFF = "//%s:unity_off" % _PCH_PACKAGE

def _is_label(src):
    return src.startswith(":") or src.startswith("//") or src.startswith("@")

def _with_unity(kwargs):
    srcs = kwargs.get("srcs")
    if type(srcs) != "list":
        return kwargs
    sources = [s for s in srcs if s.endswith(".cc")]
    if len(sources) < 2 or [s for s in sources if _is_label(s)]:
        return kwargs
    name = kwargs["name"]
    prefix = native.package_name()
    prefix = prefix + "/" if prefix else ""
    _cc_library(
        name = name + "_unity_sources",
        textual_hdrs = sources,
        testonly = kwargs.get("testonly", False),
        visibility = ["//visibility:private"],
    )
    unity_srcs = []
    for i in range(0, len(sources), _UNITY_BATCH):
        out = "%s_unity_%d.cc" % (name, i // _UNITY_BATCH)
        lines = ["// Generated by tools/cc.bzl (unity build of %s)." % name]
        lines += ['#include "%s%s"' % (prefix, s) for s in sources[i:i + _UNITY_BATCH]]
        native.genrule(
            name = out.replace(".cc", "_src"),
            outs = [out],
            cmd = "printf '%%s\\n' %s > $@" % " ".join(["'%s'" % l for l in lines]),
            testonly = kwargs.get("testonly", False),
            visibility = ["//visibility:private"],
        )
        unity_srcs.append(":" + out)
    others = [s for s in srcs if not s.endswith(".cc")]
    kwargs["srcs"] = select({
        _UNITY_OFF: srcs,
        "//conditions:default": others + unity_srcs,
    })
    kwargs["deps"] = kwargs.get("deps", []) + [":" + name + "_unity_sources"]
    # An included source's __FILE__ would read "./pkg/x.cc" (found through -iquote .); the
    # map keeps it "pkg/x.cc", as when the file is compiled on its own.
    kwargs["copts"] = kwargs.get("copts", []) + select({
        _UNITY_OFF: [],
        "//conditions:default": ["-fmacro-prefix-map=./="],
    })
    return kwargs

# Every public header compiles on its own: for each header a public library exports, a
# one-include TU is compiled with -fsyntax-only and the library's own command line (its include
# paths, defines and precompiled-header tier). The compiler's verdict is written to a file, not
# a failed action, so `bazel build //...` still builds; the test <library>_headers_alone_test
# reads the verdicts and fails naming each header that does not compile with what GCC said.
# With the precompiled LibTorch header (the default), the check covers a header's project and
# standard includes; --define=torch_pch=off also covers its LibTorch includes.
def _headers_alone_test_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    features = _features(ctx, cc_toolchain)
    lib = ctx.attr.lib[CcInfo].compilation_context
    context = cc_common.merge_cc_infos(
        cc_infos = [ctx.attr.lib[CcInfo]] + ([ctx.attr.pch[CcInfo]] if ctx.attr.pch else []),
    ).compilation_context
    pch_flags = ["-include", "%s/%s.h" % (_PCH_PACKAGE, ctx.attr.pch.label.name)] if ctx.attr.pch else []
    verdicts = []
    by_path = {h.short_path: h for h in lib.direct_public_headers}
    for path in sorted(by_path):
        base = "%s/%s" % (ctx.label.name, path)
        tu = ctx.actions.declare_file(base + ".cc")
        ctx.actions.write(tu, '#include "%s"\n' % path)
        verdict = ctx.actions.declare_file(base + ".verdict")
        compiler, arguments, env = _cpp_compile_command(
            ctx,
            cc_toolchain,
            features,
            context,
            tu.path,
            pch_flags + ["-fsyntax-only"],
        )
        # A verdict is cached like any action output, also one from a compile that failed for
        # another reason than the header (a checkout deleted under a running build); the
        # leading no-op names the verdicts' version: bump it to drop every cached verdict.
        ctx.actions.run_shell(
            command = ': verdicts v2; out="$1"; shift; if "$@" > "$out.log" 2>&1; then echo ok > "$out"; ' +
                      'else { echo "%s does not compile on its own:"; cat "$out.log"; } > "$out"; fi; ' % path +
                      'rm -f "$out.log"',
            arguments = [verdict.path, compiler] + arguments,
            env = env,
            inputs = depset([tu], transitive = [cc_toolchain.all_files, context.headers]),
            outputs = [verdict],
            mnemonic = "CppHeaderAlone",
            progress_message = "Compiling %s on its own" % path,
        )
        verdicts.append((verdict, path))
    if not verdicts:
        fail("%s exports no header to check" % ctx.attr.lib.label)
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(script, "\n".join([
        "#!/bin/sh",
        "# Generated by tools/cc.bzl: each public header of %s, compiled alone." % ctx.attr.lib.label,
        "failed=0",
        "check() {",
        '  if [ "$(cat "$1")" = ok ]; then echo "ok: $2"; else cat "$1"; failed=$((failed + 1)); fi',
        "}",
    ] + ["check '%s' '%s'" % (v.short_path, h) for v, h in verdicts] + [
        'echo "%d header(s), $failed failed"' % len(verdicts),
        '[ "$failed" -eq 0 ]',
        "",
    ]), is_executable = True)
    return [DefaultInfo(executable = script, runfiles = ctx.runfiles(files = [v for v, _ in verdicts]))]

_headers_alone_test = rule(
    implementation = _headers_alone_test_impl,
    test = True,
    attrs = {
        "lib": attr.label(providers = [CcInfo], mandatory = True),
        "pch": attr.label(providers = [CcInfo]),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)

def _headers_alone(kwargs):
    """Adds <name>_headers_alone_test for a public, non-testonly library that exports headers."""
    if "//visibility:public" not in kwargs.get("visibility", []) or kwargs.get("testonly") or not kwargs.get("hdrs"):
        return
    tier = kwargs.get("torch_pch", True)
    pch = None
    if tier != False:
        pch = select({
            "//%s:torch_pch_off" % _PCH_PACKAGE: None,
            "//conditions:default": "//%s:%s" % (_PCH_PACKAGE, _PCH_NAMES[tier]),
        })
    _headers_alone_test(
        name = kwargs["name"] + "_headers_alone_test",
        lib = ":" + kwargs["name"],
        pch = pch,
        size = "small",
        tags = ["headers_alone"],
    )

def cc_library(**kwargs):
    _headers_alone(kwargs)
    _cc_library(**_with_torch_pch(_with_unity(kwargs)))

def cc_test(**kwargs):
    _cc_test(**_with_torch_pch(_with_unity(kwargs)))

def cc_binary(**kwargs):
    _cc_binary(**_with_torch_pch(_with_unity(kwargs)))

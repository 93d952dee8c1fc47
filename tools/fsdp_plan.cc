// fsdp_plan: print how FSDP would shard a list of parameter shapes, without running anything.
//
// Value flags are strings and validated by fsdp_plan_lib so that every bad value gets one
// message naming the flag and exit status 2 (absl's own typed-flag errors exit 1). Unknown
// flags and positional arguments are caught here for the same reason.
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "comm/main_guard.h"
#include "tools/fsdp_memory.h"
#include "tools/fsdp_plan_lib.h"

ABSL_FLAG(std::string, shapes, "",
          "Comma-separated parameter shapes, dims joined by 'x', in module order: "
          "5x3,6,1024x1024. Required.");
ABSL_FLAG(std::string, world, "1", "Total number of ranks (>= 1).");
ABSL_FLAG(std::string, mesh, "",
          "Empty: 1-D FSDP over --world ranks. RxS: HSDP with R replicas x S shards "
          "(R*S must equal --world).");
ABSL_FLAG(std::string, dtype, "f32", "Parameter dtype as stored (sharded): f32|bf16|f16|f64.");
ABSL_FLAG(std::string, param_dtype, "", "Mixed precision: unsharded/all-gather/compute dtype (empty: --dtype).");
ABSL_FLAG(std::string, reduce_dtype, "", "Mixed precision: gradient reduce-scatter dtype (empty: the param dtype).");
ABSL_FLAG(std::string, style, "fsdp2",
          "fsdp2: FSDP2 fully_shard (each parameter chunked on dim 0). fsdp1: FSDP1 "
          "FlatParameter (all parameters flattened into one, then chunked).");
ABSL_FLAG(bool, align, true,
          "fsdp1 only: use_orig_params layout (each parameter starts on a 16-byte boundary, "
          "total padded to a multiple of the shard count); --noalign: use_orig_params=False.");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of text.");
ABSL_FLAG(bool, memory, false,
          "Also predict the per-rank allocation peak of a training step (tools/fsdp_memory.h): "
          "--shapes is one FSDP unit, repeated --units times.");
ABSL_FLAG(std::string, units, "1", "--memory: number of identical FSDP units (blocks) of --shapes.");
ABSL_FLAG(std::string, optimizer, "adamw", "--memory: adamw|adam|sgd|sgd_momentum|adagrad|rmsprop.");
ABSL_FLAG(std::string, activation_bytes, "0", "--memory: bytes each unit saves for backward, per rank.");
ABSL_FLAG(bool, reshard_after_forward, true, "--memory: FSDP frees unsharded parameters after forward.");

namespace {

constexpr char kUsage[] =
    "Plans FSDP sharding for a list of parameter shapes without running anything.\n"
    "\n"
    "  fsdp_plan --shapes 5x3,6,1024x1024 --world 4 [--mesh 2x2] [--dtype f32|bf16|f16|f64]\n"
    "            [--param_dtype bf16] [--reduce_dtype f32] [--style fsdp2|fsdp1]\n"
    "            [--noalign] [--json]\n"
    "            [--memory --units 64 --optimizer adamw --activation_bytes 6208\n"
    "             --noreshard_after_forward]\n"
    "\n"
    "Per shard rank (replicas hold the same): each parameter's local and padded shard\n"
    "(fsdp2) or the flat shard range and the original parameters it covers (fsdp1);\n"
    "bytes of sharded parameters, gradients, AdamW state and reduce-scatter output; the\n"
    "unsharded all-gather buffer; and the FULL_SHARD communication volume per step.\n"
    "--memory adds the predicted per-rank allocation peak of a step and its parts.\n"
    "Bad flag values exit with status 2.";

// Returns the name of the first argument that is not a defined flag ("" if none), so that an
// unknown flag fails with status 2 before absl::ParseCommandLine would exit(1) on it.
std::string FirstUnknownFlag(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") break;  // the rest are positional
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const bool has_value = arg.find('=') != std::string_view::npos;
    std::string name(arg.substr(0, arg.find('=')));
    // absl's usage flags are not registered flags; ParseCommandLine handles them itself.
    for (const char* usage :
         {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version", "only_check_args"}) {
      if (name == usage) return "";
    }
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && name.rfind("no", 0) == 0) {  // --noalign, --nojson
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr && !flag->IsOfType<bool>()) flag = nullptr;
      if (flag != nullptr) continue;
    }
    if (flag == nullptr) return std::string(argv[i]);
    // "--shapes 5x3": the next argument is this flag's value, not a flag.
    if (!has_value && !flag->IsOfType<bool>()) ++i;
  }
  return "";
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "fsdp_plan: %s\n(see fsdp_plan --help)\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    absl::SetProgramUsageMessage(kUsage);
    if (std::string unknown = FirstUnknownFlag(argc, argv); !unknown.empty()) {
      return Fail("unknown flag '" + unknown + "'");
    }
    std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
    if (rest.size() > 1) {
      return Fail(std::string("unexpected argument '") + rest[1] + "' (flags take the form --name=value)");
    }
    fsdp_plan::RawFlags raw;
    raw.shapes = absl::GetFlag(FLAGS_shapes);
    raw.world = absl::GetFlag(FLAGS_world);
    raw.mesh = absl::GetFlag(FLAGS_mesh);
    raw.dtype = absl::GetFlag(FLAGS_dtype);
    raw.param_dtype = absl::GetFlag(FLAGS_param_dtype);
    raw.reduce_dtype = absl::GetFlag(FLAGS_reduce_dtype);
    raw.style = absl::GetFlag(FLAGS_style);
    raw.align = absl::GetFlag(FLAGS_align);
    fsdp_plan::PlanOptions options;
    if (std::string err = fsdp_plan::ParseOptions(raw, &options); !err.empty()) return Fail(err);
    fsdp_plan::RawMemoryFlags raw_memory;
    raw_memory.units = absl::GetFlag(FLAGS_units);
    raw_memory.optimizer = absl::GetFlag(FLAGS_optimizer);
    raw_memory.activation_bytes = absl::GetFlag(FLAGS_activation_bytes);
    raw_memory.reshard_after_forward = absl::GetFlag(FLAGS_reshard_after_forward);
    fsdp_plan::MemoryOptions memory_options;
    if (std::string err = fsdp_plan::ParseMemoryOptions(raw_memory, &memory_options); !err.empty()) return Fail(err);
    const fsdp_plan::Plan plan = fsdp_plan::MakePlan(options);
    const bool json = absl::GetFlag(FLAGS_json);
    std::string out = json ? fsdp_plan::FormatJson(plan) : fsdp_plan::FormatText(plan);
    if (absl::GetFlag(FLAGS_memory)) {
      const fsdp_plan::MemoryEstimate memory = fsdp_plan::EstimateMemory(plan, memory_options);
      if (json) {  // one object: its members, then the memory member
        out.resize(out.rfind('}'));
        out += ", " + fsdp_plan::FormatMemoryJson(memory) + "}\n";
      } else {
        out += fsdp_plan::FormatMemoryText(memory);
      }
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    return 0;
  });
}

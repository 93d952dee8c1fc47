// Writes PyTorch corpora of the fuzz targets from real files: make_seeds DIR creates
// DIR/full_state_dict/, DIR/optim_state/, DIR/torchrun_env/, DIR/dcp_metadata/ and
// DIR/safetensors/.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "comm/fake_process_group.h"
#include "comm/flight_recorder.h"
#include "comm/profiler_range.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fuzz/fuzz_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"

namespace {
void Write(const std::filesystem::path& dir, const fsdp::fuzz::NamedBytes& files) {
  std::filesystem::create_directories(dir);
  for (const auto& [name, bytes] : files) {
    std::ofstream out(dir / name, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    std::printf("%s: %zu bytes\n", (dir / name).c_str(), bytes.size());
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path dir(argv[1]);
  // Every seed must load (else the fuzzer starts from files the loaders reject at once).
  fsdp::fuzz::Target& target = fsdp::fuzz::SharedTarget();
  const fsdp::fuzz::NamedBytes full = fsdp::fuzz::FullStateDictSeeds(), optim = fsdp::fuzz::OptimStateSeeds();
  for (const auto& [name, bytes] : full) fsdp::checkpoint::DeserializeTensorDict(bytes, name);
  fsdp::fsdp2::LoadFullStateDict(*target.model, fsdp::checkpoint::DeserializeTensorDict(full[0].second, full[0].first));
  for (const auto& [name, bytes] : optim) {
    const auto sd = fsdp::optim_state::DeserializeOptimStateDict(bytes, name);
    fsdp::optim_state::LoadFullOptimStateDict(
        *target.model, sd.optimizer == "SGD" ? static_cast<torch::optim::Optimizer&>(*target.sgd) : *target.adamw, sd);
  }
  Write(dir / "full_state_dict", full);
  Write(dir / "optim_state", optim);
  auto text = [](const std::string& s) { return std::vector<char>(s.begin(), s.end()); };
  Write(dir / "torchrun_env", {{"ok", text("1\n4\n1\n127.0.0.1\n29500")}, {"no_local", text("0\n1")}});
  // A two-rank checkpoint's .metadata as our writer makes it (tools/fuzz.sh adds Python's).
  namespace ckpt = fsdp::checkpoint;
  const std::filesystem::path data_dir = dir / "dcp_metadata_data";
  std::filesystem::create_directories(data_dir);
  const at::Tensor w = at::arange(12, at::kFloat).view({3, 4});
  std::vector<ckpt::DcpFragment> fragments;
  for (int64_t rank = 0; rank < 2; ++rank) {
    const at::Tensor rows = w.narrow(0, rank * 2, rank == 0 ? 2 : 1).contiguous();
    fragments.push_back(ckpt::WriteRankData(
        data_dir.string(), rank, {{"model.w", {3, 4}, at::kFloat, {rank * 2, 0}, rows}},
        rank == 0 ? std::vector<ckpt::DcpBytesItem>{{"optim.lr", text("0.01")}} : std::vector<ckpt::DcpBytesItem>{}));
  }
  const std::vector<char> metadata = ckpt::SerializeDcpMetadata(ckpt::MergeDcpFragments(fragments, data_dir.string()));
  ckpt::ParseDcpMetadata(metadata.data(), metadata.size(), "seed");  // must load
  Write(dir / "dcp_metadata", {{"ours.metadata", metadata}});
  // A flight recorder dump of three collectives, one of them inside a profiler range.
  {
    auto pg = fsdp::comm::CreateFakeProcessGroup(0, 2);
    at::Tensor t = at::ones({2, 3});
    const fsdp::comm::ProfilerLabel range("FSDP::all_gather (layers.0)");
    {
      fsdp::comm::ProfilerRange issuer(range);
      pg->all_gather_into_tensor(at::empty({4, 3}), t)->wait();
    }
    pg->all_reduce(t)->wait();
    pg->new_subgroup({0, 1}, "mesh_dp")->barrier();
    Write(dir / "fr_trace", {{"ours.dump", text(fsdp::comm::FlightRecorder::ForRank(0).Pickle())}});
  }
  // Our writer's safetensors files (tools/fuzz.sh adds Python's, fuzz/testdata/*.safetensors).
  ckpt::TensorDict tensors;
  tensors.insert("model.w", at::arange(12, at::kFloat).view({3, 4}));
  tensors.insert("model.b", at::arange(4, at::kBFloat16));
  tensors.insert("step", at::scalar_tensor(3, at::kLong));
  tensors.insert("mask", at::ones({2}, at::kBool));
  tensors.insert("empty", at::empty({0, 2}, at::kHalf));
  const std::vector<char> ours = ckpt::SerializeSafetensors(tensors, ckpt::SafetensorsMetadata{{"format", "pt"}});
  (void)ckpt::SafetensorsReader(ours.data(), ours.size(), "seed");  // must load
  Write(dir / "safetensors",
        {{"ours.safetensors", ours}, {"no_metadata.safetensors", ckpt::SerializeSafetensors(tensors)}});
  // Hugging Face directories (hf_checkpoint_fuzz's input: a 4-byte index length, the index,
  // the file): with an index; and a per-rank file with DCP_SHARDING_INFO (whole tensors).
  const auto hf_input = [](const std::string& index, const std::vector<char>& file) {
    std::vector<char> input(4);
    const uint32_t n = static_cast<uint32_t>(index.size());
    std::memcpy(input.data(), &n, 4);
    input.insert(input.end(), index.begin(), index.end());
    input.insert(input.end(), file.begin(), file.end());
    return input;
  };
  const std::vector<char> sharded = ckpt::SerializeSafetensors(
      tensors, ckpt::HfShardingMetadata(
                   {{"empty", {0, 0}}, {"mask", {0}}, {"model.b", {0}}, {"model.w", {0, 0}}, {"step", {}}}));
  Write(dir / "hf_checkpoint",
        {{"index", hf_input(R"({"metadata": {"total_size": 80}, "weight_map": {"model.w": "a.safetensors", )"
                            R"("model.b": "a.safetensors"}})",
                            ours)},
         {"sharded", hf_input("", sharded)}});
  return 0;
}

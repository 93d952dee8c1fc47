// dcp::SaveHuggingFace and dcp::ConsolidateHuggingFace (hf.h): HuggingFaceStorageWriter(
// save_distributed=True, enable_consolidation=True) with get_model_state_dict
// (torch/distributed/checkpoint/hf_storage.py), its consolidation split over the ranks as
// _consolidate_hf_safetensors.py consolidate_safetensors_files_on_every_rank splits it, but
// by input file and without a whole tensor in memory: each chunk goes into place a block at a
// time.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "dcp/adapter.h"
#include "dcp/collectives.h"
#include "dcp/hf.h"
#include "dcp/hf_model.h"
#include "dcp/plan.h"

namespace fsdp::dcp {
namespace {

constexpr char kSaveHf[] = "dcp::SaveHuggingFace";
constexpr char kConsolidateHf[] = "dcp::ConsolidateHuggingFace";
constexpr char kAsyncSaveHf[] = "dcp::AsyncSaveHuggingFace";

namespace fs = std::filesystem;

void RemoveIfThere(const std::string& path, const char* caller) {
  TORCH_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, caller, ": cannot remove '", path, "' (",
              std::strerror(errno), ")");
}

// Rank 0, before any rank writes: `dir` and `dir`/sharded exist, the old index is gone (an
// export being overwritten stops being complete) and so are old per-rank files (another world
// size's would join the consolidation).
void PrepareDirs(const std::string& dir, const HfSaveOptions& options, const char* caller) {
  std::error_code ec;
  const std::string sharded = checkpoint::JoinPath(dir, checkpoint::kHfShardedDir);
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, caller, ": cannot create '", dir, "' (", ec.message(), ")");
  RemoveIfThere(checkpoint::JoinPath(dir, checkpoint::kHfIndexFile), caller);
  if (options.consolidate && !options.keep_sharded) {
    fs::remove_all(sharded, ec);  // none are written, and old ones must not stay
    TORCH_CHECK(!ec, caller, ": cannot remove '", sharded, "' (", ec.message(), ")");
  } else {
    fs::create_directories(sharded, ec);
    TORCH_CHECK(!ec, caller, ": cannot create '", sharded, "' (", ec.message(), ")");
    for (const fs::directory_entry& e : fs::directory_iterator(sharded, ec)) {
      if (absl::EndsWith(e.path().filename().string(), ".safetensors")) RemoveIfThere(e.path().string(), caller);
    }
    TORCH_CHECK(!ec, caller, ": cannot list '", sharded, "' (", ec.message(), ")");
  }
  const std::string& copy_files_from = options.copy_files_from;
  if (copy_files_from.empty()) return;
  for (const fs::directory_entry& e : fs::directory_iterator(copy_files_from, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file(ec) || absl::EndsWith(name, ".safetensors") || name == checkpoint::kHfIndexFile) continue;
    fs::copy_file(e.path(), fs::path(dir) / name, fs::copy_options::overwrite_existing, ec);
    TORCH_CHECK(!ec, caller, ": cannot copy '", e.path().string(), "' into '", dir, "' (", ec.message(), ")");
  }
  TORCH_CHECK(!ec, caller, ": cannot list '", copy_files_from, "' (copy_files_from; ", ec.message(), ")");
}

// Writes the export of `layout` under out_dir, collective over `world` (null: one rank): every
// rank runs `check`, rank 0 creates the files, every rank writes its part (`write_part`),
// fsyncs what it wrote, and rank 0 writes the index last.
void WriteExport(const checkpoint::HfExportLayout& layout, const std::string& out_dir,
                 const comm::ProcessGroupPtr& world, const char* caller, const std::function<void()>& check,
                 const std::function<void(checkpoint::HfExportWriter&)>& write_part) {
  const int rank = world ? world->rank() : 0;
  std::string error = internal::ErrorOf([&] {
    check();
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    TORCH_CHECK(!ec, caller, ": cannot create '", out_dir, "' (", ec.message(), ")");
    RemoveIfThere(checkpoint::JoinPath(out_dir, checkpoint::kHfIndexFile), caller);
    for (size_t f = 0; f < layout.file_count(); ++f) layout.CreateFile(out_dir, f, caller);
  });
  internal::AgreeOrThrow(world, error, caller);
  error = internal::ErrorOf([&] {
    checkpoint::HfExportWriter writer(layout, out_dir, caller);
    write_part(writer);
    writer.Sync();
  });
  internal::AgreeOrThrow(world, error, caller);
  error = internal::ErrorOf([&] {
    if (rank != 0) return;
    const std::string index = layout.IndexJson();
    checkpoint::WriteFileAtomically(checkpoint::JoinPath(out_dir, checkpoint::kHfIndexFile),
                                    std::vector<char>(index.begin(), index.end()), caller);
  });
  internal::AgreeOrThrow(world, error, caller);
}

// Consolidation of `reader`'s chunks into `layout`'s files: each rank copies the chunks of
// input files rank, rank + W, ...
void Consolidate(const checkpoint::HfCheckpointReader& reader, const checkpoint::HfExportLayout& layout,
                 const std::string& out_dir, const comm::ProcessGroupPtr& world, const char* caller) {
  const int rank = world ? world->rank() : 0, size = world ? world->size() : 1;
  const auto check = [&] {
    size_t listed = 0;
    for (const checkpoint::HfTensor& t : reader.tensors()) {
      size_t file = 0;
      const checkpoint::SafetensorsEntry* e = layout.Find(t.name, &file);
      TORCH_CHECK(e != nullptr && e->shape == t.size, caller, ": '", reader.dir(), "' holds '", t.name, "'",
                  e == nullptr ? std::string(", which the export does not")
                               : absl::StrCat(" of size ", c10::str(c10::IntArrayRef(t.size)), ", the export ",
                                              c10::str(c10::IntArrayRef(e->shape))));
      ++listed;
    }
    size_t wanted = 0;
    for (size_t f = 0; f < layout.file_count(); ++f) wanted += layout.file(f).entries.size();
    TORCH_CHECK(listed == wanted, caller, ": '", reader.dir(),
                "' lacks tensors of the export (a rank's file is missing?)");
  };
  WriteExport(layout, out_dir, world, caller, check, [&](checkpoint::HfExportWriter& writer) {
    for (size_t f = static_cast<size_t>(rank); f < reader.files().size(); f += static_cast<size_t>(size)) {
      for (const checkpoint::HfTensor& t : reader.tensors()) {
        for (const checkpoint::HfChunk& c : t.chunks) {
          if (c.file == f) writer.Copy(reader, t, c);
        }
      }
    }
  });
}

std::vector<checkpoint::HfExportTensor> ExportTensors(const checkpoint::HfCheckpointReader& reader,
                                                      std::optional<at::ScalarType> dtype) {
  std::vector<checkpoint::HfExportTensor> out;
  for (const checkpoint::HfTensor& t : reader.tensors()) {
    out.push_back({t.name, dtype && at::isFloatingType(t.dtype) ? *dtype : t.dtype, t.size});
  }
  return out;
}

// `exported` as bytes for AllGatherBytes: per tensor its name, dtype and shape.
std::vector<char> EncodeExported(const std::vector<checkpoint::HfExportTensor>& exported) {
  std::vector<char> out;
  const auto put = [&out](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
  };
  for (const checkpoint::HfExportTensor& t : exported) {
    const uint64_t length = t.name.size(), dims = t.shape.size();
    const int32_t dtype = static_cast<int32_t>(t.dtype);
    put(&length, sizeof(length));
    put(t.name.data(), length);
    put(&dtype, sizeof(dtype));
    put(&dims, sizeof(dims));
    put(t.shape.data(), dims * sizeof(int64_t));
  }
  return out;
}

// Every rank's exported tensors (EncodeExported), each once, in rank order of first sight: so
// ranks that hold different tensors (a rank's pipeline stages) export the whole model, and
// ranks that hold the same ones export them as any one of them would. A name two ranks give
// different dtypes or shapes is an error.
std::vector<checkpoint::HfExportTensor> UnionOfExported(const std::vector<std::vector<char>>& every_rank,
                                                        const char* caller) {
  std::vector<checkpoint::HfExportTensor> out;
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t rank = 0; rank < every_rank.size(); ++rank) {
    const std::vector<char>& bytes = every_rank[rank];
    size_t at = 0;
    const auto get = [&](void* p, size_t n) {
      TORCH_INTERNAL_ASSERT(at + n <= bytes.size(), caller, ": a short list of exported tensors from rank ", rank);
      std::memcpy(p, bytes.data() + at, n);
      at += n;
    };
    while (at < bytes.size()) {
      checkpoint::HfExportTensor t;
      uint64_t length = 0, dims = 0;
      int32_t dtype = 0;
      get(&length, sizeof(length));
      t.name.resize(length);
      get(t.name.data(), length);
      get(&dtype, sizeof(dtype));
      t.dtype = static_cast<at::ScalarType>(dtype);
      get(&dims, sizeof(dims));
      t.shape.resize(dims);
      get(t.shape.data(), dims * sizeof(int64_t));
      const auto [it, inserted] = index.emplace(t.name, out.size());
      if (inserted) {
        out.push_back(std::move(t));
        continue;
      }
      const checkpoint::HfExportTensor& first = out[it->second];
      TORCH_CHECK(first.dtype == t.dtype && first.shape == t.shape, caller, ": rank ", rank, " exports '", t.name,
                  "' as ", t.dtype, " ", c10::str(c10::IntArrayRef(t.shape)), " but an earlier rank as ", first.dtype,
                  " ", c10::str(c10::IntArrayRef(first.shape)));
    }
  }
  return out;
}

// What a rank writes, planned (collective over the model's world): its per-rank files, each
// tensor a box of the model's (a view, or a CPU snapshot for an async save), and the export's
// layout.
struct HfSavePlan {
  comm::ProcessGroupPtr world;
  int rank = 0, size = 1;
  checkpoint::HfExportLayout layout{{}, 0};
  struct RankFile {
    checkpoint::TensorDict tensors;
    std::vector<std::pair<std::string, std::vector<int64_t>>> offsets;
  };
  std::map<std::pair<int64_t, size_t>, RankFile> files;  // (shard index, export file) -> file
};

HfSavePlan PlanHfSave(torch::nn::Module& model, const std::string& dir, const HfSaveOptions& options, bool snapshot,
                      const char* caller) {
  const std::unique_ptr<internal::ModelAdapter> adapter = internal::AdapterFor(model, caller);  // reshards
  HfSavePlan plan;
  plan.world = adapter->world();
  plan.rank = plan.world ? plan.world->rank() : 0;
  plan.size = plan.world ? plan.world->size() : 1;
  std::vector<internal::HfModelTensor> tensors;
  std::vector<internal::PlannedItem> items;
  std::vector<std::pair<size_t, internal::Box>> chunks;  // (tensor, box), as items
  std::vector<checkpoint::HfExportTensor> exported;
  std::string error = internal::ErrorOf([&] {
    if (plan.rank == 0) PrepareDirs(dir, options, caller);
    tensors = internal::HfModelTensors(model, *adapter, options.key_of, caller);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const internal::HfModelTensor& t = tensors[i];
      const at::ScalarType stored = t.tensor.scalar_type();
      const at::ScalarType type = options.dtype && at::isFloatingType(stored) ? *options.dtype : stored;
      exported.push_back({t.keys.front(), type, t.global_size});
      std::vector<internal::Box> boxes = {internal::WholeBox(t.global_size)};
      if (t.sharded != nullptr)
        boxes = t.sharded->local().defined() ? t.sharded->boxes() : std::vector<internal::Box>{};
      for (internal::Box& box : boxes) {
        items.push_back({internal::ChunkKey(t.keys.front(), box.global_offsets),
                         box.numel() * static_cast<int64_t>(c10::elementSize(type)), false});
        chunks.emplace_back(i, std::move(box));
      }
    }
  });
  const std::vector<char> keep = internal::DedupOverWorld(plan.world, error, items, caller);
  const std::vector<std::vector<char>> every_rank_exported =
      plan.size > 1 ? comm::AllGatherBytes(plan.world, EncodeExported(exported)) : std::vector<std::vector<char>>{};
  error = internal::ErrorOf([&] {
    if (plan.size > 1) exported = UnionOfExported(every_rank_exported, caller);
    plan.layout = checkpoint::HfExportLayout(exported, options.consolidate ? options.max_shard_size : 0);
    absl::flat_hash_map<size_t, int64_t> boxes_of;  // tensor -> boxes planned so far
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (!keep[i]) continue;
      const auto& [ti, box] = chunks[i];
      const internal::HfModelTensor& t = tensors[ti];
      const at::Tensor local = t.sharded ? t.sharded->local() : t.tensor.detach();
      TORCH_CHECK(!local.is_meta(), caller, ": '", t.keys.front(), "' is on the meta device: it has no data to save");
      size_t file = 0;
      plan.layout.Find(t.keys.front(), &file);
      const int64_t shard = plan.rank + 1 + boxes_of[ti]++ * plan.size;
      HfSavePlan::RankFile& f = plan.files[{shard, file}];
      const at::Tensor part = internal::BoxOf(local, box);
      // A snapshot: training may change the model as soon as AsyncSaveHuggingFace returns.
      f.tensors.insert(t.keys.front(),
                       snapshot ? part.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous() : part);
      f.offsets.emplace_back(t.keys.front(), box.global_offsets);
    }
  });
  internal::AgreeOrThrow(plan.world, error, caller);
  return plan;
}

// Writes the planned per-rank files, then consolidates (collective over `group`, the world's
// ranks), then removes the per-rank files unless kept.
void FinishHfSave(HfSavePlan& plan, const std::string& dir, const HfSaveOptions& options,
                  const comm::ProcessGroupPtr& group, const char* caller) {
  const std::string sharded = checkpoint::JoinPath(dir, checkpoint::kHfShardedDir);
  if (options.consolidate && !options.keep_sharded) {
    // No per-rank files wanted: each rank writes its boxes straight into their places, the
    // bytes the consolidation of its per-rank files would copy there.
    WriteExport(
        plan.layout, dir, group, caller, [] {},
        [&](checkpoint::HfExportWriter& writer) {
          for (const auto& [where, part] : plan.files) {
            for (const auto& [key, offsets] : part.offsets) writer.Write(key, offsets, part.tensors[key]);
          }
        });
    plan.files.clear();
    return;
  }
  std::string error = internal::ErrorOf([&] {
    const std::string sharded = checkpoint::JoinPath(dir, checkpoint::kHfShardedDir);
    const int64_t count = static_cast<int64_t>(plan.layout.file_count());
    for (const auto& [where, part] : plan.files) {
      const std::string path = checkpoint::JoinPath(
          sharded, checkpoint::HfFileName(static_cast<int64_t>(where.second) + 1, count, where.first));
      checkpoint::SaveSafetensors(path, part.tensors, checkpoint::HfShardingMetadata(part.offsets), options.dtype);
    }
  });
  plan.files.clear();  // on disk: an async save's snapshot is freed before waiting for the others
  internal::AgreeOrThrow(group, error, caller);
  if (!options.consolidate) return;
  std::unique_ptr<checkpoint::HfCheckpointReader> reader;
  error = internal::ErrorOf([&] { reader = std::make_unique<checkpoint::HfCheckpointReader>(sharded, caller); });
  internal::AgreeOrThrow(group, error, caller);
  Consolidate(*reader, plan.layout, dir, group, caller);
}

}  // namespace

void SaveHuggingFace(torch::nn::Module& model, const std::string& dir, const HfSaveOptions& options) {
  HfSavePlan plan = PlanHfSave(model, dir, options, /*snapshot=*/false, kSaveHf);
  FinishHfSave(plan, dir, options, plan.world, kSaveHf);
}

AsyncSaveHandle AsyncSaveHuggingFace(torch::nn::Module& model, const std::string& dir, const HfSaveOptions& options,
                                     comm::ProcessGroupPtr background_group) {
  auto plan = std::make_shared<HfSavePlan>(PlanHfSave(model, dir, options, /*snapshot=*/true, kAsyncSaveHf));
  const comm::ProcessGroupPtr group = internal::BackgroundGroup(plan->world, background_group, kAsyncSaveHf);
  return internal::StartAsyncSave(
      [plan, dir, options, group] { FinishHfSave(*plan, dir, options, group, kAsyncSaveHf); });
}

void ConsolidateHuggingFace(const std::string& sharded_dir, const std::string& out_dir,
                            const HfConsolidateOptions& options, comm::ProcessGroupPtr group) {
  std::unique_ptr<checkpoint::HfCheckpointReader> reader;
  std::unique_ptr<checkpoint::HfExportLayout> layout;
  const std::string error = internal::ErrorOf([&] {
    reader = std::make_unique<checkpoint::HfCheckpointReader>(sharded_dir, kConsolidateHf);
    layout =
        std::make_unique<checkpoint::HfExportLayout>(ExportTensors(*reader, options.dtype), options.max_shard_size);
  });
  internal::AgreeOrThrow(group, error, kConsolidateHf);
  Consolidate(*reader, *layout, out_dir, group, kConsolidateHf);
}

}  // namespace fsdp::dcp
